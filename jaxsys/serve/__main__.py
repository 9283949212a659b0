"""`python -m jaxsys.serve --workdir W`: the OpenAI-compatible HTTP server (jaxsys/serve/server.py)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import data as data_lib
from jaxsys.config import ConfigError, parse_with_overrides


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Serve a jaxsys checkpoint over HTTP (OpenAI's completions and chat API)."
    )
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    parser.add_argument("--step", type=int)
    parser.add_argument("--served-model-name", help="the `model` clients name (default: the workdir as given)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("JAXSYS_API_KEY"),
        help="require 'Authorization: Bearer <key>' on every route but /health (default: $JAXSYS_API_KEY)",
    )
    parser.add_argument("--max-queue", type=int, default=256, help="requests waiting for their first token; more: 429")
    parser.add_argument("--max-body-bytes", type=int, default=16 << 20, help="request body limit; more: 413")
    parser.add_argument("--skip-warmup", action="store_true", help="do not compile every step size before serving")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--pages", type=int, help="pages in a batch shard's KV pool (config.serve.pages)")
    parser.add_argument("--page-size", type=int, help="token slots per page (config.serve.page_size)")
    parser.add_argument("--token-budget", type=int, help="tokens per engine step (config.serve.token_budget)")
    parser.add_argument("--chunk-size", type=int, help="prefill chunk, Sarathi-Serve (config.serve.chunk_size)")
    parser.add_argument("--max-seqs", type=int, help="sequences running at once (config.serve.max_seqs)")
    args, overrides = parse_with_overrides(parser, argv, "--config.mesh.tensor=2")
    from jaxsys import tokenizer as tokenizer_lib
    from jaxsys.checkpoint import load
    from jaxsys.mesh import cpu_unless_accelerator
    from jaxsys.serve import build_engine, server
    from jaxsys.serve.runner import check_servable

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    cpu_unless_accelerator()
    flags = {
        "pages": args.pages,
        "page_size": args.page_size,
        "token_budget": args.token_budget,
        "chunk_size": args.chunk_size,
        "max_seqs": args.max_seqs,
    }
    overrides = overrides + [f"--config.serve.{k}={v}" for k, v in flags.items() if v is not None]
    try:
        program, params, config = load(args.workdir, overrides, args.step, check=check_servable)
        eng = build_engine(program, params)  # config.serve: disaggregated, speculative, the cache
        tok = tokenizer_lib.for_config(config, args.workdir)
        name = args.served_model_name or args.workdir
        httpd, loop = server.serve(
            eng,
            tok,
            name,
            args.host,
            args.port,
            api_key=args.api_key,
            max_queue=args.max_queue,
            max_body=args.max_body_bytes,
            log_level=args.log_level,
        )
    except (ValueError, OSError, ConfigError, checkpoint_lib.CheckpointError, data_lib.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.skip_warmup:
        eng.warmup()
    sv = config.serve
    host, port = httpd.server_address
    print(
        f"jaxsys.serve: {name} on http://{host}:{port}/v1 (completions, chat/completions, models; "
        f"tokenizer: {tok.name if tok is not None else 'none, token ids only'}; context "
        f"{server.context_length(eng)} tokens; {sv.pages} pages of {sv.page_size}, budget {sv.token_budget}, "
        f"chunk {sv.chunk_size}, {sv.policy}{'; API key required' if args.api_key else ''})",
        file=sys.stderr,
        flush=True,
    )
    try:
        httpd.serve_forever()  # Ctrl-C / SIGTERM: uvicorn shuts down gracefully
    finally:
        server.shutdown(httpd, loop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
