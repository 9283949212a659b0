"""Muon (jaxsys/optim/muon.py, config.train.optimizer='muon'): Newton-Schulz against the SVD, the
update against optax.contrib's Muon (an independent implementation) on one device, no leaf chosen
== AdamW bit for bit, layout invariance of a training run (data x fsdp x tensor with ZeRO,
pipeline, experts), bitwise resume from a checkpoint onto another mesh, and the errors for bad
input. The model is tests/helpers.small_config (D=64, L=2, fp32)."""

import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib

from jaxsys import train
from jaxsys.checkpoint import Checkpointer
from jaxsys.config import ConfigError, validate
from jaxsys.optim import galore, muon
from jaxsys.optim import optimizer as optimizer_lib
from tests.helpers import assert_same_run, collectives_added, crash_then_resume, program_for, run, small_config

LAYOUT = dict(data=2, fsdp=2, tensor=2)


def _muon(mesh=None, **model):
    c = small_config(mesh, **model)
    c.train.optimizer = "muon"
    return c


def test_newton_schulz_gives_the_orthogonal_factor():
    """For wide and tall matrices, NS's singular vectors are the SVD's and its singular values lie
    in Keller Jordan's band (~[0.7, 1.2]: the quintic trades exactness for speed), not at s / |s|_F."""
    rng = np.random.default_rng(0)
    for shape in ((3, 16, 40), (2, 48, 12)):
        x = rng.normal(size=shape).astype(np.float32)
        o = np.asarray(muon.newton_schulz(jnp.asarray(x)))
        for xi, oi in zip(x, o):
            u, _, vt = np.linalg.svd(xi.astype(np.float64), full_matrices=False)
            s = np.linalg.svd(oi.astype(np.float64), compute_uv=False)
            assert 0.6 < s.min() and s.max() < 1.25, s
            # O = U diag(s') V^T in x's own singular basis: off-diagonal terms vanish
            inner = u.T @ oi @ vt.T
            np.testing.assert_allclose(inner - np.diag(np.diag(inner)), 0.0, atol=1e-4)


def _optax_reference(c, specs):
    """optax.contrib's Muon pieces (scale_by_muon with the leaves' dimension numbers, scale_by_shape)
    for the chosen leaves, Adam for the rest, then AdamW's weight decay and learning rate: the
    same algorithm written independently of jaxsys's sharded one."""
    t = c.train
    plans = muon.plan(t.muon, specs)
    is_plan = lambda x: isinstance(x, galore.LeafPlan)

    def dims(pl):
        if pl.side != "full":
            return None
        first = min(d for d in range(len(pl.shape)) if d not in pl.batch_dims)
        rows, cols = (pl.row_dim,), tuple(pl.col_dims)
        reduction, output = (rows, cols) if pl.row_dim == first else (cols, rows)
        return contrib.MuonDimensionNumbers(reduction_axis=reduction, output_axis=output)

    dim_nums = jax.tree.map(dims, plans, is_leaf=is_plan)
    labels = jax.tree.map(lambda pl: "muon" if pl.side == "full" else "adam", plans, is_leaf=is_plan)
    muon_tree = jax.tree.map(
        lambda lab, d: d if lab == "muon" else optax.MaskedNode(),
        labels,
        dim_nums,
        is_leaf=lambda x: x is None or isinstance(x, contrib.MuonDimensionNumbers),
    )
    rms = t.muon.consistent_rms or None
    muon_tx = optax.chain(
        contrib.scale_by_muon(beta=t.muon.beta, nesterov=t.muon.nesterov, weight_dimension_numbers=muon_tree),
        contrib._muon.scale_by_shape(weight_dimension_numbers=muon_tree, consistent_rms=rms),
    )
    mask = jax.tree.map(lambda s: s.decay, specs, is_leaf=lambda x: hasattr(x, "decay"))
    return optax.chain(
        optax.multi_transform({"muon": muon_tx, "adam": optax.scale_by_adam(b1=t.b1, b2=t.b2, eps=t.eps)}, labels),
        optax.add_decayed_weights(t.weight_decay, mask),
        optax.scale_by_learning_rate(optimizer_lib.schedule(t)),
    )


