"""Restart cost: JAX's persistent compile cache (a second run of a config compiles nothing) and the
goodput record (jaxsys/goodput.py, docs/goodput.md)."""

import contextlib
import io
import json
import shutil

import pytest

from jaxsys import compile_cache, goodput, train
from tests.helpers import small_config


def _config(cache_dir):
    c = small_config(dict(data=4, tensor=2))
    c.train.steps, c.train.log_every = 4, 2
    c.checkpoint.every_steps, c.checkpoint.async_save = 2, False
    c.compile_cache.dir = str(cache_dir)
    return c


def _launches(workdir):
    return [json.loads(line) for line in open(workdir / "goodput.jsonl")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same config trained twice in new workdirs with one cache folder, then the second run
    restarted from its step-2 checkpoint (its step-4 checkpoint lost, as in a crash)."""
    root = tmp_path_factory.mktemp("cache")
    cache, first, second = root / "xla", root / "first", root / "second"
    train.main(_config(cache), str(first))
    entries = sorted(p.name for p in cache.iterdir())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train.main(_config(cache), str(second))
    shutil.rmtree(second / "checkpoints" / "4")
    records = train.main(_config(cache), str(second))
    yield dict(cache=cache, entries=entries, first=first, second=second, restart=records, printed=printed.getvalue())
    off = small_config().compile_cache
    off.dir = ""
    compile_cache.use(off)  # the setting is process-wide: the suite's later tests run without a cache


def test_second_run_compiles_nothing(runs):
    first, second = _launches(runs["first"])[0], _launches(runs["second"])[0]
    assert first["programs_compiled"] >= 2 and first["programs_loaded"] == 0  # init, step, eval, ...
    assert len(runs["entries"]) >= first["programs_compiled"]  # each compiled program was written
    assert second["programs_compiled"] == 0 and second["programs_loaded"] >= 1
    assert second["compile_cache"] == str(runs["cache"])
    loaded = second["programs_loaded"]
    assert f"jaxsys: compile cache {runs['cache']}: {loaded} programs loaded from it, 0 compiled" in runs["printed"]
    assert "jaxsys: goodput " in runs["printed"]
    # (its compile_s is not compared with the first run's: a wall time on a shared CPU, it came out
    # larger once in CI with every program loaded; the counts above are what the cache decides)


def test_restart_loads_its_programs_and_counts_the_lost_steps(runs):
    restart = _launches(runs["second"])[1]
    assert restart["lost_steps"] == 2 and restart["restore_s"] > 0 and restart["init_s"] == 0
    assert restart["programs_loaded"] >= 1
    assert [r["step"] for r in runs["restart"]] == [4]  # it trained steps 3-4 again


def test_goodput_record_adds_up(runs):
    for launch in _launches(runs["first"]) + _launches(runs["second"]):
        parts = [launch[f"{k}_s"] for k in goodput.KINDS] + [launch["step_s"]]
        assert launch["wall_s"] == pytest.approx(sum(parts), rel=1e-6, abs=1e-6)
        assert 0 < launch["goodput"] < 1 and launch["goodput"] == pytest.approx(launch["step_s"] / launch["wall_s"])
    metrics = [json.loads(line) for line in open(runs["first"] / "metrics.jsonl")]
    assert all(0 < r["goodput"] < 1 for r in metrics)


def test_goodput_stopwatch_against_a_fake_clock():
    """Badput inside the loop is subtracted from it; outside it, it only adds to the wall time."""
    now = [0.0]
    gp = goodput.Goodput(clock=lambda: now[0])
    with gp.timed("compile"):
        now[0] += 3.0
    now[0] += 1.0  # building the program: other
    gp.loop_started()
    now[0] += 4.0  # steps
    with gp.timed("data_wait"):
        now[0] += 0.5
    gp.add("checkpoint", 1.5)
    now[0] += 1.5
    gp.loop_ended()
    r = gp.record()
    assert r["wall_s"] == 10.0 and r["step_s"] == 4.0 and r["goodput"] == 0.4
    assert (r["compile_s"], r["data_wait_s"], r["checkpoint_s"], r["other_s"]) == (3.0, 0.5, 1.5, 1.0)


def test_cache_folder_from_config_and_environment(monkeypatch, tmp_path):
    c = small_config().compile_cache
    monkeypatch.setenv(compile_cache.ENV, "")
    assert compile_cache.directory(c) is None  # the suite's default: off
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("JAXSYS_CACHE", str(tmp_path))
    assert compile_cache.directory(c) == str(tmp_path / "xla")
    c.dir = ""
    assert compile_cache.directory(c) is None
