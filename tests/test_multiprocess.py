"""Several processes: 2 processes x 4 CPU devices on localhost train exactly like 1 process x 8,
and their checkpoint restores in 1 process on another layout.

Each run is `python -m jaxsys.train` in a subprocess, so that every process starts JAX with its own
device count and (for the 2-process run) calls `jax.distributed.initialize` through
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID before it touches a device.

The layout is data=2, fsdp=2, tensor=2. `make_mesh` sorts devices by (process, id) and `data` is
the outermost mesh axis, so with 4 + 4 devices the two `data` rows are the two processes: the
data-parallel gradient reduction (and the ZeRO/FSDP collectives over `data`) cross the process
boundary, while fsdp and tensor stay inside each process. Each process builds only its own rows of
the global batch (`data.global_batch` uses make_array_from_callback).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import TINY_8_DEVICES, free_port, subprocess_env

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
ARGS = [
    *TINY_8_DEVICES,
    # constant after warmup, so that a 4-step run is the start of a 6-step one
    "--config.train.schedule=constant",
]
BANNER = "jaxsys: "  # printed by process 0 only


def _run(envs: list[dict[str, str]], workdir: Path, logdir: Path, extra_args=()) -> list[str]:
    """Start one `jaxsys.train` process per env (all at once); wait for all to exit 0.
    Returns their stdouts. On a failure or the timeout, kills the rest and fails with all logs."""
    logdir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    try:
        for i, env in enumerate(envs):
            out, err = open(logdir / f"p{i}.out", "w+"), open(logdir / f"p{i}.err", "w+")
            logs.append((out, err))
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "jaxsys.train", *ARGS, *extra_args, "--workdir", str(workdir)],
                    cwd=REPO,
                    env=env,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs):
            # A process that failed leaves the other one blocked in a collective: stop early.
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        timed_out = time.monotonic() > deadline
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for out, err in logs:
        out.seek(0), err.seek(0)
        texts.append((out.read(), err.read()))
        out.close(), err.close()
    if codes != [0] * len(procs):
        why = f"timed out after {TIMEOUT_S}s" if timed_out else "failed"
        report = "\n".join(
            f"--- process {i}: exit {'killed' if c is None else c}\n[stdout]\n{o}\n[stderr]\n{e}"
            for i, (c, (o, e)) in enumerate(zip(codes, texts))
        )
        pytest.fail(f"jaxsys.train {why}:\n{report}")
    return [o for o, _ in texts]


def _records(workdir: Path) -> list[dict]:
    with open(workdir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_two_processes_match_one_process_and_their_checkpoint_restores_in_one(tmp_path):
    # 1 process x 8 devices, 6 steps (runs first, so it also fills the stdlib-corpus cache if empty).
    single = tmp_path / "single"
    [out] = _run([subprocess_env(8)], single, tmp_path / "logs_single", ["--config.train.steps=6"])
    assert BANNER in out

    # 2 processes x 4 devices, one shared workdir, 4 steps; process 0 writes metrics.jsonl and
    # both write their shards of the final checkpoint (step 4).
    multi = tmp_path / "multi"
    address = f"127.0.0.1:{free_port()}"
    envs = [
        subprocess_env(4, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
        for i in range(2)
    ]
    out0, out1 = _run(envs, multi, tmp_path / "logs_multi")
    # Each process has only 4 local devices, so the 8-device mesh validated only because
    # jax.distributed joined them; the banner shows which process had process_index 0.
    assert BANNER in out0 and "mesh data=2 fsdp=2 tensor=2" in out0, out0
    assert BANNER not in out1, f"process 1 printed the process-0 banner:\n{out1}"

    ref, got = _records(single), _records(multi)
    assert [r["step"] for r in ref] == [1, 2, 3, 4, 5, 6]
    # Same steps, each logged once: process 1 appended nothing to the shared metrics.jsonl.
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-6), (a, b)
    assert ref[0]["loss"] > ref[3]["loss"]  # it trained
    # Process 1 wrote no files of its own into the shared workdir (only process 0's outputs).
    assert sorted(p.name for p in multi.iterdir()) == sorted(p.name for p in single.iterdir())

    # The 2-process checkpoint restores in 1 process x 8 devices on another layout (fsdp=8) and
    # training goes on as the single-process run did.
    [out] = _run(
        [subprocess_env(8)],
        multi,
        tmp_path / "logs_restore",
        ["--config.train.steps=6", "--config.mesh.data=1", "--config.mesh.tensor=1", "--config.mesh.fsdp=8"],
    )
    assert "resumed from step 4" in out and "mesh fsdp=8" in out, out
    resumed = _records(multi)[4:]
    assert [r["step"] for r in resumed] == [5, 6]
    for a, b in zip(ref[4:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