@pytest.mark.parametrize("consistent_rms,nesterov", [(0.2, True), (0.0, False)])
def test_update_equals_optax_contrib_muon(consistent_rms, nesterov):
    """Three updates of every leaf from jaxsys's make_optimizer (unsharded) equal optax.contrib's
    Muon built from its own pieces: Moonlight's RMS scaling with Nesterov, and Keller Jordan's
    width scaling (fan_out / fan_in from which side of the matrix is the input) without."""
    c = _muon()
    c.train.muon.consistent_rms, c.train.muon.nesterov = consistent_rms, nesterov
    program = program_for(c)
    specs, params = program.specs, jax.tree.map(np.asarray, program.init(0).params)
    ours = optimizer_lib.make_optimizer(c.train, specs)
    theirs = _optax_reference(c, specs)
    rng = np.random.default_rng(1)
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    for _ in range(3):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape).astype(np.float32)), params)
        u_ours, s_ours = jax.jit(ours.update)(grads, s_ours, params)
        u_theirs, s_theirs = jax.jit(theirs.update)(grads, s_theirs, params)
        # fp32 NS in both (optax's at default precision, exact fp32 on CPU): 5 polynomial steps of
        # O(1) entries, rounding ~1e-6 of the update's largest entry (seen: 1.2e-6)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(u_ours), jax.tree.leaves(u_theirs)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()), err_msg=str(path))
    # the Muon leaves' updates are not Adam's: the check is not vacuous
    adam = optax.adamw(optimizer_lib.schedule(c.train), weight_decay=c.train.weight_decay)
    u_adam, _ = adam.update(grads, adam.init(params), params)
    assert np.abs(np.asarray(u_ours["layers"]["wq"]) - np.asarray(u_adam["layers"]["wq"])).max() > 1e-4


def test_width_scaling_reads_each_matrix_input_side():
    """consistent_rms=0: sqrt(max(1, fan_out / fan_in)) with jaxsys's [in, out] layouts: w_gate
    [D, F] fans out (D=64 -> F=128: sqrt 2), w_down [F, D] fans in (1)."""
    c = _muon()
    plans = muon.plan(c.train.muon, program_for(c).specs)["layers"]
    assert (plans["w_gate"].m, plans["w_gate"].n, plans["w_down"].m, plans["w_down"].n) == (64, 128, 64, 128)
    assert muon.shape_scale(plans["w_gate"], 0.0) == pytest.approx(2**0.5)
    assert muon.shape_scale(plans["w_down"], 0.0) == 1.0
    assert muon.shape_scale(plans["w_down"], 0.2) == pytest.approx(0.2 * 128**0.5)


def test_no_leaf_chosen_is_adamw():
    """With no leaf named, every leaf takes the Adam partition: the run is AdamW's bit for bit."""
    _, _, want_losses, want = run(small_config(), steps=3)
    c = _muon()
    c.train.muon.leaves = ""
    _, _, losses, state = run(c, steps=3)
    np.testing.assert_array_equal(losses, want_losses)
    chex.assert_trees_all_equal(state.params, want.params)


_runs = {}


def _run(name, config, steps=3):
    if name not in _runs:
        _runs[name] = run(config, steps=steps)
    return _runs[name]


# assert_same_run's tolerances here: their gradients differ
# by fp32 summation order (~1e-7 relative), NS maps that to ~1e-7 in O, and each step moves a weight
# by lr * 0.2 * sqrt(max(m, n)) * O(1/sqrt(mn)): parameters agree to 1e-6 (measured 1.5e-7), losses
# to 1e-6.


