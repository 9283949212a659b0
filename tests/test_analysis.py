"""The analysis: collective bytes read from the program equal the papers' closed forms where the
formula is exact, per-device state bytes equal the ZeRO formula, and pod-size layouts compile on
this machine without materialising anything."""

import json
import math
import os
import subprocess
import sys

import jax
import pytest

from jaxsys.analysis import report
from jaxsys.config import ConfigError
from tests.helpers import ROOT, small_config

EXACT_LAYOUTS = {
    "dp8_zero0": (dict(data=8), 0, False, {}),
    "dp8_zero1": (dict(data=8), 1, False, {}),
    "dp8_zero2": (dict(data=8), 2, False, {}),
    "fsdp8": (dict(fsdp=8), 0, False, {}),
    "fsdp8_bf16_remat": (dict(fsdp=8), 0, False, dict(compute_dtype="bfloat16", remat="full")),
    "tp8": (dict(tensor=8), 0, False, dict(n_kv_heads=8)),
    "tp4_sp": (dict(tensor=4), 0, True, dict(n_kv_heads=4)),
    "tp8_sp_bf16": (dict(tensor=8), 0, True, dict(n_kv_heads=8, compute_dtype="bfloat16")),
}


def _config(mesh, stage, sp, model):
    c = small_config(mesh, **model)
    c.train.zero_stage, c.parallel.sequence_parallel = stage, sp
    return c


def _analyze(config, **kw):
    n = math.prod(config.mesh[a] for a in config.mesh)
    return report.analyze(config, devices=jax.devices()[:n], **kw)


def _check_state_bytes(m):
    assert m["params_bytes"] == m["formula"]["params"]
    assert m["grads_bytes"] == m["formula"]["grads"]
    # optimizer: Adam's mu and nu as the formula says, plus optax's step counters (int32 scalars)
    assert 0 <= m["optimizer_bytes"] - m["formula"]["optimizer"] <= 16
    assert m["peak_bytes_per_device"] >= m["params_bytes"] + m["optimizer_bytes"]


@pytest.mark.parametrize("name", list(EXACT_LAYOUTS))
def test_collectives_and_state_bytes_equal_formulas(name):
    mesh, stage, sp, model = EXACT_LAYOUTS[name]
    r = _analyze(_config(mesh, stage, sp, model), flops=False)
    measured, formula = report.by_kind_axes(r["collectives"]), report.by_kind_axes(r["collectives_formula"])
    assert set(measured) == set(formula), (measured, formula)
    for key in formula:
        assert measured[key][0] == formula[key][0], (key, measured[key], formula[key])
        assert measured[key][1] == pytest.approx(formula[key][1], rel=1e-12), (key, measured[key], formula[key])
    scalars = sum(row["count"] for row in r["collectives"] if row["scalar"])
    assert scalars == r["metric_scalars_formula"]
    _check_state_bytes(r["memory"])


def test_state_bytes_of_a_hybrid_layout_equal_zero_formula():
    config = _config(dict(data=2, fsdp=2, tensor=2), 2, True, dict(compute_dtype="bfloat16"))
    _check_state_bytes(_analyze(config, flops=False)["memory"])


def test_zero_stages_shrink_memory_as_the_paper_says():
    rows = {s: _analyze(_config(dict(data=8), s, False, {}), flops=False)["memory"] for s in (0, 1, 2)}
    assert rows[1]["optimizer_bytes"] < rows[0]["optimizer_bytes"] / 7
    assert rows[2]["grads_bytes"] == rows[0]["grads_bytes"] / 8
    assert rows[1]["params_bytes"] == rows[0]["params_bytes"]


def test_flops_measured_beside_analytic():
    r = _analyze(small_config(dict(data=8)))
    # XLA also counts softmax, norms and the optimizer, so it sits a little above 6N + attention
    assert 1.0 <= r["flops_per_device"] / r["flops_per_device_analytic"] < 1.3
    rl = r["roofline"]
    assert rl["step_s_serial"] >= rl["step_s_overlapped"] > 0
    text = report.format_report(r)
    assert "all_reduce[data]" in text and "DP gradient all-reduce" in text


def _analyze_cli(*args, devices=None):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-m", "jaxsys.analyze", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.slow
def test_pod_size_layout_of_a_multi_billion_model_compiles_here():
    result = _analyze_cli("--config", "configs/llama_8b.py", "--devices", "256", "--json", "--no-flops")
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(result.stdout)
    assert r["params_count"] > 7e9 and r["config"]["devices"] == 256
    # 8B parameters in fp32 with Adam are 128 GB: only sharded over 256 devices do they fit 80 GB
    m = r["memory"]
    assert m["params_bytes"] == m["formula"]["params"]
    assert m["params_bytes"] + m["optimizer_bytes"] < 2e9
    assert {tuple(row["axes"]) for row in r["collectives"]} >= {("fsdp",), ("tensor",)}


def test_analyze_rejects_too_many_devices():
    result = _analyze_cli("--config", "configs/tiny.py", "--devices", "100000")
    assert result.returncode == 2 and "at most 2048" in result.stderr


def test_analyze_rejects_a_layout_that_does_not_divide_the_model():
    result = _analyze_cli("--config", "configs/tiny.py", "--devices", "16", "--config.mesh.tensor=16")
    assert result.returncode == 2 and "n_heads=8 is not divisible by the 16 shards" in result.stderr


def test_analyze_rejects_device_count_mismatch():
    with pytest.raises(ConfigError, match="8 are available"):
        report.analyze(small_config(dict(data=4)))
