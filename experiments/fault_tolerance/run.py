"""In-memory fault tolerance on CPU processes: kill one process at a random step, restart from the
ring-replicated snapshots, and measure detection, recovery, steps lost and the snapshot's cost.

    .venv/bin/python experiments/fault_tolerance/run.py --repeats 5 --out experiments/fault_tolerance/results.json

Part A (kills): for 2 processes x 4 devices and 4 processes x 2 devices (one 8-device mesh, data=2
fsdp=2 tensor=2, configs/tiny.py:test, 12 steps, snapshot every k=3, watchdog timeout 5 s), each
repeat SIGKILLs a random process once a random step in [2, 10] is logged (jaxsys.launch --kill)
and lets the launcher restart the job. Recorded: whether any process had to be killed by the
launcher (a hang), the survivors' exit codes and seconds from the kill to their exit, the
restart's snapshot read (goodput `restore`) and its startup (wall time before its first step),
the steps trained again, and whether the final loss equals an uninterrupted run's (no data lost
or repeated: the losses of every step after recovery equal the reference's, rel 1e-5).

With --host-local each process snapshots into its own directory (`snapshot.dir=.../{process}`,
as host-local /dev/shm on a cluster) and the killed process's directory is deleted before the job
is launched again (its host replaced): the restart must exchange the pieces over the ring
(`snapshot._exchange`). The kill attempt then has no automatic restart; the second launch is the
restart (2 attempts).

Part B (cost): 2 processes x 4 devices, no kill, three model sizes x k in {1, 5}: the seconds of
the snapshots by phase (host copy, ring ppermute, write to /dev/shm, barrier) over the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, K, TIMEOUT_S = 12, 3, 5.0
BASE = [
    "--config",
    "configs/tiny.py:test",
    "--config.mesh.data=2",
    "--config.mesh.fsdp=2",
    "--config.mesh.tensor=2",
    "--config.model.n_kv_heads=2",
    "--config.train.schedule=constant",
    "--config.checkpoint.enabled=false",
    "--config.data.eval_fraction=0",  # no held-out split: no evaluation time in the runs
    f"--config.train.snapshot.peer_timeout_s={TIMEOUT_S}",
]
MODELS = {  # name -> overrides (head_dim = d / 8; n_heads 8, n_kv_heads 2)
    "d64 L2 (tiny:test)": [],
    "d256 L4": ["--config.model.d_model=256", "--config.model.n_layers=4", "--config.model.d_ff=1024"],
    "d512 L4": [
        "--config.model.d_model=512",
        "--config.model.n_layers=4",
        "--config.model.d_ff=2048",
        "--config.model.head_dim=64",
    ],
}


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == "JAX_PLATFORMS"}
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONPATH"] = ROOT
    return e


def launch(workdir, snap, n, devices, extra, launch_args=()) -> list[dict]:
    logs = os.path.join(workdir + "_logs")
    cmd = [sys.executable, "-m", "jaxsys.launch", "--processes", str(n), "--devices-per-process", str(devices)]
    cmd += [*launch_args, "--log-dir", logs, "--", *BASE, *extra, f"--config.train.snapshot.dir={snap}"]
    cmd += ["--workdir", workdir]
    subprocess.run(cmd, cwd=ROOT, env=env(), timeout=900, check=False, stdout=subprocess.DEVNULL)
    with open(os.path.join(logs, "launch.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(workdir) -> dict[int, float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def goodput(workdir) -> list[dict]:
    with open(os.path.join(workdir, "goodput.jsonl")) as f:
        return [json.loads(line) for line in f]


def kills(tmp, repeats, seed, host_local: bool = False) -> list[dict]:
    rows = []
    extra = [f"--config.train.steps={STEPS}", f"--config.train.snapshot.every={K}"]
    for n, devices in ((2, 4), (4, 2)):
        ref_dir = os.path.join(tmp, f"ref_{n}")
        launch(ref_dir, os.path.join(tmp, f"snap_ref_{n}"), n, devices, extra)
        ref = losses(ref_dir)
        for r in range(repeats):
            rng = random.Random(seed * 1000 + n * 100 + r)
            victim, at = rng.randrange(n), rng.randint(2, STEPS - 2)
            workdir, snap = os.path.join(tmp, f"kill_{n}_{r}"), f"/dev/shm/jaxsys-ft-exp-{os.getpid()}-{n}-{r}"
            start = time.perf_counter()
            if host_local:  # kill, wipe the victim's memory, launch again
                records = launch(
                    workdir, snap + "/{process}", n, devices, extra, ["--max-restarts", "0", "--kill", f"{victim}@{at}"]
                )
                shutil.rmtree(os.path.join(snap, str(victim)), ignore_errors=True)
                os.rename(workdir + "_logs", workdir + "_logs_killed")
                records += launch(workdir, snap + "/{process}", n, devices, extra, ["--max-restarts", "1"])
            else:
                records = launch(workdir, snap, n, devices, extra, ["--max-restarts", "2", "--kill", f"{victim}@{at}"])
            wall = time.perf_counter() - start
            shutil.rmtree(snap, ignore_errors=True)
            first, last = records[0], records[-1]
            survivors = {p: t for p, t in first.get("exit_after_failure_s", {}).items() if int(p) != victim}
            got = losses(workdir)
            gp = goodput(workdir)[-1] if os.path.exists(os.path.join(workdir, "goodput.jsonl")) else {}
            row = {
                "processes": n,
                "host_local": host_local,
                "devices_per_process": devices,
                "repeat": r,
                "killed_process": victim,
                "killed_after_step": first.get("killed", {}).get("after_step"),
                "survivor_codes": [c for p, c in enumerate(first["codes"]) if p != victim],
                "hangs": sum(len(x["hung"]) for x in records),
                "detect_s": max(survivors.values()) if survivors else None,
                "attempts": len(records),
                "finished": last["codes"] == [0] * n,
                "restore_s": gp.get("restore_s"),
                "restart_startup_s": gp["wall_s"] - gp["step_s"] - gp["snapshot_s"] - gp["eval_s"] if gp else None,
                "steps_lost": gp.get("lost_steps", 0),
                "all_steps_logged": sorted(got) == list(range(1, STEPS + 1)),
                "max_rel_loss_diff_vs_uninterrupted": max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref if s in got),
                "wall_s": wall,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def costs(tmp) -> list[dict]:
    rows = []
    for name, model in MODELS.items():
        for k in (1, 5):
            workdir, snap = os.path.join(tmp, f"cost_{len(rows)}"), f"/dev/shm/jaxsys-ft-cost-{os.getpid()}"
            steps = 10
            extra = [*model, f"--config.train.steps={steps}", f"--config.train.snapshot.every={k}"]
            launch(workdir, snap, 2, 4, extra, ["--max-restarts", "0"])
            shutil.rmtree(snap, ignore_errors=True)
            out = open(os.path.join(workdir + "_logs", "a0_p0.out")).read()
            params = float(re.search(r"jaxsys: ([\d.]+)M params", out).group(1))
            m = re.search(r"snapshots: (\d+) in ([\d.]+) s \((.*)\); ([\d.]+) MiB per process", out)
            phases = {a: float(b) for a, b in re.findall(r"(\w+) ([\d.]+) s", m.group(3))}
            gp = goodput(workdir)[-1]
            count, seconds = int(m.group(1)), float(m.group(2))
            row = {
                "model": name,
                "params_M": params,
                "k": k,
                "snapshots": count,
                "per_snapshot_s": seconds / count,
                "per_step_s": seconds / steps,
                "step_s": gp["step_s"] / steps,
                "overhead": seconds / gp["step_s"],
                "phases_per_snapshot_s": {a: v / count for a, v in phases.items()},
                "mib_per_process": float(m.group(4)),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _num(x, digits: int) -> str:
    return "failed" if x is None else f"{x:.{digits}f}"


def tables(result: dict) -> str:
    """The README's tables from results.json."""
    lines = []
    if result.get("kills"):
        lines += [
            "| processes x devices | repeat | killed process @ step | survivors' exit | detect s | hangs | "
            "attempts | steps lost (k = 3) | restore s | restart startup s | max rel loss diff vs uninterrupted |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in result["kills"]:
            detect = "-" if r["detect_s"] is None else f"{r['detect_s']:.2f}"
            where = " (host-local)" if r.get("host_local") else ""
            lines.append(
                f"| {r['processes']} x {r['devices_per_process']}{where} | {r['repeat']} | "
                f"{r['killed_process']} @ {r['killed_after_step']} | {r['survivor_codes']} | {detect} | {r['hangs']} | "
                f"{r['attempts']} | {r['steps_lost']} | {_num(r['restore_s'], 2)} | {_num(r['restart_startup_s'], 1)} | "
                f"{r['max_rel_loss_diff_vs_uninterrupted']:.1e} |"
            )
        lines.append("")
    if result.get("costs"):
        lines += [
            "| model | params (M) | k | MiB / process (own + replica) | per snapshot s (host, ring, write, barrier) | "
            "snapshot s per step | step s | overhead |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in result["costs"]:
            ph = r["phases_per_snapshot_s"]
            parts = ", ".join(f"{ph[k]:.3f}" for k in ("host", "ring", "write", "barrier"))
            lines.append(
                f"| {r['model']} | {r['params_M']:.2f} | {r['k']} | {r['mib_per_process']:.1f} | "
                f"{r['per_snapshot_s']:.3f} ({parts}) | {r['per_step_s']:.3f} | {r['step_s']:.3f} | "
                f"{100 * r['overhead']:.0f}% |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-costs", action="store_true")
    parser.add_argument("--skip-kills", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.json"))
    parser.add_argument("--table", default="", help="print the tables of this results.json and stop")
    parser.add_argument(
        "--host-local", action="store_true", help="one snapshot directory per process; wipe the victim's"
    )
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            print(tables(json.load(f)))
        return
    tmp = tempfile.mkdtemp(prefix="jaxsys_ft_")
    result = {"steps": STEPS, "k": K, "peer_timeout_s": TIMEOUT_S, "repeats": args.repeats, "seed": args.seed}
    result["host_local"] = args.host_local
    if not args.skip_kills:
        result["kills"] = kills(tmp, args.repeats, args.seed, args.host_local)
    if not args.skip_costs:
        result["costs"] = costs(tmp)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(tables(result))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