@pytest.mark.parametrize(
    "mesh,zero_stage,layers",
    [
        (LAYOUT, 1, 2),
        pytest.param(dict(data=4, fsdp=2), 2, 2, marks=pytest.mark.slow),
        pytest.param(LAYOUT, 1, 4, marks=pytest.mark.slow),
        (dict(fsdp=2, tensor=2), 0, 4),
    ],
)
def test_sharded_run_equals_one_device(mesh, zero_stage, layers):
    """The momentum stays sharded like the gradients (ZeRO, FSDP, tensor). Where a device's
    layers do not divide by the group sharing its matrices (2 layers on groups of 4 or 8; 4 layers
    split over data 2 by ZeRO-1, 2 a device, on fsdp x tensor groups of 4) each device all-gathers
    the whole matrices, orthogonalizes all and keeps its block; with 4 layers on fsdp 2 x tensor 2
    the all-to-alls hand each device whole matrices of one layer. Either way: the one-device run's
    losses and parameters, and the loss falls."""
    want = _run(f"one_device_{layers}", _muon(n_layers=layers))
    c = _muon(mesh, n_layers=layers)
    c.train.zero_stage = zero_stage
    assert_same_run(want, run(c, steps=3), str(mesh))
    assert want[2][-1] < want[2][0]


def _step_flops_and_all_to_alls(c):
    program = program_for(c)
    batch = jax.ShapeDtypeStruct((c.train.batch_size, c.data.seq_len + 1), "int32")
    compiled = program.train_step_fn().lower(program.abstract_state(), batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"]), compiled.as_text().count("all-to-all(")


@pytest.mark.parametrize("layers,spread", [(4, True), (2, False)])
def test_each_device_orthogonalizes_its_share(layers, spread):
    """On fsdp 2 x tensor 2 (groups of G = 4 devices share each matrix), the compiled step's
    per-device FLOPs beyond AdamW's are the Newton-Schulz formula / G when the layers divide by G
    (all-to-alls, no redundant NS), and the whole formula on every device otherwise (no all-to-all).
    Within 10%: XLA also counts the elementwise work (momentum, norms, scaling)."""
    mesh = dict(fsdp=2, tensor=2)
    adamw = small_config(mesh, n_layers=layers)
    flops_adamw, _ = _step_flops_and_all_to_alls(adamw)
    flops_muon, all_to_alls = _step_flops_and_all_to_alls(_muon(mesh, n_layers=layers))
    c = _muon(mesh, n_layers=layers)
    formula = sum(
        math.prod(pl.shape[d] for d in pl.batch_dims)
        * 5
        * (4 * min(pl.m, pl.n) ** 2 * max(pl.m, pl.n) + 2 * min(pl.m, pl.n) ** 3)
        for pl in jax.tree.leaves(
            muon.plan(c.train.muon, program_for(c).specs), is_leaf=lambda x: isinstance(x, galore.LeafPlan)
        )
        if pl.side == "full"
    )
    share = formula / 4 if spread else formula
    assert share <= flops_muon - flops_adamw <= 1.1 * share, (flops_muon - flops_adamw, share)
    assert (all_to_alls > 0) == spread


@pytest.mark.slow
def test_pipeline_and_experts_equal_one_device():
    """pipe 2 x data 2 (each stage orthogonalizes its own layers' matrices) and an MoE model on
    expert 2 x data 2 (each expert shard its experts' matrices; the router on Adam)."""
    from tests.helpers import pipeline_config

    one, two = pipeline_config({}), pipeline_config(dict(pipe=2, data=2))
    one.train.optimizer = two.train.optimizer = "muon"
    assert_same_run(run(one, steps=2), run(two, steps=2), "pipeline")
    moe = lambda mesh: _muon(mesh, mlp_pattern="moe")
    assert_same_run(run(moe({}), steps=2), run(moe(dict(expert=2, data=2)), steps=2), "experts")


def _losses(workdir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(workdir / "metrics.jsonl"))}


@pytest.mark.slow  # CI time: resume is tested bitwise for AdamW in tests/test_checkpoint.py
def test_resume_is_bitwise_and_restores_onto_one_device(tmp_path, monkeypatch):
    """Checkpoint at step 2, crash, resume: steps 3-4 give the uninterrupted run's losses; the
    momentum (masked partitions) restores onto one device with the same values."""

    def config():
        c = _muon(LAYOUT)
        c.train.steps, c.checkpoint.every_steps, c.train.log_every = 4, 2, 1
        return c

    train.main(config(), str(tmp_path / "full"))
    records = crash_then_resume(monkeypatch, config, str(tmp_path / "resumed"), crash_step=2)
    assert [r["step"] for r in records] == [3, 4]
    full, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "resumed")
    for step in range(1, 5):
        assert resumed[step] == full[step], step
    saved = Checkpointer(str(tmp_path / "full"), config().checkpoint)
    on_layout = saved.restore(program_for(config()).abstract_state())
    on_one = saved.restore(program_for(_muon()).abstract_state())
    chex.assert_trees_all_equal(on_layout, on_one)
    momentum = on_one.opt_state[0].inner_states["muon"].inner_state.mu["layers"]["wq"]
    assert np.abs(np.asarray(momentum)).max() > 0


