"""`python -m jaxsys.checkpoint inspect WORKDIR [--json]`: the steps of a workdir's checkpoints and,
for the latest, every tensor's shape, dtype and the sharding it was saved with."""

from __future__ import annotations

import argparse
import json
import sys

from jaxsys.checkpoint import CheckpointError, inspect


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Inspect jaxsys checkpoints.")
    parser.add_argument("command", choices=["inspect"])
    parser.add_argument("directory", help="a workdir or its checkpoints/ directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        info = inspect(args.directory)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{info['directory']}: steps {info['steps']} (latest {info['latest']})")
    mesh = next((t["mesh"] for t in info["tensors"] if t["mesh"]), {})
    print("saved on mesh " + (" x ".join(f"{a}={s}" for a, s in mesh.items() if s > 1) or "of 1 device"))
    for t in info["tensors"]:
        print(f"  {t['name']:<36} {str(tuple(t['shape'])):<18} {t['dtype']:<9} {t['partition_spec']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
