"""What every experiment's run.py shares: run a worker in a fresh subprocess (each needs its own
device count or memory) and collect the JSON results it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "@@RESULT@@"


def emit(result: dict) -> None:
    """Called in a worker: hand one result back to the parent."""
    print(MARK + json.dumps(result), flush=True)


def run_worker(script: str, n: int, jobs: list, timeout: int = 1800, what: str = "N") -> list[dict]:
    """Run `script --worker n` with `jobs` as JSON on stdin, without the parent's XLA_FLAGS (the
    worker sets its own device count); return what it `emit`ted."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.abspath(script), "--worker", str(n)],
                          input=json.dumps(jobs), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"worker for {what}={n} failed (rc {proc.returncode})")
    return [json.loads(line[len(MARK):]) for line in proc.stdout.splitlines() if line.startswith(MARK)]
