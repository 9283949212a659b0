"""What the device holds at the TPU compiler's HBM peak, for one small size of the family: compile with
XLA's dumps on, then read the buffer assignment and live ranges of the step.

    .venv/bin/python experiments/offload_capacity/dump_peak.py 8 opt_host   # k, option (run.py's short names)
    .venv/bin/python experiments/offload_capacity/dump_peak.py 8 opt_host --dump-dir /tmp/d  # reuse a dump

A fitting compile takes ~40-70 s at k = 8 on 2 shared cores. The device peak is recomputed from the
dump: every value of the device memory space (color 0; host memory is color 5) with its live range
(HloLiveRange over the entry computation's schedule) and its offset in its allocation. Values inside
loop bodies are not in that schedule, so the recomputed peak can be below XLA's own (printed beside it).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def compile_with_dump(k: int, short: str, dump: str) -> dict:
    os.environ["XLA_FLAGS"] = f"--xla_dump_to={dump}"  # libtpu's compiler reads it too
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import run  # noqa: E402  (this experiment's run.py)

    from jaxsys.analysis import report, targets

    option = {v: o for o, v in run.SHORT.items()}[short]
    target = targets.parse(run.TPU_TARGET)
    config = run.make_config(k, option)
    t0 = time.time()
    r = report.target_analysis(config, target, targets.devices(target))
    return {"k": k, "option": option, "psi": run.psi(config), "compile_s": time.time() - t0, "memory": r["memory"]}


def _describe(defs: dict, name: str) -> str:
    """shape, op(first operand) or the custom call's target, and the JAX source op."""
    line = defs.get(name.split("{")[0], "")
    op = re.search(r'op_name="([^"]*)"', line)
    kind = re.search(r"[\]}] ([a-z][\w-]*)\(%?([\w.-]*)", line)
    target = re.search(r'custom_call_target="([^"]*)"', line)
    what = f"custom-call {target.group(1)}" if target else f"{kind.group(1)}({kind.group(2)})" if kind else ""
    shape = line.split(" ")[0][:40] if not line.startswith("(") else "(tuple)"
    return f"{shape:40s} {what[:48]:48s} {(op.group(1)[-50:] if op else '')}"


def device_peak(dump: str, top: int = 25) -> str:
    f = glob.glob(f"{dump}/*jit__local_step*after_optimizations-buffer-assignment.txt")[0]
    base = f[: -len("-buffer-assignment.txt")]
    ranges = {
        m.group(1): (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"^    (\S+):(\d+)-(\d+)$", open(base + "-live-range.txt").read(), re.M)
    }
    end = max(e for _, e in ranges.values()) + 1
    defs = {}
    for line in open(base + ".txt"):
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*)$", line)
        if m:
            defs[m.group(1)] = m.group(2)
    values = []  # (allocation, offset, size, start, end, name)
    for a in re.split(r"^allocation ", open(f).read(), flags=re.M)[1:]:
        head = a.split("\n")[0]
        color = int(re.search(r"color (\d+)", head).group(1)) if "color" in head else 0
        if color != 0 or "thread-local" in head or "constant" in head:
            continue
        aid = int(head.split(":")[0])
        for m in re.finditer(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\)", a):
            name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
            if name not in ranges:
                continue
            s, e = (0, end) if "parameter" in head else ranges[name]
            values.append((aid, int(m.group(3)), int(m.group(2)), s, e, name))

    def usage(t: int) -> int:
        spans = collections.defaultdict(list)
        for aid, off, size, s, e, _ in values:
            if s <= t <= e and size:
                spans[aid].append((off, off + size))
        total = 0
        for lst in spans.values():  # union of byte ranges: aliased values share their bytes
            lst.sort()
            lo, hi = lst[0]
            for a, b in lst[1:]:
                if a > hi:
                    total += hi - lo
                    lo, hi = a, b
                else:
                    hi = max(hi, b)
            total += hi - lo
        return total

    use = [usage(t) for t in range(end)]
    peak = max(range(end), key=use.__getitem__)
    live = {}
    for aid, off, size, s, e, name in values:
        if s <= peak <= e and (live.get((aid, off), (0,))[0] < size):
            live[(aid, off)] = (size, name)
    lines = [
        f"recomputed device peak: {use[peak] / 1e9:.3f} GB at position {peak} of {end} in the schedule",
        "largest values live there (MB, value, shape, op, source):",
    ]
    for size, name in sorted(live.values(), reverse=True)[:top]:
        lines.append(f"  {size / 1e6:8.1f}  {name:30s} {_describe(defs, name)}")
    step = max(1, end // 40)
    lines.append(
        "device bytes along the schedule (GB, every %d positions): " % step
        + " ".join(f"{use[t] / 1e9:.2f}" for t in range(0, end, step))
    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("k", type=int)
    ap.add_argument("option", help="none, opt_dev, opt_host, params, act, all")
    ap.add_argument("--dump-dir", help="reuse (or keep) the XLA dump here")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    dump = args.dump_dir or tempfile.mkdtemp(prefix=f"offload_{args.option}{args.k}_")
    if not glob.glob(f"{dump}/*jit__local_step*after_optimizations-buffer-assignment.txt"):
        r = compile_with_dump(args.k, args.option, dump)
        m = r["memory"]
        print(
            f"{args.option} k={args.k} Ψ={r['psi'] / 1e9:.3f}B, compiled in {r['compile_s']:.0f} s; XLA: "
            + json.dumps({s: {f: round(v / 1e9, 3) for f, v in m[s].items()} for s in ("device", "host") if s in m})
        )
    print(device_peak(dump, args.top))
    print(f"dump: {dump}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
