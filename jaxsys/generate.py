"""Generate a continuation from any workdir's checkpoint: a trained run, a Hugging Face conversion,
or a quantized one (`jaxsys.quantize`).

    python -m jaxsys.generate --workdir W --prompt "def main(" [--max-new-tokens 64]
        [--chat [--system "..."]] [--ignore-eos]
        [--temperature 0.8 --top-k 40 --top-p 0.95 --seed 0] [--step S] [--config.key=value ...]

The prompt is text when the model has a tokenizer (jaxsys/tokenizer.py: the byte tokenizer of a
byte-level run, or the Hugging Face tokenizer a workdir carries), and the continuation is printed
as text as it is generated, whole characters only, until the tokenizer's end-of-sequence id
(`--ignore-eos` goes on to --max-new-tokens). `--chat` renders the tokenizer's chat template around the prompt (one
user message, after `--system`'s). A model without a tokenizer takes `--prompt` as space-separated
token ids and prints ids; text for it is an error that says how to attach a tokenizer
(`python -m jaxsys.convert --tokenizer PATH --workdir W`). Logs go to stderr. Overrides change how
it runs (the mesh: `--config.mesh.tensor=2`; kernels; config.serve's cache), not the model. It is
the serving engine (jaxsys/serve/engine.py) with one request: `engine.generate`.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import data as data_lib
from jaxsys import tokenizer as tokenizer_lib
from jaxsys.config import ConfigError, parse_with_overrides


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Generate a continuation from a jaxsys checkpoint.")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--prompt", required=True, help="text (space-separated ids for a model without a tokenizer)")
    parser.add_argument("--chat", action="store_true", help="render the tokenizer's chat template around the prompt")
    parser.add_argument("--system", help="--chat: a system message before the prompt")
    parser.add_argument("--ignore-eos", action="store_true", help="print on past the end-of-sequence token")
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
        tok = tokenizer_lib.for_config(config, args.workdir)
        prompt = tokenizer_lib.prompt_ids(
            tok, args.prompt, config.model.vocab_size, args.chat, args.system, args.workdir
        )
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
            f"loaded {args.workdir} in {time.perf_counter() - start:.1f}s; "
            f"{tokenizer_lib.describe(args.workdir, tok)}; prompt {len(prompt)} tokens, cache {max_len} positions"
        )
        if args.chat:
            log(f"chat prompt {tok.apply_chat_template(tokenizer_lib.chat_messages(args.prompt, args.system))!r}")
        printer = tokenizer_lib.TokenPrinter(tok, sys.stdout.write, prompt, () if args.ignore_eos else None)
        if tok is not None and not args.ignore_eos:  # the engine ends the request at an EOS id
            sampling.stop_ids = tuple(tok.eos_ids)

        def show(_, tokens):
            printer.push(tokens)
            sys.stdout.flush()

        start = time.perf_counter()
        new = engine.generate(eng, [prompt], args.max_new_tokens, sampling, on_token=show)[0]
        printer.close()
        sys.stdout.write("\n")
        elapsed = time.perf_counter() - start
        stop = "" if printer.stopped is None else f"; end of sequence (id {printer.stopped}) after {printer.shown}"
        log(f"{len(new)} tokens in {elapsed:.2f}s ({len(new) / elapsed:.1f} tokens/s, compilation included){stop}")
    # (a TokenizerError is a ValueError)
    except (ValueError, ConfigError, checkpoint_lib.CheckpointError, data_lib.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
