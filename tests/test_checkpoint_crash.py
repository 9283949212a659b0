"""A training process killed with SIGKILL in the middle of an asynchronous save restarts from the last
complete step: the half-saved step is ignored, and no complete step is lost.

The run is `python -m jaxsys.train` in a real subprocess (through tests/crash_during_save.py, which
makes the save of step 3 stall after writing its files and before Orbax's atomic rename, so that the
kill lands at a known point of the save). The resumed run's losses must equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY_8_DEVICES, subprocess_env

pytestmark = pytest.mark.slow

TIMEOUT_S = 300
ARGS = [
    *TINY_8_DEVICES,
    "--config.train.steps=6",
    "--config.checkpoint.every_steps=1",
    "--config.checkpoint.keep=0",
    "--config.checkpoint.async_save=True",
]


def _train(workdir: Path, *, module="jaxsys.train", env_extra=None, wait=True):
    env = subprocess_env(8, **(env_extra or {}))
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *ARGS, "--workdir", str(workdir)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if wait:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, out
        return out
    return proc


def _losses(workdir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in open(workdir / "metrics.jsonl") if line.strip()]
    return {r["step"]: r["loss"] for r in records}


def _complete_steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def test_sigkill_during_async_save_resumes_from_last_complete_step(tmp_path):
    reference = tmp_path / "uninterrupted"
    _train(reference)

    crashed = tmp_path / "crashed"
    marker = tmp_path / "stalled_in_save"
    proc = _train(
        crashed,
        module="tests.crash_during_save",
        wait=False,
        env_extra={"JAXSYS_TEST_STALL_STEP": "3", "JAXSYS_TEST_STALL_MARKER": str(marker)},
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not marker.exists():
        assert proc.poll() is None, f"exited before the stalled save:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "the save of step 3 never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL

    # Step 3 was written but not committed: its files sit in Orbax's temporary directory.
    partial = Path(marker.read_text())
    assert partial.exists() and any(partial.rglob("*")) and partial.name != "3"
    assert _complete_steps(crashed) == [1, 2]
    saved_before = {
        p: p.stat().st_size for step in (1, 2) for p in (crashed / "checkpoints" / str(step)).rglob("*") if p.is_file()
    }

    out = _train(crashed)  # the same command again
    assert "resumed from step 2" in out, out
    assert _complete_steps(crashed) == [1, 2, 3, 4, 5, 6]
    # Nothing complete was lost or rewritten.
    assert {p: p.stat().st_size for p in saved_before if p.exists()} == saved_before
    want, got = _losses(reference), _losses(crashed)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert got[step] == want[step], step  # bitwise: same program, same data, same state
