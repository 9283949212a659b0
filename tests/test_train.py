"""The training loop end to end: outputs, evaluation, NaN stop, no overwriting of a finished run."""

import json
import os

import numpy as np
import pytest

from jaxsys import train
from tests.helpers import small_config


def test_main_writes_metrics_events_and_config(tmp_path):
    c = small_config(dict(data=2, fsdp=2, tensor=2))
    c.train.steps, c.train.eval_every, c.train.log_every = 4, 2, 2
    records = train.main(c, str(tmp_path))
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert lines == records
    assert [r["step"] for r in lines] == [1, 2, 4]
    for r in lines:
        assert {"step", "loss", "tokens_per_s", "mfu", "grad_norm", "lr"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and np.isfinite(r["loss"])
    assert "eval_loss" in lines[1] and "eval_loss" in lines[2] and "eval_loss" not in lines[0]
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert any(name.startswith("events") for name in os.listdir(tmp_path / "tb"))
    saved = json.load(open(tmp_path / "config.json"))
    assert saved["mesh"]["tensor"] == 2 and saved["train"]["steps"] == 4


def test_existing_run_is_not_overwritten(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(FileExistsError, match="already holds a run"):
        train.main(small_config(dict(data=8)), str(tmp_path))
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_nan_loss_stops_the_run(tmp_path):
    c = small_config(dict(data=8))
    c.model.init_std = float("nan")  # every weight NaN: the first loss is NaN
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 1"):
        train.main(c, str(tmp_path))
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_schedules():
    from jaxsys.optim.schedules import schedule

    c = small_config().train
    c.steps, c.warmup_steps, c.lr, c.min_lr_ratio = 100, 10, 1.0, 0.1
    c.schedule = "cosine"
    cos = schedule(c)
    assert float(cos(0)) == 0.0 and float(cos(10)) == pytest.approx(1.0)
    assert float(cos(100)) == pytest.approx(0.1, abs=1e-6)
    c.schedule, c.decay_fraction = "wsd", 0.2
    wsd = schedule(c)
    assert float(wsd(50)) == pytest.approx(1.0) and float(wsd(82)) == pytest.approx(1.0)
    assert float(wsd(91)) == pytest.approx(1.0 - 0.9 * 9 / 18, rel=1e-5)
    assert float(wsd(100)) == pytest.approx(0.1, abs=1e-6)
