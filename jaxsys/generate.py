"""Generate a continuation from any workdir's checkpoint: a trained run, a Hugging Face conversion,
or a quantized one (`jaxsys.quantize`).

    python -m jaxsys.generate --workdir W --prompt "def main(" [--max-new-tokens 64]
        [--temperature 0.8 --top-k 40 --top-p 0.95 --seed 0] [--step S] [--config.key=value ...]

Prints the continuation on stdout as it is generated: text for a byte-level corpus
(config.data.source stdlib or text), else space-separated token ids (and `--prompt` is then
space-separated ids too). Logs go to stderr. Overrides change how it runs (the mesh:
`--config.mesh.tensor=2`; kernels; config.serve's cache), not the model. It is the serving engine
(jaxsys/serve/engine.py) with one request: `engine.generate`.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import data as data_lib
from jaxsys.config import ConfigError, parse_with_overrides


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Generate a continuation from a jaxsys checkpoint.")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k filter")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: no nucleus filter")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    parser.add_argument(
        "--max-len", type=int, default=0, help="KV-cache positions (default: prompt + new, rounded up to 64)"
    )
    args, overrides = parse_with_overrides(parser, argv, "--config.mesh.tensor=2")
    log = lambda msg: print(f"jaxsys.generate: {msg}", file=sys.stderr, flush=True)
    from jaxsys.mesh import cpu_unless_accelerator

    cpu_unless_accelerator()
    try:
        from jaxsys.checkpoint import load
        from jaxsys.serve import build_engine, engine
        from jaxsys.serve.runner import check_servable
        from jaxsys.serve.sampling import Sampling

        if not args.prompt:
            raise ValueError("--prompt is empty: give at least one token of context")
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        sampling.check()
        config, _ = checkpoint_lib.saved_config(args.workdir, (), args.step)
        prompt = data_lib.encode_prompt(args.prompt, config)
        max_len = args.max_len or -(-(len(prompt) + args.max_new_tokens) // 64) * 64
        if len(prompt) + args.max_new_tokens > max_len:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens plus {args.max_new_tokens} new ones exceeds the cache of "
                f"{max_len} positions: shorten the prompt or lower --max-new-tokens"
            )
        start = time.perf_counter()
        program, params, config = load(args.workdir, overrides, args.step, check=check_servable)
        eng = build_engine(program, params, max_len)
        log(
            f"loaded {args.workdir} in {time.perf_counter() - start:.1f}s; prompt {len(prompt)} tokens, "
            f"cache {max_len} positions"
        )
        byte_level = config.data.source in data_lib.BYTE_SOURCES
        pending = bytearray()
        shown = [0]

        def show(_, tokens):
            for token in tokens:
                if byte_level:  # print whole UTF-8 characters as they complete
                    pending.append(int(token))
                    try:
                        text = pending.decode("utf-8")
                    except UnicodeDecodeError:
                        if len(pending) < 4:
                            continue
                        text = pending.decode("utf-8", errors="replace")
                    pending.clear()
                    sys.stdout.write(text)
                else:
                    sys.stdout.write(("" if shown[0] == 0 else " ") + str(int(token)))
                shown[0] += 1
            sys.stdout.flush()

        start = time.perf_counter()
        engine.generate(eng, [prompt], args.max_new_tokens, sampling, on_token=show)
        if pending:
            sys.stdout.write(pending.decode("utf-8", errors="replace"))
        sys.stdout.write("\n")
        elapsed = time.perf_counter() - start
        log(
            f"{args.max_new_tokens} tokens in {elapsed:.2f}s ({args.max_new_tokens / elapsed:.1f} tokens/s, "
            "compilation included)"
        )
    except (ValueError, ConfigError, checkpoint_lib.CheckpointError, data_lib.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
