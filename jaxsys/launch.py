"""A local elastic launcher: start P `jaxsys.train` processes on this machine, notice a failure,
stop the rest, and start the job again (it resumes from the newest in-memory snapshot or
checkpoint; docs/fault_tolerance.md).

    python -m jaxsys.launch --processes 2 --devices-per-process 4 --max-restarts 3 -- \\
        --config configs/tiny.py:test --workdir /tmp/ft --config.train.snapshot.every=2

Each attempt gets a fresh coordinator port (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID) and, with --devices-per-process, that many simulated CPU devices per process.
When one process exits non-zero, the others have `--grace-s` to exit by themselves (the
watchdog's PeerLost, exit 75); any still running then is killed and counted as a hang. Every
attempt is one JSON line in `{log-dir}/launch.jsonl` (exit codes, seconds from the first failure
to each exit), and each process's output goes to `{log-dir}/a{attempt}_p{i}.out/.err`.

Fault injection for tests and experiments: `--kill P@S` sends SIGKILL to process P of the first
attempt once process 0 has logged step S to metrics.jsonl. `--restart-processes N
--restart-devices-per-process D`: later attempts run on another shape (an elastic restart: the
train loop re-plans the layout for the device count there is).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_step(metrics: str) -> int:
    try:
        with open(metrics) as f:
            lines = [line for line in f if line.strip()]
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def _env(base: dict, devices: int, address: str, n: int, pid: int) -> dict:
    env = {k: v for k, v in base.items() if k not in ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")}
    if devices:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
        env["XLA_FLAGS"] = " ".join([f"--xla_force_host_platform_device_count={devices}", *flags])
        env.setdefault("JAX_PLATFORMS", "cpu")
    if n > 1:
        env.update(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(pid))
    else:
        env.pop("JAX_NUM_PROCESSES", None), env.pop("JAX_PROCESS_ID", None)
    return env


def attempt(train_args, n: int, devices: int, log_dir: str, index: int, grace_s: float, kill=None, metrics=""):
    """Run one attempt of the job; returns its record (codes, hangs, timings)."""
    address = f"127.0.0.1:{_free_port()}"
    procs, files = [], []
    for pid in range(n):
        out = open(os.path.join(log_dir, f"a{index}_p{pid}.out"), "w")
        err = open(os.path.join(log_dir, f"a{index}_p{pid}.err"), "w")
        files += [out, err]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "jaxsys.train", *train_args],
                env=_env(dict(os.environ), devices, address, n, pid),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
        )
    start = time.monotonic()
    record: dict = {"attempt": index, "processes": n, "devices_per_process": devices}
    exited: dict[int, float] = {}
    failed_at = None
    try:
        while len(exited) < n:
            now = time.monotonic()
            for pid, p in enumerate(procs):
                if pid not in exited and p.poll() is not None:
                    exited[pid] = now
                    if p.returncode != 0 and failed_at is None:
                        failed_at, record["first_failure"] = now, pid
            if kill is not None and "killed" not in record and _last_step(metrics) >= kill[1]:
                procs[kill[0]].send_signal(signal.SIGKILL)
                failed_at = time.monotonic()
                record["killed"] = {"process": kill[0], "after_step": _last_step(metrics), "at_s": failed_at - start}
                record["first_failure"] = kill[0]
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                break
            time.sleep(0.05)
    finally:
        hung = [pid for pid, p in enumerate(procs) if p.poll() is None]
        for pid in hung:
            procs[pid].kill()
            procs[pid].wait()
        for f in files:
            f.close()
    record["codes"] = [p.returncode for p in procs]
    record["hung"] = hung  # still running `grace_s` after the first failure: killed here
    if failed_at is not None:
        record["exit_after_failure_s"] = {str(pid): round(t - failed_at, 3) for pid, t in exited.items()}
    record["seconds"] = round(time.monotonic() - start, 3)
    return record


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m jaxsys.launch [options] -- <jaxsys.train arguments>", file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=0, help="simulated CPU devices (0: leave)")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--grace-s", type=float, default=60.0, help="after a failure, how long the rest may take")
    parser.add_argument("--kill", default="", help="P@S: SIGKILL process P once step S is logged (first attempt)")
    parser.add_argument("--restart-processes", type=int, default=0, help="processes of later attempts")
    parser.add_argument("--restart-devices-per-process", type=int, default=0)
    parser.add_argument("--log-dir", default="", help="default: {workdir}/launch")
    args = parser.parse_args(argv[:cut])
    train_args = argv[cut + 1 :]
    workdir = next((a.split("=", 1)[1] for a in train_args if a.startswith("--workdir=")), None)
    if workdir is None and "--workdir" in train_args:
        workdir = train_args[train_args.index("--workdir") + 1]
    if workdir is None:
        print("error: the train arguments need --workdir", file=sys.stderr)
        return 2
    log_dir = args.log_dir or os.path.join(workdir, "launch")
    os.makedirs(log_dir, exist_ok=True)
    kill = None
    if args.kill:
        p, s = args.kill.split("@")
        kill = (int(p), int(s))
    n, devices = args.processes, args.devices_per_process
    for index in range(args.max_restarts + 1):
        record = attempt(
            train_args, n, devices, log_dir, index, args.grace_s, kill if index == 0 else None,
            os.path.join(workdir, "metrics.jsonl"),
        )  # fmt: skip
        with open(os.path.join(log_dir, "launch.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        codes = record["codes"]
        print(f"jaxsys.launch: attempt {index} ({n} x {devices or '-'}): exit codes {codes}", flush=True)
        if all(c == 0 for c in codes):
            return 0
        n = args.restart_processes or n
        devices = args.restart_devices_per_process or devices
    print(f"jaxsys.launch: giving up after {args.max_restarts} restarts", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
