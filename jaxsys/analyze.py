"""What a config will cost, before renting the hardware.

    python -m jaxsys.analyze --config configs/llama_8b.py --devices 256 --hardware h100 [--json]
        [--config.key=value ...]
    python -m jaxsys.analyze --config configs/llama_8b.py --target v5p-256 [--slices 2] [--json]
    python -m jaxsys.analyze --config configs/llama_8b.py --mode decode --hardware h100 \
        --config.mesh.tensor=8 --config.mesh.fsdp=1 --config.mesh.data=1

Compiles the train step ahead of time with abstract (never materialised) parameters, and prints
measured memory, collectives and FLOPs beside the papers' formulas, with a roofline step time and
MFU. `--devices N` compiles for N fake CPU devices (profile `--hardware`: h100, h200, tpu_v5p,
cpu). `--target` compiles with the target's own compiler, for a TPU slice (v4, v5e, v5p, v6e;
Cloud's accelerator names or a topology such as v5p:4x4x8; `--slices` for multi-slice; needs
libtpu: `pip install -e '.[tpu]'`) or for NVIDIA GPU nodes (h100-8, h100-256: XLA:GPU's deviceless
compilation; needs `pip install -e '.[gpu-aot]'`), and prints its memory, collectives and FLOPs
beside the same program on as many fake CPU devices and the formulas. A quantized checkpoint's
config (config.model.quant, written by `jaxsys.quantize`) is for inference: its forward pass is
compiled instead (memory, collectives, FLOPs and a roofline of one forward; fake CPU devices only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MAX_FAKE_DEVICES = 2048  # XLA:CPU creates one client device each; past this start-up alone is slow


def _device_count(config) -> int:
    n = 1
    for axis in ("data", "pipe", "fsdp", "expert", "seq", "tensor"):
        n *= config.mesh[axis]
    return n


def _fill_error(config, how: str):
    from jaxsys.config import ConfigError, fill_axis

    return ConfigError(f"config.mesh.{fill_axis(config)}=-1 takes its size from the device count: pass {how}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="configs/<name>.py[:arg]")
    parser.add_argument(
        "--devices", type=int, default=0, help="fake CPU devices to compile for (default: the config's mesh size)"
    )
    parser.add_argument("--hardware", default="h100", help="h100, h200, tpu_v5p or cpu (with --devices)")
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

    from jaxsys.analysis import targets
    from jaxsys.analysis.hardware import PROFILES
    from jaxsys.config import ConfigError, fill_axis, load_config, validate

    target = None
    try:
        if args.hardware not in PROFILES:
            raise ConfigError(f"--hardware {args.hardware!r}: choose one of {sorted(PROFILES)}")
        if args.slices != 1 and not args.target:
            raise ConfigError("--slices needs --target")
        if args.target:
            if args.devices:
                raise ConfigError("pass --target or --devices, not both (a target has its own chip count)")
            target = targets.parse(args.target, args.slices)
            targets.require_compiler(target)
        config = load_config(args.config, overrides)
        if target is None and fill_axis(config) and not args.devices:
            raise _fill_error(config, "--devices N or --target")
        devices = target.chips if target is not None else (args.devices or _device_count(config))
        if devices > MAX_FAKE_DEVICES:
            raise ConfigError(
                f"--devices {devices}: the analysis fakes at most {MAX_FAKE_DEVICES} CPU "
                "devices; analyse a smaller layout and scale the per-axis figures"
            )
        try:
            validate(config, num_devices=devices)  # resolves a -1 axis; names a mesh that does not match
        except ConfigError as e:
            if target is None or "are available" not in str(e):
                raise
            raise ConfigError(f"{e} (the target is {target.describe()})") from None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.mode == "decode":
        from jaxsys.analysis import decode

        try:
            hw = PROFILES[args.hardware] if args.hardware != "cpu" else None
            if hw is None or args.target:
                raise ConfigError("--mode decode takes --hardware h100, h200 or tpu_v5p (no --target)")
            contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
            batches = [int(x) for x in args.batches.split(",") if x.strip()]
            if not contexts or not batches or min(contexts + batches) < 1:
                raise ConfigError("--contexts and --batches take comma-separated positive integers")
            result = decode.decode_report(config, hw, contexts, batches)
        except (ConfigError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(result, indent=1) if args.json else decode.format_decode_report(result))
        return 0

    # Fake devices must be requested before JAX starts.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_platforms", "cpu")  # jax was imported above: the variable alone is too late
    from jaxsys.analysis import report

    if len(jax.devices()) < devices:
        print(
            f"error: JAX already started with {len(jax.devices())} devices; run the analysis in a fresh process",
            file=sys.stderr,
        )
        return 2
    try:
        if target is not None:
            if config.model.quant != "none":
                raise ConfigError(
                    f"config.model.quant={config.model.quant!r}: the analysis of a quantized "
                    "(inference) config runs on fake CPU devices only so far; drop --target"
                )
            cpu = None if args.no_cpu else jax.devices()[:devices]
            result = report.analyze_target(config, target, cpu, flops=not args.no_flops)
            text = report.format_target_report
        else:
            result = report.analyze(config, args.hardware, jax.devices()[:devices], flops=not args.no_flops)
            text = report.format_inference_report if result.get("mode") == "inference" else report.format_report
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