def test_unknown_or_unfit_leaf_is_named():
    c = _muon()
    c.train.muon.leaves = "wq,w_qkv"
    with pytest.raises(ConfigError, match=r"config.train.muon.leaves names \['w_qkv'\], which this model does not"):
        program_for(c)
    c.train.muon.leaves = "attn_norm"  # [layers, embed]: no columns
    with pytest.raises(ConfigError, match="config.train.muon.leaves names 'attn_norm'"):
        program_for(c)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.muon.beta", 1.0, r"beta=1.0 must be in \[0, 1\)"),
        ("train.muon.ns_steps", 0, "positive integer"),
        ("train.muon.consistent_rms", -0.2, "must be >= 0"),
        ("offload.optimizer", True, "offload.optimizer=False"),
        ("parallel.expert_rebalance_every", 10, "expert_rebalance_every=0"),
    ],
)
def test_bad_config_is_named(key, value, message):
    c = _muon(mlp_pattern="moe")
    section, *rest = key.split(".")
    node = c[section]
    for k in rest[:-1]:
        node = node[k]
    node[rest[-1]] = value
    with pytest.raises(ConfigError, match=message):
        validate(c)


# ----------------------------------------------------------------------------- the analysis' formulas


@pytest.mark.parametrize("mesh,zero_stage,layers", [(LAYOUT, 1, 2), (dict(fsdp=2, tensor=2), 0, 4)])
def test_state_bytes_and_collectives_equal_the_formula(mesh, zero_stage, layers):
    """Per device: the optimizer state's shards equal cost_model.zero_memory (Muon's momentum of
    the seven matrices, Adam's two moments of the rest) plus three int32 counts; what Muon adds to
    the program's collectives (Muon's step less AdamW's, by kind and axes) equals
    cost_model.muon_rows in count and bytes: all-gathers on data 2 x fsdp 2 x tensor 2 with ZeRO-1
    and 2 layers (groups of 4 and 8 do not divide them), all-to-alls there and back on fsdp 2 x
    tensor 2 with 4 layers."""
    from jaxsys.analysis import cost_model, report

    c = _muon(mesh, n_layers=layers)
    c.train.zero_stage = zero_stage
    abstract = program_for(c).abstract_state()
    per_device = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(abstract.opt_state)
    )
    assert per_device == cost_model.zero_memory(c)["optimizer"] + 12
    adamw = small_config(mesh, n_layers=layers)
    adamw.train.zero_stage = zero_stage
    added = collectives_added(adamw, c)
    formula = report.by_kind_axes(
        [dict(kind=r.kind, axes=r.axes, count=r.count, bytes=r.bytes) for r in cost_model.muon_rows(c)]
    )
    assert added == {k: tuple(v) for k, v in formula.items()}
    assert {k[0] for k in added} == ({"all_to_all"} if layers == 4 else {"all_gather"})
