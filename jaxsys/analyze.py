"""What a config will cost, before renting the hardware.

    python -m jaxsys.analyze --config configs/llama_8b.py --devices 256 --hardware h100 [--json]
        [--config.key=value ...]

Compiles the train step ahead of time for N fake CPU devices with abstract (never materialised)
parameters, and prints measured memory, collectives and FLOPs beside the papers' formulas, with a
roofline step time and MFU on the chosen hardware profile (h100, h200, tpu_v5p, cpu).
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="configs/<name>.py[:arg]")
    parser.add_argument("--devices", type=int, default=0,
                        help="fake CPU devices to compile for (default: the config's mesh size)")
    parser.add_argument("--hardware", default="h100", help="h100, h200, tpu_v5p or cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-flops", action="store_true",
                        help="skip compiling the written-out step (faster; FLOPs from the formula)")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    from jaxsys.analysis.cost_model import PROFILES
    from jaxsys.config import ConfigError, load_config
    try:
        if args.hardware not in PROFILES:
            raise ConfigError(f"--hardware {args.hardware!r}: choose one of {sorted(PROFILES)}")
        config = load_config(args.config, overrides)
        devices = args.devices or _device_count(config)
        if devices > MAX_FAKE_DEVICES:
            raise ConfigError(f"--devices {devices}: the analysis fakes at most {MAX_FAKE_DEVICES} CPU "
                              "devices; analyse a smaller layout and scale the per-axis figures")
        if devices != _device_count(config):
            raise ConfigError(f"--devices {devices} but config.mesh has {_device_count(config)} devices: "
                              "set --config.mesh.* so that their product is the device count")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # Fake devices must be requested before JAX starts.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from jaxsys.analysis import report

    if len(jax.devices()) < devices:
        print(f"error: JAX already started with {len(jax.devices())} devices; run the analysis in a "
              "fresh process", file=sys.stderr)
        return 2
    try:
        result = report.analyze(config, args.hardware, jax.devices()[:devices], flops=not args.no_flops)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else report.format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
