"""Generate a continuation from any workdir's checkpoint: a trained run, a Hugging Face conversion,
or a quantized one (`jaxsys.quantize`).

    python -m jaxsys.generate --workdir W --prompt "def main(" [--max-new-tokens 64]
        [--temperature 0.8 --top-k 40 --top-p 0.95 --seed 0] [--step S] [--config.key=value ...]

Prints the continuation on stdout as it is generated: text for a byte-level corpus
(config.data.source stdlib or text), else space-separated token ids (and `--prompt` is then
space-separated ids too). Logs go to stderr. Overrides change how it runs (the mesh:
`--config.mesh.tensor=2`; kernels), not the model. jaxsys/serve/decode.py says how.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import data as data_lib
from jaxsys.config import ConfigError, parse_with_overrides

BYTE_SOURCES = ("stdlib", "text")


def load_program(workdir: str, overrides=(), step: int | None = None):
    """(program, params, config) of `workdir`'s checkpoint on the mesh its config (with overrides)
    names, checked for serving."""
    from jaxsys import program as program_lib
    from jaxsys.mesh import cpu_unless_accelerator, mesh_for
    from jaxsys.serve import decode

    cpu_unless_accelerator()
    config, step = checkpoint_lib.saved_config(workdir, overrides, step)
    if config.model.kind == "flax":
        raise ConfigError(
            f"{workdir} holds a Flax model (config.model.kind='flax'): generation and serving "
            "need jaxsys's transformer and its KV cache (docs/flax.md); its eval loss: "
            f"python -m jaxsys.evaluate --workdir {workdir}"
        )
    decode.check_servable(config)
    program = program_lib.build(config, mesh_for(config))
    params, _ = checkpoint_lib.restore_params(workdir, program.abstract_state().params, f"--workdir {workdir}")
    return program, params, config


def load(workdir: str, overrides=(), step: int | None = None, batch: int = 1, max_len: int = 256):
    """(decoder, params, config) for `workdir` on the mesh its config (with overrides) names."""
    from jaxsys.serve import decode

    program, params, config = load_program(workdir, overrides, step)
    batch = decode.Decoder.padded_batch(batch, program.layout)
    return decode.Decoder(program, batch, max_len), params, config


def encode(prompt: str, config) -> list[int]:
    if config.data.source in BYTE_SOURCES:
        return data_lib.byte_encode(prompt).astype(int).tolist()
    try:
        ids = [int(t) for t in prompt.split()]
    except ValueError:
        raise ValueError(
            f"config.data.source={config.data.source!r} has no text tokenizer here: pass the prompt "
            "as space-separated token ids"
        ) from None
    bad = [i for i in ids if not 0 <= i < config.model.vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {config.model.vocab_size})")
    return ids


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
        if not args.prompt:
            raise ValueError("--prompt is empty: give at least one token of context")
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
        config, _ = checkpoint_lib.saved_config(args.workdir, (), args.step)
        prompt = encode(args.prompt, config)
        max_len = args.max_len or -(-(len(prompt) + args.max_new_tokens) // 64) * 64
        start = time.perf_counter()
        decoder, params, config = load(args.workdir, overrides, args.step, 1, max_len)
        log(
            f"loaded {args.workdir} in {time.perf_counter() - start:.1f}s; prompt {len(prompt)} tokens, "
            f"cache {max_len} positions"
        )
        byte_level = config.data.source in BYTE_SOURCES
        pending = bytearray()

        def show(step, tokens):
            if byte_level:  # print whole UTF-8 characters as they complete
                pending.append(int(tokens[0]))
                try:
                    text = pending.decode("utf-8")
                except UnicodeDecodeError:
                    if len(pending) < 4:
                        return
                    text = pending.decode("utf-8", errors="replace")
                pending.clear()
                sys.stdout.write(text)
            else:
                sys.stdout.write(("" if step == 0 else " ") + str(int(tokens[0])))
            sys.stdout.flush()

        from jaxsys.serve import decode

        start = time.perf_counter()
        decode.generate(
            decoder,
            params,
            [prompt],
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            args.top_p,
            args.seed,
            on_token=show,
        )
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
