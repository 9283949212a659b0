"""Zeroth-order training (jaxsys/optim/zo.py, config.train.optimizer='zo'): the estimate, the regenerated
perturbation, layout and offload invariance, the update against NumPy, and config.checkpoint.init_from.

The model is tests/helpers.small_config (D=64, L=2, fp32, 120K parameters), with eps = 1e-3
(config.train.zo.eps's default, MeZO's value).
"""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxsys import convert, data, train
from jaxsys.checkpoint import Checkpointer, CheckpointError, restore_params
from jaxsys.config import ConfigError, validate
from jaxsys.optim import zo
from tests.helpers import ROOT, assert_trees_close_leafwise, program_for, small_config

LAYOUT = dict(data=2, fsdp=2, tensor=2)
ULP_LOSS = float(np.spacing(np.float32(5.6)))  # one ulp of an fp32 loss near ln(256)


def _zo_config(mesh=None, **train_keys):
    c = small_config(mesh)
    c.train.optimizer = "zo"
    for key, value in train_keys.items():
        c.train[key] = value
    return c


def _batch(program, step=0):
    c = program.config
    return data.global_batch(
        data.load_corpus(c.data), program.batch_sharding, c.seed, step, c.train.batch_size, c.data.seq_len
    )


def _estimate_fn(program, key):
    """(params, tokens) -> (g, metrics at theta + eps z, metrics at theta - eps z), jitted."""
    return jax.jit(
        program._shard_map(
            lambda p, t: zo.projected_gradient(program, p, t, key), (program.param_pspecs, program.batch_pspec), P()
        )
    )


