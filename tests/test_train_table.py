"""benchmarks/train_table.py: the figures it reports from metrics.jsonl files."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import train_table  # noqa: E402


def _run(tmp_path, name, rows):
    d = tmp_path / name
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for step, loss, tps in rows:
            f.write(json.dumps({"step": step, "loss": loss, "tokens_per_s": tps, "mfu": tps / 1e4}) + "\n")
        f.write(json.dumps({"goodput": 0.9}) + "\n")  # a line without tokens/s is not a window
    return str(d)


def test_ratios_skip_the_compile_window_and_compare_losses_at_the_same_step(tmp_path):
    base = _run(tmp_path, "base", [(1, 5.0, 10.0), (10, 4.0, 100.0), (20, 3.0, 120.0), (30, 2.0, 110.0)])
    fast = _run(tmp_path, "fast", [(1, 5.0, 1.0), (10, 4.4, 150.0), (20, 3.3, 165.0)])
    runs = {"base": train_table.summarize(base), "fast": train_table.summarize(fast)}
    assert runs["base"]["tokens_per_s"] == 110.0  # median of 100, 120, 110: step 1's window dropped
    assert runs["fast"]["tokens_per_s"] == 157.5
    text = train_table.table(runs)
    fast_row = next(line for line in text.splitlines() if line.startswith("| fast"))
    assert "1.432x" in fast_row  # 157.5 / 110
    assert "+10.00%" in fast_row  # 3.3 against the baseline's 3.0 at step 20, not its last 2.0


def test_a_run_without_metrics_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no metrics"):
        train_table.summarize(str(tmp_path))
