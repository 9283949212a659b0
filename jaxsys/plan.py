"""Choose the layout for a config on N devices: enumerate, prune by memory, rank by step time,
compile the best few, and write the winner as config overrides.

    python -m jaxsys.plan --config configs/llama_8b.py --devices 256 --hardware h100 --top 3
    python -m jaxsys.plan --config configs/llama_8b.py --target v5p-256 --top 3
    python -m jaxsys.plan --config configs/tiny.py --devices 8 --hardware cpu --out overrides.txt
    jaxsys train --config configs/tiny.py --workdir /tmp/t $(cat overrides.txt)

This module is the command: its flags, the devices the top k compile on, and the files it writes.
The planner itself (enumerate, prune, rank, compile, the table) is jaxsys/analysis/planner.py;
the checks of what was asked for are jaxsys/analysis/inputs.py. docs/planner.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxsys.analysis.hardware import PROFILES


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="configs/<name>.py[:arg]")
    parser.add_argument("--devices", type=int, default=0, help="devices to plan for (or --target)")
    parser.add_argument("--hardware", default="h100", help=f"a profile of analysis/hardware.py: {', '.join(PROFILES)}")
    parser.add_argument(
        "--target", default="", help="a TPU slice or GPU nodes (e.g. v5p-256): its chips, its compiler for the top k"
    )
    parser.add_argument(
        "--hbm", type=float, default=0.0, help="memory budget per device in GiB (default: the hardware's HBM)"
    )
    parser.add_argument("--top", type=int, default=3, help="compile the k best (0: none)")
    parser.add_argument("--offload", action="store_true", help="also try the optimizer state in host memory")
    parser.add_argument("--out", default="", help="write the winner as config overrides, one a line")
    parser.add_argument("--json", default="", help="write the whole table as JSON here")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    from jaxsys.analysis import inputs, planner, targets
    from jaxsys.config import ConfigError

    try:
        base, hw, target, devices = inputs.for_plan(
            args.config, overrides, args.hardware, args.target, args.devices, args.top
        )
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    try:
        compile_devices = None
        if args.top and target is None:  # fake CPU devices, asked for before JAX starts
            compile_devices = inputs.fake_cpu_devices(devices, "plan in a fresh process")
        elif target is not None:
            compile_devices = targets.devices(target)
        result = planner.plan(
            base,
            devices,
            hw,
            args.top,
            args.hbm * 2**30 if args.hbm else None,
            args.offload,
            compile_devices,
            target,
            log=lambda s: print(s, file=sys.stderr, flush=True),
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(planner.table(result))
    if args.out and result["winner"] is not None:
        with open(args.out, "w") as f:
            f.write("\n".join(result["winner"].override_lines()) + "\n")
        print(f"wrote {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(planner.to_json(result), f, indent=1)
    return 0 if result["winner"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
