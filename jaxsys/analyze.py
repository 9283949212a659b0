"""What a config will cost, before renting the hardware.

    python -m jaxsys.analyze --config configs/llama_8b.py --devices 256 --hardware h100 [--json]
        [--config.key=value ...]
    python -m jaxsys.analyze --config configs/llama_8b.py --target v5p-256 [--slices 2] [--json]
    python -m jaxsys.analyze --config configs/llama_8b.py --mode decode --hardware h100 \
        --config.mesh.tensor=8 --config.mesh.fsdp=1 --config.mesh.data=1

Compiles the train step ahead of time with abstract (never materialised) parameters, and prints
measured memory, collectives and FLOPs beside the papers' formulas, with a roofline step time and
MFU. `--devices N` compiles for N fake CPU devices (profile `--hardware`: h100, h200, tpu_v5p,
tpu_v4, tpu_v5e, tpu_v6e, cpu). `--target` compiles with the target's own compiler, for a TPU slice (v4, v5e, v5p, v6e;
Cloud's accelerator names or a topology such as v5p:4x4x8; `--slices` for multi-slice; needs
libtpu: `pip install -e '.[tpu]'`) or for NVIDIA GPU nodes (h100-8, h100-256: XLA:GPU's deviceless
compilation; needs `pip install -e '.[gpu-aot]'`), and prints its memory, collectives and FLOPs
beside the same program on as many fake CPU devices and the formulas. A quantized checkpoint's
config (config.model.quant, written by `jaxsys.quantize`) is for inference: its forward pass is
compiled instead (memory, collectives, FLOPs and a roofline of one forward; fake CPU devices only).

This module is the command: its flags, and printing. The checks of what was asked for are
jaxsys/analysis/inputs.py; the analyses are jaxsys/analysis/report.py (`run`) and decode.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxsys.analysis.hardware import PROFILES


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="configs/<name>.py[:arg]")
    parser.add_argument(
        "--devices", type=int, default=0, help="fake CPU devices to compile for (default: the config's mesh size)"
    )
    parser.add_argument(
        "--hardware", default="h100", help=f"a profile of analysis/hardware.py: {', '.join(PROFILES)} (with --devices)"
    )
    parser.add_argument(
        "--target",
        default="",
        help="compile with the target's own compiler: a TPU slice (v5p-256, v6e-16, v5e-16, "
        "v4-32, or a topology such as v5p:4x4x8; needs libtpu) or GPU nodes (h100-8, "
        "h100-256, h200-64; needs the CUDA plugin)",
    )
    parser.add_argument("--slices", type=int, default=1, help="with --target: slices joined by DCN")
    parser.add_argument(
        "--no-cpu", action="store_true", help="with --target: skip the same program on fake CPU devices (faster)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--mode",
        default="train",
        choices=["train", "decode"],
        help="decode: KV-cache bytes, the batch that fits and a roofline decode latency "
        "(formulas, nothing compiled; jaxsys/analysis/decode.py)",
    )
    parser.add_argument("--contexts", default="512,2048,8192,32768", help="--mode decode: context lengths")
    parser.add_argument("--batches", default="1,8,32,128", help="--mode decode: global batch sizes")
    parser.add_argument(
        "--no-flops", action="store_true", help="skip compiling the written-out step (faster; FLOPs from the formula)"
    )
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    from jaxsys.analysis import decode, inputs, report
    from jaxsys.config import ConfigError

    try:
        config, target, devices = inputs.for_analysis(
            args.config, overrides, args.hardware, args.target, args.slices, args.devices
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.mode == "decode":
        try:
            contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
            batches = [int(x) for x in args.batches.split(",") if x.strip()]
            if not contexts or not batches or min(contexts + batches) < 1:
                raise ConfigError("--contexts and --batches take comma-separated positive integers")
            result = decode.decode_analysis(config, args.hardware, target, contexts, batches)
        except (ConfigError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(result, indent=1) if args.json else decode.format_decode_report(result))
        return 0

    try:
        cpu = inputs.fake_cpu_devices(devices)  # before JAX starts a backend
        result, text = report.run(
            config, args.hardware, cpu, target, compare_on_cpu=not args.no_cpu, flops=not args.no_flops
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