def _dot(a, b) -> float:
    return sum(float(jnp.vdot(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ----------------------------------------------------------------------------- the estimate


def test_estimate_is_the_central_difference_and_tends_to_the_directional_derivative():
    """(l+ - l-) / (2 eps) against the directional derivative d = <grad L, z>.

    d comes from jax.grad of the first-order program: jax.jvp cannot pass jaxsys's collectives,
    which are custom_vjp functions (parallel/collectives.py), and <grad L, z> is the same linear
    functional evaluated in reverse mode.

    l+ and l- must be exactly the losses of theta + eps z and theta - eps z built outside (z from
    `perturbation_tree`): the hook adds the same fp32 values to the same weights, so they agree to
    rounding of the loss (1e-6; bitwise here). The estimate's error is then the central
    difference's, (eps^2 / 6) D3[z, z, z] + O(eps^4), plus the loss's rounding divided by 2 eps
    (a few ulp of L: 8 ulp / 2 eps = 2e-3 at eps = 1e-3). Halving eps must divide the error by
    about 4 (allowed: 4 / 1.5, for the O(eps^4) term), and at eps = 1e-3 it is < 0.3% of d
    (seen: 0.16%; with 120K parameters, eps z moves theta by eps sqrt(N) = 0.35 in norm, so the
    eps^2 term is not small).
    """
    program = program_for(_zo_config())
    first_order = program_for(small_config())
    params, batch = program.init().params, _batch(program)
    key = zo.step_key(program.config.seed, 0)
    z = zo.perturbation_tree(program.specs, key)
    d = _dot(first_order.loss_and_grads_fn()(params, batch)[1], z)
    loss = program.eval_loss_fn()
    errors = {}
    for eps in (2e-3, 1e-3):
        program.config.train.zo.eps = eps
        g, plus, minus = _estimate_fn(program, key)(params, batch)
        for sign, metrics in ((1, plus), (-1, minus)):
            moved = jax.tree.map(lambda w, v: w + sign * eps * v, params, z)
            np.testing.assert_allclose(float(metrics["loss"]), float(loss(moved, batch)), rtol=1e-6)
        errors[eps] = float(g) - d
    rounding = 8 * ULP_LOSS / (2 * 1e-3)
    assert abs(errors[1e-3]) <= abs(errors[2e-3]) / 4 * 1.5 + rounding, errors
    assert abs(errors[1e-3]) <= 3e-3 * abs(d), (errors, d)


# ----------------------------------------------------------------------------- the perturbation


def test_z_is_jax_random_normal_of_the_leaf_and_any_block_regenerates_exactly():
    key = zo.leaf_key(zo.step_key(3, 7), "layers/wq", 1)
    whole = jax.jit(lambda: zo.normal_block(key, (64, 8, 8)))()
    np.testing.assert_array_equal(whole, jax.random.normal(key, (64, 8, 8)))
    np.testing.assert_array_equal(whole, jax.jit(lambda: zo.normal_block(key, (64, 8, 8)))())
    block = jax.jit(lambda o: zo.normal_block(key, (64, 8, 8), (o, 4, 0), (16, 4, 8)))(jnp.int32(32))
    np.testing.assert_array_equal(block, np.asarray(whole)[32:48, 4:8])
    assert abs(float(jnp.mean(whole))) < 0.1 and abs(float(jnp.std(whole)) - 1) < 0.05
    # another step, leaf or layer draws another z
    for other in (
        zo.leaf_key(zo.step_key(3, 8), "layers/wq", 1),
        zo.leaf_key(zo.step_key(3, 7), "layers/wk", 1),
        zo.leaf_key(zo.step_key(3, 7), "layers/wq", 0),
    ):
        assert not np.array_equal(whole, jax.random.normal(other, (64, 8, 8)))


def test_shards_on_data2_fsdp2_tensor2_assemble_to_the_one_device_z():
    """Each device generates only its block, at its global offsets, in the forward's hook and in the
    update; assembled they are the one-device z bit for bit."""
    program = program_for(_zo_config(LAYOUT, weight_decay=0.0))
    key = zo.step_key(program.config.seed, 5)
    want = zo.perturbation_tree(program.specs, key)
    zeros = jax.tree.map(jnp.zeros_like, program.init().params)
    hook = zo.perturbation(program, key, 1.0)

    def from_hook(params):  # every leaf read as the model reads it: layer by layer inside a scan
        out = {k: hook(k, params[k], None) for k in params if k != "layers"}
        out["layers"] = {
            k: jax.lax.map(lambda a: hook(f"layers/{k}", a[0], a[1]), (v, jnp.arange(v.shape[0], dtype=jnp.int32)))
            for k, v in params["layers"].items()
        }
        return out

    def from_update(params):  # theta - 1 * (-1 * z) = z exactly
        return zo.update(program, params, key, jnp.float32(-1.0), jnp.float32(1.0))

    for local in (from_hook, from_update):
        got = jax.jit(program._shard_map(local, (program.param_pspecs,), program.param_pspecs))(zeros)
        chex.assert_trees_all_equal(got, want)


# ----------------------------------------------------------------------------- steps


def _run(config, steps=3):
    program = program_for(config)
    state, step = program.init(), program.train_step_fn()
    records = []
    for s in range(steps):
        state, metrics = step(state, _batch(program, s))
        records.append({k: float(v) for k, v in metrics.items()})
    return records, jax.tree.map(np.asarray, state.params)


_one_device = {}


def _reference():
    if not _one_device:
        _one_device["run"] = _run(_zo_config(lr=1e-3))
    return _one_device["run"]


def test_steps_on_data2_fsdp2_tensor2_equal_one_device():
    """Tolerances: the layouts sum the losses in other orders; as in test_parity a loss moves by
    < 1e-6 relative. g = (l+ - l-) / 2 eps turns that into |dg| <= 2e-6 |l| / 2 eps (5.6e-3 here;
    seen 1.2e-3), and every parameter then moves by <= sum_t lr_t |dg| max|z|."""
    want, want_params = _reference()
    got, got_params = _run(_zo_config(LAYOUT, lr=1e-3))
    loss = lambda r: [x["loss"] for x in r]
    np.testing.assert_allclose(loss(got), loss(want), rtol=1e-5)
    dg = 2e-6 * max(loss(want)) / (2 * 1e-3)
    np.testing.assert_allclose([x["projected_grad"] for x in got], [x["projected_grad"] for x in want], rtol=0, atol=dg)
    atol = sum(x["lr"] for x in want) * dg * 6.0  # |z| < 6 for 120K normal draws
    chex.assert_trees_all_close(got_params, want_params, rtol=1e-5, atol=atol)


def test_offloaded_parameters_give_the_same_steps_bitwise():
    """ZO2: parameters in host memory, each layer moved in, perturbed, and streamed through the
    update. On CPU the moves are no-ops and the arithmetic is the same, so the runs are equal."""
    want, want_params = _reference()
    c = _zo_config(lr=1e-3)
    c.offload.params = True
    got, got_params = _run(c)
    assert got == want
    chex.assert_trees_all_equal(got_params, want_params)
    program = program_for(c)
    state, _ = program.train_step_fn()(program.init(), _batch(program))
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)} == {"pinned_host"}


def test_update_equals_numpy_reference():
    """theta - lr (g z + wd theta), wd only where ParamSpec.decay. Both sides compute in fp32, but
    XLA may fuse or reorder the multiply-adds: each entry may differ by a few roundings at the
    scale of its leaf's terms (2 ulp of the leaf's largest |theta|; seen: 3.7e-9 on entries of
    5e-4 in a leaf of max 0.08)."""
    c = _zo_config(lr=2e-3, weight_decay=0.1, schedule="constant", warmup_steps=0)
    program = program_for(c)
    state = program.init()
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = program.train_step_fn()(state, _batch(program))
    g, lr = np.float32(metrics["projected_grad"]), np.float32(metrics["lr"])
    assert lr == np.float32(2e-3) and int(state.step) == 1
    assert float(metrics["grad_norm"]) == abs(float(g))
    z = jax.tree.map(np.asarray, zo.perturbation_tree(program.specs, zo.step_key(c.seed, 0)))
    decay = jax.tree.map(lambda s: s.decay, program.specs, is_leaf=lambda x: hasattr(x, "decay"))
    want = jax.tree.map(lambda w, v, d: w - lr * (g * v + (np.float32(0.1) * w if d else 0)), before, z, decay)
    assert_trees_close_leafwise(state.params, want, rtol=1e-6, atol=lambda b: 2 * np.spacing(np.abs(b).max()))
    assert jax.tree.leaves(state.opt_state) == []


def test_loss_metric_is_the_mean_of_the_two_forwards():
    records, _ = _reference()
    for r in records:
        assert r["loss"] == pytest.approx((r["loss_plus"] + r["loss_minus"]) / 2, rel=1e-7)
        assert r["grad_norm"] == abs(r["projected_grad"])
        assert r["projected_grad"] == pytest.approx((r["loss_plus"] - r["loss_minus"]) / 2e-3, rel=1e-3)


# ----------------------------------------------------------------------------- init_from


def _adamw_run(workdir, steps):
    c = small_config(dict(data=8))
    c.train.steps, c.train.eval_batches = steps, 4
    return train.main(c, str(workdir)), c


@pytest.mark.slow
def test_init_from_starts_zo_from_the_saved_parameters_and_the_loss_falls(tmp_path, capsys):
    """AdamW for 20 steps, then ZO from its parameters on the same corpus for 40 steps at lr 1e-3
    (constant): the eval loss (the same 4 held-out batches) falls (seen: 3.56 -> 3.47)."""
    records, adamw = _adamw_run(tmp_path / "adamw", 20)
    c = _zo_config(dict(data=8), steps=40, lr=1e-3, schedule="constant", warmup_steps=0, eval_batches=4)
    c.checkpoint.init_from = str(tmp_path / "adamw")
    c.checkpoint.enabled = False
    # what main does at step 0: the saved parameters, step 0, no optimizer state
    program = program_for(c)
    state = program.fresh_state(restore_params(c.checkpoint.init_from, program.abstract_state().params)[0])
    saved = Checkpointer(str(tmp_path / "adamw"), adamw.checkpoint).restore(program_for(adamw).abstract_state())
    assert int(state.step) == 0 and jax.tree.leaves(state.opt_state) == []
    chex.assert_trees_all_equal(state.params, saved.params)
    zo_records = train.main(c, str(tmp_path / "zo"))
    assert "parameters from step 20 of" in capsys.readouterr().out
    assert zo_records[0]["step"] == 1 and zo_records[0]["loss"] < 4.2  # not from scratch (5.5)
    assert zo_records[-1]["eval_loss"] < records[-1]["eval_loss"] - 0.03, (records[-1], zo_records[-1])


def test_init_from_a_converted_hf_workdir(tmp_path):
    workdir = tmp_path / "hf"
    assert (
        convert.main(
            [
                "--from-hf",
                os.path.join(ROOT, "tests", "golden", "hf_llama", "untied"),
                "--workdir",
                str(workdir),
                "--config",
                os.path.join(ROOT, "configs", "tiny.py:test"),
            ]
        )
        == 0
    )
    from jaxsys.config import load_config

    c = load_config(
        str(workdir / "config.json"),
        [
            "--config.mesh.data=2",
            "--config.mesh.fsdp=2",
            "--config.mesh.tensor=2",
            "--config.train.steps=2",
            "--config.train.optimizer=zo",
            f"--config.checkpoint.init_from={workdir}",
        ],
    )
    program = program_for(c)
    params, step = restore_params(str(workdir / "checkpoints"), program.abstract_state().params)
    converted = Checkpointer(str(workdir), c.checkpoint, read_only=True)
    c_adamw = load_config(str(workdir / "config.json"), [])
    want = converted.restore(program_for(c_adamw).abstract_state()).params
    converted.close()
    assert step == 0
    chex.assert_trees_all_equal(params, want)
    records = train.main(c, str(tmp_path / "ft"))
    assert [r["step"] for r in records] == [1, 2] and all(np.isfinite(r["loss"]) for r in records)


def test_bad_init_from_is_named(tmp_path):
    program = program_for(_zo_config())
    abstract = program.abstract_state().params
    missing = str(tmp_path / "nothere")
    with pytest.raises(CheckpointError, match=f"init_from='{missing}'.*does not exist"):
        restore_params(missing, abstract)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no checkpoints/ directory"):
        restore_params(str(tmp_path / "empty"), abstract)
    c = _zo_config(dict(data=8))
    c.checkpoint.init_from = missing
    with pytest.raises(CheckpointError, match="nothere"):
        train.main(c, str(tmp_path / "run"))
    _adamw_run(tmp_path / "other", 1)
    wider = _zo_config()
    wider.model.d_model = 32
    with pytest.raises(CheckpointError, match=r"init_from=.*other.*params/embed has shape \(256, 64\)"):
        restore_params(str(tmp_path / "other"), program_for(wider).abstract_state().params)


# ----------------------------------------------------------------------------- bad input


def test_zo_refuses_a_pipeline_and_an_offloaded_optimizer():
    c = _zo_config(dict(pipe=2, data=4))
    with pytest.raises(ConfigError, match="optimizer='zo' with config.mesh.pipe=2"):
        validate(c)
    c = _zo_config()
    c.offload.optimizer = True
    with pytest.raises(ConfigError, match="offload.optimizer=True with config.train.optimizer='zo'"):
        validate(c)


def test_zo_program_has_no_gradient_function():
    program = program_for(_zo_config())
    with pytest.raises(ConfigError, match="computes no gradients"):
        program.loss_and_grads_fn()


# ----------------------------------------------------------------------------- the analysis


@pytest.mark.parametrize("mesh", [dict(fsdp=8), dict(tensor=8), dict(data=8)], ids=["fsdp8", "tp8", "dp8"])
def test_analysis_collectives_and_bytes_equal_the_zeroth_order_formula(mesh):
    """The analysis of a ZO step: no gradient or optimizer bytes, and the collectives read from the
    program equal `cost_model.zeroth_order_rows` in count and bytes (FSDP gathers once per use in
    each of the two forwards, Megatron's all-reduces 2 x (2L + 1), the vocabulary-parallel loss's
    3 per forward; data parallelism sends nothing but the losses)."""
    from jaxsys.analysis import report

    c = _zo_config(mesh)
    c.model.n_kv_heads = 8  # tensor=8 splits the kv heads
    r = report.analyze(c, devices=jax.devices()[:8], flops=False)
    measured, formula = report.by_kind_axes(r["collectives"]), report.by_kind_axes(r["collectives_formula"])
    assert set(measured) == set(formula), (measured, formula)
    for key in formula:
        assert measured[key][0] == formula[key][0], (key, measured[key], formula[key])
        assert measured[key][1] == pytest.approx(formula[key][1], rel=1e-12), (key, measured[key], formula[key])
    m = r["memory"]
    assert m["grads_bytes"] == m["formula"]["grads"] == 0
    assert m["optimizer_bytes"] == m["formula"]["optimizer"] == 0
    assert m["params_bytes"] == m["formula"]["params"]
