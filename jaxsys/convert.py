"""Hugging Face Llama weights in and out: safetensors <-> a jaxsys checkpoint.

    python -m jaxsys.convert --from-hf DIR --workdir W [--config configs/x.py[:arg]] [--config.k=v ...]
    python -m jaxsys.train --config W/config.json --workdir W        # resumes from the converted step 0
    python -m jaxsys.convert --to-hf OUT --workdir W [--step S] [--dtype bfloat16]

`--from-hf` reads DIR/config.json and DIR/*.safetensors of a Llama-family model, sets
`config.model` from it on top of `--config` (training, data and mesh settings), and writes the
resolved config.json and checkpoint step 0 into W, which must not already hold a run. `--to-hf`
writes config.json and model.safetensors from a checkpoint of W. The conversion is the library's,
jaxsys/checkpoint/hf.py (what is read, refused and how each tensor maps); this module parses the
command line.
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
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR", help="HF model directory to read")
    direction.add_argument("--to-hf", metavar="OUT", help="HF model directory to write")
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
    from jaxsys.checkpoint import CheckpointError, hf  # after parsing: `--help` starts no JAX

    try:
        if args.from_hf:
            config = load_config(args.config) if args.config else None
            config = hf.from_hf(args.from_hf, args.workdir, config, overrides)
            print(
                f"jaxsys: wrote {args.workdir}/config.json and checkpoint step 0 "
                f"({config.model.n_layers} layers, d_model {config.model.d_model}); train with\n"
                f"  python -m jaxsys.train --config {os.path.join(args.workdir, 'config.json')} "
                f"--workdir {args.workdir}"
            )
        else:
            if overrides or args.config:
                parser.error("--to-hf takes its config from the checkpoint: drop --config and overrides")
            hf.to_hf(args.workdir, args.to_hf, args.step, args.dtype)
            print(f"jaxsys: wrote {args.to_hf}/config.json and model.safetensors")
    except (hf.ConversionError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
