"""Quantized models (config.model.quant, models/quant.py), `jaxsys.quantize` / `jaxsys.evaluate`,
and int8 training with a straight-through estimator (config.model.quant_train).

Tolerances. A weight quantized to b bits with absmax scaling per channel (w8) or per group of G
(w4) carries an error uniform in +-s/2 with s = max|w| / qmax, rms s / sqrt(12). For the Gaussian
init weights here, max over a 64-row channel is ~2.4 sigma (w8: s = sigma / 53, rms 0.5% of sigma)
and over a group of 32 ~2.1 sigma (w4: s = 0.3 sigma, rms 9% of sigma). A matmul's output error
is then about that fraction of its output (the errors are independent over K), and the few
matmuls of the 2-layer test model compound it by well under 2x; the logits of this near-uniform
random model are small, so the checks are on the logits' deviation relative to their spread:
w8 < 2%, w4 < 25%. W8A8 adds activation rounding of the same size as w8's: < 3%.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import data, evaluate, quantize, train
from jaxsys.checkpoint import CheckpointError
from jaxsys.config import ConfigError
from jaxsys.models import quant, transformer
from jaxsys.quantization.params import quantize_params
from tests.helpers import program_for, small_config

MODEL = dict(n_kv_heads=4)  # tensor=4 splits the kv heads too


def _float_params(seed=0):
    c = small_config(**MODEL)
    return c, program_for(c).init(seed).params


def _logits(config, params):
    """Logits [B, T, V] of the first eval batch on one device (no mesh axes: no collectives)."""
    program = program_for(config)
    corpus = data.load_corpus(config.data)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tokens = data.global_batch(corpus, sharding, 0, 0, config.train.batch_size, config.data.seq_len, "eval")
    params = jax.device_put(params, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    fn = jax.jit(lambda p, ids: transformer.logits(p, ids, config.model, program.layout, program.specs))
    return np.asarray(fn(params, tokens[:, :-1]), np.float32)


def _quantized(fmt, group_size=32, zero_point=False, impl="pallas", mesh=None):
    c = small_config(
        mesh, quant=fmt, quant_group_size=group_size, quant_zero_point=zero_point, quant_impl=impl, **MODEL
    )
    return c


def _eval_loss(config, params):
    program = program_for(config)
    corpus = data.load_corpus(config.data)
    batch = data.global_batch(
        corpus, program.batch_sharding, 0, 0, config.train.batch_size, config.data.seq_len, "eval"
    )
    return float(program.eval_loss_fn()(jax.device_put(params, program.param_shardings), batch))


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize(
    "fmt,group_size,zero_point,bound",
    [("w8a16", 128, False, 0.02), ("w4a16", 32, False, 0.25), ("w4a16", 64, True, 0.25), ("w8a8", 128, False, 0.03)],
)
def test_quantized_logits_are_within_the_formats_bound_of_the_float_model(fmt, group_size, zero_point, bound):
    c, params = _float_params()
    want = _logits(c, params)
    cq = _quantized(fmt, group_size, zero_point)
    qparams = quantize_params(jax.tree.map(np.asarray, params), cq.model, fmt, group_size, zero_point)
    got = _logits(cq, qparams)
    deviation = np.linalg.norm(got - want) / np.linalg.norm(want - want.mean())
    assert 0 < deviation < bound, deviation


@pytest.mark.parametrize("fmt,zero_point", [("w8a16", False), ("w4a16", False), ("w4a16", True), ("w8a8", False)])
def test_kernels_in_the_model_equal_the_reference_semantics(fmt, zero_point):
    """The Pallas path (interpret mode) and the pure-JAX reference path of the same checkpoint:
    the same integer sums in another order, so fp32 logits agree to rounding."""
    c, params = _float_params()
    qparams = quantize_params(jax.tree.map(np.asarray, params), _quantized(fmt).model, fmt, 32, zero_point)
    pallas = _logits(_quantized(fmt, 32, zero_point, "pallas"), qparams)
    reference = _logits(_quantized(fmt, 32, zero_point, "reference"), qparams)
    np.testing.assert_allclose(pallas, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


@pytest.mark.parametrize("fmt", ["w8a16", "w4a16"])
def test_weight_only_formats_are_the_same_on_one_device_and_tensor4(fmt):
    """Column-parallel weights split N', row-parallel ones K' in whole groups: every output is the
    same sum of the same products, so the eval loss agrees to fp32 rounding."""
    c, params = _float_params()
    qparams = quantize_params(jax.tree.map(np.asarray, params), _quantized(fmt).model, fmt, 32)
    one = _eval_loss(_quantized(fmt), qparams)
    tp4 = _eval_loss(_quantized(fmt, mesh={"tensor": 4}), qparams)
    sp = _quantized(fmt, mesh={"tensor": 4, "data": 2})
    sp.parallel.sequence_parallel = True
    assert tp4 == pytest.approx(one, rel=1e-6)
    assert _eval_loss(sp, qparams) == pytest.approx(one, rel=1e-6)


def test_w8a8_under_tensor_parallelism_is_within_quantization_noise():
    """Row-parallel matmuls quantize each rank's slice of the activations with its own scale, so
    tensor=4 differs from one device by activation rounding, not more."""
    c, params = _float_params()
    qparams = quantize_params(jax.tree.map(np.asarray, params), _quantized("w8a8").model, "w8a8")
    one, tp4 = _eval_loss(_quantized("w8a8"), qparams), _eval_loss(_quantized("w8a8", mesh={"tensor": 4}), qparams)
    assert tp4 == pytest.approx(one, rel=1e-3)


def test_quantized_leaves_shard_like_the_weights_they_replace():
    program = program_for(_quantized("w4a16", mesh={"tensor": 4}))
    layers = program.param_pspecs["layers"]
    assert layers["wq"]["packed"] == jax.sharding.PartitionSpec(None, None, "tensor")  # column: heads
    assert layers["w_down"]["packed"] == jax.sharding.PartitionSpec(None, "tensor")  # row: mlp (K')
    assert layers["w_down"]["scale"] == jax.sharding.PartitionSpec(None, "tensor")  # its groups too
    assert layers["wo"]["scale"] == jax.sharding.PartitionSpec(None, "tensor")  # groups over heads x head_dim
    assert layers["wq"]["scale"] == jax.sharding.PartitionSpec(None, None, "tensor")
    shapes = jax.tree.map(lambda a: (a.shape, str(a.dtype)), program.abstract_state().params["layers"])
    m = program.config.model
    assert shapes["wq"]["packed"] == ((2, m.d_model // 2, m.n_heads, m.head_dim), "uint8")
    assert shapes["wo"]["scale"] == ((2, m.n_heads * m.head_dim // 32, m.d_model), "float32")


def test_analysis_of_a_quantized_config_compiles_its_forward():
    """Per device on tensor=2 (D=64, N=8, K=4, H=16, F=128, L=2): int8 codes of the seven dense
    weights, 49,152 B per layer split over 2 ranks, plus fp32 scales per output channel (those of
    wo and w_down are over D, replicated): (128+64+64+128+128)/2 + 64 + 64 = 384 per layer."""
    from jaxsys.analysis import report

    c = _quantized("w8a16", mesh={"tensor": 2})
    r = report.analyze(c, "h100", jax.devices()[:2], flops=False)
    assert r["mode"] == "inference"
    assert r["memory"]["dense_weight_bytes"] == 2 * (49152 // 2 + 384 * 4)
    kinds = {(row["kind"], tuple(row["axes"])) for row in r["collectives"]}
    assert ("all_reduce", ("tensor",)) in kinds  # the Megatron g of wo and w_down
    assert "weights" in report.format_inference_report(r)


def test_bad_quantization_configs_are_named():
    with pytest.raises(
        ConfigError, match=r"K' of wo is n_heads \* v_head_dim / tensor = 32 per rank, not a multiple of the group size"
    ):
        program_for(_quantized("w4a16", 64, mesh={"tensor": 4}))
    with pytest.raises(ConfigError, match="quant_group_size=48"):
        program_for(_quantized("w4a16", 48))
    with pytest.raises(ConfigError, match="config.model.quant='int4'"):
        program_for(_quantized("int4"))
    c = _quantized("w8a16")
    c.model.quant_train = "int8"
    with pytest.raises(ConfigError, match="exclude each other"):
        program_for(c)
    with pytest.raises(ConfigError, match="for inference"):
        train.main(_quantized("w8a16"), "/tmp/never-written")


# ----------------------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def float_run(tmp_path_factory):
    """A 12-step tiny run with a checkpoint, on 8 data shards."""
    workdir = tmp_path_factory.mktemp("float")
    c = small_config(dict(data=8), **MODEL)
    c.train.steps, c.train.eval_batches = 12, 2
    c.checkpoint.async_save = False
    train.main(c, str(workdir))
    return str(workdir)


@pytest.mark.parametrize(
    "method,fmt,rotate", [("rtn", "w4a16", False), ("gptq", "w4a16", False), ("gptq", "w4a4", True)]
)
def test_quantize_command_writes_a_workdir_that_evaluates_on_any_mesh(float_run, tmp_path, method, fmt, rotate, capsys):
    """w4a4 rotated: GPTQ against the rotated Hessian; its per-group activation scales keep
    tensor=4 equal to one device, as the weight-only format's are."""
    out = str(tmp_path / f"q_{method}")
    args = [
        "--workdir",
        float_run,
        "--out",
        out,
        "--format",
        fmt,
        "--method",
        method,
        "--group-size",
        "32",
        "--calibration-batches",
        "2",
    ] + (["--rotate"] if rotate else [])
    assert quantize.main(args) == 0
    printed = capsys.readouterr().out
    assert "python -m jaxsys.evaluate --workdir" in printed and (f"{fmt} rotated by" in printed) == rotate
    saved = json.load(open(os.path.join(out, "config.json")))
    assert saved["model"]["quant"] == fmt and saved["model"]["quant_group_size"] == 32
    assert saved["model"]["quant_rotate"] is rotate
    base = train.evaluate_workdir(float_run, ["--config.train.eval_batches=2"])
    one = train.evaluate_workdir(out, ["--config.train.eval_batches=2", "--config.mesh.data=1"])
    tp = train.evaluate_workdir(
        out, ["--config.train.eval_batches=2", "--config.mesh.data=2", "--config.mesh.tensor=4"]
    )
    assert one["step"] == base["step"] == 12
    assert one["param_bytes"] < 0.6 * base["param_bytes"]  # the dense layers in 4 bits, the rest fp32
    assert tp["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    assert abs(one["eval_loss"] - base["eval_loss"]) < 0.05 * base["eval_loss"]


def test_evaluate_prints_loss_and_perplexity(float_run, capsys):
    assert evaluate.main(["--workdir", float_run, "--json", "--config.train.eval_batches=1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["perplexity"] == pytest.approx(np.exp(result["eval_loss"]))


def test_quantize_and_evaluate_name_bad_input(float_run, tmp_path, capsys):
    out = str(tmp_path / "q")
    assert quantize.main(["--workdir", float_run, "--out", out, "--format", "w8a16"]) == 0
    capsys.readouterr()
    # the output exists: nothing is overwritten
    before = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert quantize.main(["--workdir", float_run, "--out", out, "--format", "w8a16"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == before
    # a quantized workdir is not quantized again
    assert quantize.main(["--workdir", out, "--out", str(tmp_path / "qq"), "--format", "w4a16"]) == 2
    assert "already quantized" in capsys.readouterr().err
    # a float checkpoint read as a quantized model, and the reverse
    with pytest.raises(CheckpointError, match="is not quantized"):
        train.evaluate_workdir(float_run, ["--config.model.quant=w8a16"])
    with pytest.raises(CheckpointError, match="holds params/layers/w[a-z_]+ quantized"):
        train.evaluate_workdir(out, ["--config.model.quant=none"])
    # group size that does not divide K, caught before any reading
    assert (
        quantize.main(
            ["--workdir", float_run, "--out", str(tmp_path / "g"), "--format", "w4a16", "--group-size", "128"]
        )
        == 2
    )
    assert "not a multiple of the group size" in capsys.readouterr().err
    assert not os.path.exists(str(tmp_path / "g" / "checkpoints"))
    assert (
        quantize.main(["--workdir", str(tmp_path / "missing"), "--out", str(tmp_path / "m"), "--format", "w8a16"]) == 2
    )
    assert "does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------------------- int8 training


def _numpy_int8_product(a, b, a_axis, b_axis):
    """Independent re-statement: a[M, K] and b[K, N] rounded to int8 with symmetric absmax scales
    along `a_axis` / `b_axis`, multiplied exactly (int64), rescaled."""

    def q(x, axis):
        s = np.abs(x).max(axis=axis, keepdims=True) / 127.0
        s = np.where(s > 0, s, 1.0)
        return np.clip(np.round(x / s), -127, 127).astype(np.int64), s

    qa, sa = q(np.asarray(a, np.float64), a_axis)
    qb, sb = q(np.asarray(b, np.float64), b_axis)
    return (qa @ qb) * sa * sb


@pytest.mark.parametrize("pallas", [False, True])
def test_int8_matmul_and_its_straight_through_gradients_equal_the_reference(pallas):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((24, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 48)) * 0.1).astype(np.float32)
    dy = rng.standard_normal((24, 48)).astype(np.float32)
    y, vjp = jax.vjp(lambda x, w: quant.int8_matmul(x, w, pallas), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    np.testing.assert_allclose(np.asarray(y), _numpy_int8_product(x, w, 1, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), _numpy_int8_product(dy, w.T, 1, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), _numpy_int8_product(x.T, dy, 1, 0), rtol=1e-5, atol=1e-5)
    # and all three are within int8 rounding of the float products
    for got, want in ((y, x @ w), (dx, dy @ w.T), (dw, x.T @ dy)):
        assert np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want) < 0.02


@pytest.mark.parametrize("mesh", [None, pytest.param({"tensor": 2, "data": 2}, marks=pytest.mark.slow)])
def test_int8_training_follows_float_training(mesh):
    """Three AdamW steps of the test model: int8 forward and backward matmuls give losses within
    1e-3 of float and gradients within 5% (int8 rounding of each operand, ~0.5% rms, through the
    two layers' matmuls and the backward's requantized gradients)."""
    from tests.helpers import run

    l0, g0, losses0, _ = run(small_config(mesh), 3)
    l1, g1, losses1, _ = run(small_config(mesh, quant_train="int8", quant_impl="reference"), 3)
    np.testing.assert_allclose(losses1, losses0, atol=1e-3)
    for name in set(quant.CONTRACTED) & set(g0["layers"]):
        a, b = g0["layers"][name], g1["layers"][name]
        assert 0 < np.linalg.norm(a - b) / np.linalg.norm(a) < 0.05, name
