"""`python -m jaxsys.serve --workdir W`: the HTTP completions endpoint (jaxsys/serve/server.py)."""

from __future__ import annotations

import argparse
import sys

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import data as data_lib
from jaxsys.config import ConfigError, parse_with_overrides
from jaxsys.data import BYTE_SOURCES


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Serve a jaxsys checkpoint over HTTP (OpenAI-style completions).")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--step", type=int)
    parser.add_argument("--pages", type=int, help="pages in a batch shard's KV pool (config.serve.pages)")
    parser.add_argument("--page-size", type=int, help="token slots per page (config.serve.page_size)")
    parser.add_argument("--token-budget", type=int, help="tokens per engine step (config.serve.token_budget)")
    parser.add_argument("--chunk-size", type=int, help="prefill chunk, Sarathi-Serve (config.serve.chunk_size)")
    parser.add_argument("--max-seqs", type=int, help="sequences running at once (config.serve.max_seqs)")
    args, overrides = parse_with_overrides(parser, argv, "--config.mesh.tensor=2")
    from jaxsys.checkpoint import load
    from jaxsys.mesh import cpu_unless_accelerator
    from jaxsys.serve import build_engine, server
    from jaxsys.serve.runner import check_servable

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
    except (ValueError, ConfigError, checkpoint_lib.CheckpointError, data_lib.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    httpd, loop = server.serve(eng, config.data.source in BYTE_SOURCES, args.workdir, args.host, args.port)
    sv = config.serve
    print(
        f"jaxsys.serve: {args.workdir} on http://{args.host}:{httpd.server_address[1]}/v1/completions "
        f"({sv.pages} pages of {sv.page_size} tokens, budget {sv.token_budget}, chunk {sv.chunk_size}, "
        f"{sv.policy})",
        file=sys.stderr,
        flush=True,
    )
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown(httpd, loop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
