"""Quantize a trained (or converted) checkpoint's dense layers into a new workdir.

    python -m jaxsys.quantize --workdir W --out W_q --format w4a16 --method gptq [--group-size 128]
        [--zero-point] [--rotate] [--calibration-batches 8] [--step S]
    python -m jaxsys.evaluate --workdir W_q          # held-out loss and perplexity through the kernels

Formats (config.model.quant, models/quant.py): w8a16 (int8 per channel), w4a16 (4-bit per group of
G k, packed two per byte in the kernel's layout, optional zero points), w8a8 (int8 weights per
channel; activations quantized per token at run time), w4a8 and w4a4 (w4a16's weights met by
integer activations, COMET's formats: int8 per token, or 4-bit per token and group of G; each
group's product an int32 sum). `--rotate` stores H W with H the block Hadamard of G and rotates
the activations at run time (QuaRot's rotation on blocks), which spreads outlier channels before
rounding. Methods: `rtn` (round to nearest, weight by
weight) and `gptq` (GPTQ, Frantar et al. 2022, calibrated layer by layer on training batches of
the config's corpus; a text corpus is read through the model's tokenizer, and refused for a
converted model without one, whose ids are not bytes). The work is the library's, jaxsys/quantization/ (workdir.py writes W_q,
params.py quantizes the parameters, gptq.py is the algorithm); this module parses the command line.
"""

from __future__ import annotations

import argparse
import sys

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import data as data_lib
from jaxsys.config import QUANT_FORMATS, ConfigError
from jaxsys.quantization import workdir as workdir_lib
from jaxsys.tokenizer import TokenizerError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Quantize a jaxsys checkpoint's dense layers into a new workdir.")
    parser.add_argument("--workdir", required=True, help="the float run (or converted HF model) to read")
    parser.add_argument("--out", required=True, help="the new workdir to write")
    parser.add_argument("--format", required=True, choices=QUANT_FORMATS[1:])
    parser.add_argument("--method", default="rtn", choices=workdir_lib.METHODS)
    parser.add_argument(
        "--group-size", type=int, default=128, help="4-bit formats: k per scale (32, 64, 128); the rotation's block"
    )
    parser.add_argument("--zero-point", action="store_true", help="4-bit formats: asymmetric codes with a zero point")
    parser.add_argument(
        "--rotate", action="store_true", help="store H W (block Hadamard of G) and rotate the activations to match"
    )
    parser.add_argument(
        "--calibration-batches",
        type=int,
        default=8,
        help="gptq: training batches of the config's corpus to calibrate on",
    )
    parser.add_argument("--step", type=int, help="checkpoint step to read (default: latest)")
    args = parser.parse_args(argv)
    log = lambda msg: print(f"jaxsys.quantize: {msg}", file=sys.stderr, flush=True)
    try:
        summary = workdir_lib.quantize_workdir(
            args.workdir,
            args.out,
            args.format,
            args.method,
            args.group_size,
            args.zero_point,
            args.calibration_batches,
            args.step,
            log,
            args.rotate,
        )
    except (ConfigError, checkpoint_lib.CheckpointError, data_lib.DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"jaxsys: wrote {args.out} (step {summary['step']}, {args.format}{' rotated' if args.rotate else ''} "
        f"by {args.method}): dense layers "
        f"{summary['dense_bytes_before'] / 2**20:.2f} -> {summary['dense_bytes_after'] / 2**20:.2f} MiB, "
        f"all parameters {summary['total_bytes_before'] / 2**20:.2f} -> "
        f"{summary['total_bytes_after'] / 2**20:.2f} MiB in {summary['seconds']:.1f}s; evaluate with\n"
        f"  python -m jaxsys.evaluate --workdir {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
