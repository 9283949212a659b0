"""Hugging Face Llama weights in and out: safetensors <-> a jaxsys checkpoint; a model's tokenizer.

    python -m jaxsys.convert --from-hf DIR --workdir W [--config configs/x.py[:arg]] [--config.k=v ...]
        [--tokenizer PATH]
    python -m jaxsys.train --config W/config.json --workdir W        # resumes from the converted step 0
    python -m jaxsys.convert --to-hf OUT --workdir W [--step S] [--dtype bfloat16]
    python -m jaxsys.convert --tokenizer PATH --workdir W            # attach a tokenizer to any workdir

`--from-hf` reads DIR/config.json and DIR/*.safetensors of a Llama-family model (Llama, Mistral,
Qwen2 / 2.5 / 3, Gemma 2, Gemma 3 text or image-text, Phi-3 / 4, Mixtral, Qwen2-MoE, Qwen3-MoE:
docs/checkpoints.md), sets
`config.model` from it on top of `--config` (training, data and mesh settings), and writes the
resolved config.json and checkpoint step 0 into W, which must not already hold a run. It copies
DIR's tokenizer (tokenizer.json, tokenizer_config.json, generation_config.json, the chat template)
into W/tokenizer/, or records that the model has none (it then takes and prints token ids).
`--to-hf` writes config.json and model.safetensors (and the tokenizer files) from a checkpoint of W.
`--tokenizer PATH` (a Hugging Face directory or a tokenizer.json; `bytes`; `none`) records the
tokenizer of W's model, refusing one whose ids do not fit the model's vocabulary; with `--from-hf`
it replaces DIR's. The conversion is the library's, jaxsys/checkpoint/hf.py (what is read, refused
and how each tensor maps), and the tokenizer's jaxsys/tokenizer.py; this module parses the command
line.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxsys.config import ConfigError, load_config, parse_with_overrides


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Convert Hugging Face Llama safetensors to and from jaxsys checkpoints."
    )
    direction = parser.add_mutually_exclusive_group()
    direction.add_argument("--from-hf", metavar="DIR", help="HF model directory to read")
    direction.add_argument("--to-hf", metavar="OUT", help="HF model directory to write")
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="the model's tokenizer: an HF directory or tokenizer.json, `bytes` or `none`; alone, attach it "
        "to the workdir; with --from-hf, instead of DIR's",
    )
    parser.add_argument("--workdir", required=True, help="the jaxsys run directory (new for --from-hf)")
    parser.add_argument(
        "--config",
        help="--from-hf: training/data/mesh settings (configs/<name>.py[:arg]); "
        "the model section comes from the HF config",
    )
    parser.add_argument("--step", type=int, help="--to-hf: checkpoint step (default: latest)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], help="--to-hf: tensor dtype (default: config.model.param_dtype)"
    )
    args, overrides = parse_with_overrides(parser, argv, "--config.mesh.fsdp=8")
    if not (args.from_hf or args.to_hf or args.tokenizer):
        parser.error("give one of --from-hf DIR, --to-hf OUT or --tokenizer PATH")
    if args.to_hf and args.tokenizer:
        parser.error("--to-hf writes the workdir's own tokenizer files: drop --tokenizer")
    if not args.from_hf and (overrides or args.config):
        parser.error("--config and overrides go with --from-hf (the other modes read the checkpoint's config)")
    from jaxsys.mesh import cpu_unless_accelerator

    cpu_unless_accelerator()  # no accelerator plugin probes (and their warnings) on a CPU-only machine
    from jaxsys import tokenizer as tokenizer_lib
    from jaxsys.checkpoint import CheckpointError, hf, saved_config  # after parsing: `--help` starts no JAX

    try:
        if args.from_hf:
            config = load_config(args.config) if args.config else None
            config = hf.from_hf(args.from_hf, args.workdir, config, overrides, args.tokenizer)
            print(
                f"jaxsys: wrote {args.workdir}/config.json and checkpoint step 0 "
                f"({config.model.n_layers} layers, d_model {config.model.d_model}); "
                f"{_tokenizer_line(tokenizer_lib.record(args.workdir), args.workdir)}; train with\n"
                f"  python -m jaxsys.train --config {os.path.join(args.workdir, 'config.json')} "
                f"--workdir {args.workdir}"
            )
        elif args.to_hf:
            hf.to_hf(args.workdir, args.to_hf, args.step, args.dtype)
            print(f"jaxsys: wrote {args.to_hf}/config.json and model.safetensors")
        else:
            config, _ = saved_config(args.workdir)
            record = tokenizer_lib.attach(args.workdir, args.tokenizer, config.model.vocab_size)
            print(f"jaxsys: {_tokenizer_line(record, args.workdir)}")
    except (hf.ConversionError, ConfigError, CheckpointError, tokenizer_lib.TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _tokenizer_line(record: dict | None, workdir: str) -> str:
    kind = (record or {}).get("kind")
    if kind == "huggingface":
        chat = ", chat template" if record.get("chat_template") else ""
        return (
            f"tokenizer: Hugging Face, from {record['source']} into {workdir}/tokenizer/ "
            f"({record['vocab_size']} ids, EOS {record['eos_ids']}{chat})"
        )
    if kind == "bytes":
        return "tokenizer: bytes (UTF-8, token = byte)"
    note = f" ({record['note']})" if record and record.get("note") else ""
    return (
        f"tokenizer: none{note}: the model takes and prints token ids; attach one with "
        f"python -m jaxsys.convert --tokenizer PATH --workdir {workdir}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
