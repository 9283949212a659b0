"""GaLore (jaxsys/optim/galore.py, config.train.optimizer='galore'): the update against a NumPy
reference of the algorithm, full rank == AdamW, layout invariance of a training run (and with offloaded
parameters), the state's bytes == the formula, the added collectives == the formula, bitwise
resume from a checkpoint, and the errors for bad input.

The model is tests/helpers.small_config (D=64, L=2, fp32). GaLore there runs at rank 4 with a
refresh every 2 steps (`_galore`), so that three or four steps cross a refresh of the projection.
"""

import json
import math
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import train
from jaxsys.checkpoint import Checkpointer
from jaxsys.config import ConfigError, validate
from jaxsys.models.params import ParamSpec
from jaxsys.optim import galore
from jaxsys.parallel import offload
from tests.helpers import assert_same_run, collectives_added, crash_then_resume, program_for, run, small_config

LAYOUT = dict(data=2, fsdp=2, tensor=2)


def _with_galore(c, rank=4, update_every=2):
    c.train.optimizer = "galore"
    c.train.galore.rank, c.train.galore.update_every = rank, update_every
    return c


def _galore(mesh=None, rank=4, update_every=2, **model):
    return _with_galore(small_config(mesh, **model), rank, update_every)


# ----------------------------------------------------------------------------- NumPy reference


def _signed(v):
    """The sign convention of jaxsys.optim.galore: each column's entry of largest magnitude positive."""
    idx = np.argmax(np.abs(v), axis=0)
    return v * np.sign(v[idx, np.arange(v.shape[1])])


def reference(grads, rank, update_every, b1, b2, eps, scale):
    """GaLore's Adam on one m x n matrix, in float64, from the paper's Algorithm 2: every
    `update_every` steps (step 0 included) P = U[:, :r] (m <= n) or Q = V[:, :r] (m > n) from the
    SVD of that step's gradient; R = P^T G or G Q; Adam with bias correction on R, the moments kept
    across refreshes; the update alpha P N or alpha N Q^T. Returns the update of every step."""
    m, n = grads[0].shape
    left = m <= n
    mu = nu = 0.0
    out = []
    for t, g in enumerate(grads):
        g = g.astype(np.float64)
        if t % update_every == 0:
            u, _, vt = np.linalg.svd(g, full_matrices=False)
            proj = _signed(u[:, :rank] if left else vt[:rank].T)
        r = proj.T @ g if left else g @ proj
        mu = b1 * mu + (1 - b1) * r
        nu = b2 * nu + (1 - b2) * r * r
        norm = (mu / (1 - b1 ** (t + 1))) / (np.sqrt(nu / (1 - b2 ** (t + 1))) + eps)
        out.append(scale * (proj @ norm if left else norm @ proj.T))
    return out


def _as_matrix(x, plan):
    """A leaf [*batch, ..., m (embed), ...] -> [b, m, n] as GaLore sees it."""
    x = np.transpose(x, (*plan.batch_dims, plan.row_dim, *plan.col_dims))
    return x.reshape(-1, plan.m, plan.n)


def test_update_equals_a_numpy_reference_of_the_algorithm():
    """Left (m <= n), right (m > n), a layer-stacked 4-D leaf (2 matrices of 8 x 12) and a leaf
    left to Adam, over 7 steps with refreshes at steps 0, 3 and 6.

    Tolerance: jaxsys runs in float32 (SVD, projections, Adam), the reference in float64. The top-r
    subspace of G moves by about eps32 * s_1 / (s_r - s_r+1) under float32 rounding (eps32 = 1.2e-7);
    these Gaussian matrices have s_1 / (s_r - s_r+1) < 60 (asserted), so P, R and the normalised
    update agree to ~1e-5 relative; Adam's normalisation keeps |update| <= alpha * O(1) = 0.25 * O(1)
    here. The measured worst error is 1.5e-6 absolute; the bound asserted is 2e-5."""
    specs = {
        "left": ParamSpec((6, 10), ("embed", "mlp")),
        "right": ParamSpec((12, 5), ("embed", "mlp")),
        "stack": ParamSpec((2, 8, 3, 4), ("layers", "embed", "heads", "head_dim")),
        "norm": ParamSpec((6,), ("embed",), decay=False),
    }
    g = types.SimpleNamespace(rank=3, leaves="left,right,stack")
    plans = galore.plan(g, specs)
    assert [plans[k].side for k in ("left", "right", "stack", "norm")] == ["left", "right", "left", "adam"]
    b1, b2, eps, scale, every, steps = 0.9, 0.95, 1e-8, 0.25, 3, 7
    tx = galore.scale_by_galore_adam(plans, b1=b1, b2=b2, eps=eps, scale=scale, update_every=every)
    rng = np.random.default_rng(0)
    grads = [{k: rng.standard_normal(s.shape).astype(np.float32) for k, s in specs.items()} for _ in range(steps)]
    state = tx.init(jax.tree.map(lambda s: jnp.zeros(s.shape), specs, is_leaf=lambda x: isinstance(x, ParamSpec)))
    update = jax.jit(tx.update)
    got = []
    for gr in grads:
        u, state = update(gr, state)
        got.append(jax.tree.map(np.asarray, u))
    for name in ("left", "right", "stack"):
        pl = plans[name]
        mats = [_as_matrix(gr[name], pl) for gr in grads]
        for b in range(mats[0].shape[0]):
            for mat in mats[::every]:  # the gradients the projections come from
                s = np.linalg.svd(mat[b].astype(np.float64), compute_uv=False)
                assert s[0] / (s[pl.rank - 1] - s[pl.rank]) < 60, (name, s)
            want = reference([mat[b] for mat in mats], pl.rank, every, b1, b2, eps, scale)
            for t in range(steps):
                np.testing.assert_allclose(
                    _as_matrix(got[t][name], pl)[b], want[t], rtol=0, atol=2e-5, err_msg=f"{name}[{b}] step {t}"
                )
    # the leaf left to Adam: optax.scale_by_adam's update, unscaled
    mu = nu = 0.0
    for t, gr in enumerate(grads):
        x = gr["norm"].astype(np.float64)
        mu, nu = b1 * mu + (1 - b1) * x, b2 * nu + (1 - b2) * x * x
        want = (mu / (1 - b1 ** (t + 1))) / (np.sqrt(nu / (1 - b2 ** (t + 1))) + eps)
        np.testing.assert_allclose(got[t]["norm"], want, rtol=1e-5, atol=1e-6)
    # the moments live in the projected space: [r, n] (left), [m, r] (right)
    assert state.adam.mu["left"].shape == (3, 10) and state.adam.mu["right"].shape == (12, 3)
    assert state.adam.mu["stack"].shape == (2, 3, 3, 4) and state.proj["stack"].shape == (2, 8, 3)


def test_refresh_changes_the_projection_only_every_k_steps():
    specs = {"w": ParamSpec((6, 10), ("embed", "mlp"))}
    tx = galore.scale_by_galore_adam(galore.plan(types.SimpleNamespace(rank=2, leaves="w"), specs), update_every=3)
    state = tx.init({"w": jnp.zeros((6, 10))})
    rng = np.random.default_rng(1)
    projections = []
    for _ in range(6):
        _, state = jax.jit(tx.update)({"w": jnp.asarray(rng.standard_normal((6, 10)), jnp.float32)}, state)
        projections.append(np.asarray(state.proj["w"]))
    same = [np.array_equal(projections[i], projections[i - 1]) for i in range(1, 6)]
    assert same == [True, True, False, True, True]  # refreshed at steps 0 and 3


# ----------------------------------------------------------------------------- full rank == AdamW


def test_full_rank_with_scale_one_is_adamw():
    """rank == min(m, n) of every chosen leaf and alpha = 1: the identity basis, so the run is
    optax.adamw's, bit for bit, through jaxsys's make_optimizer and train step. The test model's
    min(m, n) is 64 for wq, wo, w_gate, w_up, w_down and 32 (= K H) for wk, wv: two runs cover them."""
    _, _, want_losses, want = run(small_config(), steps=3)
    for leaves, rank in (("wq,wo,w_gate,w_up,w_down", 64), ("wk,wv", 32)):
        c = _galore(rank=rank)
        c.train.galore.leaves, c.train.galore.scale = leaves, 1.0
        plans = galore.plan(c.train.galore, program_for(c).specs)
        assert {p.side for p in jax.tree.leaves(plans, is_leaf=lambda x: isinstance(x, galore.LeafPlan))} == {
            "adam",
            "full",
        }
        _, _, losses, state = run(c, steps=3)
        np.testing.assert_array_equal(losses, want_losses)
        chex.assert_trees_all_equal(state.params, want.params)


# ----------------------------------------------------------------------------- layouts


_runs = {}


def _run(name, config, steps=4):
    if name not in _runs:
        _runs[name] = run(config, steps=steps)
    return _runs[name]


# assert_same_run's tolerances here: Losses and parameters of two layouts. They sum the gradient
# in different orders, so G differs by fp32 rounding (~1e-7 relative); the SVD turns that into ~1e-7
# * s_1 / gap in the basis, and Adam's normalised update lr * alpha * O(1) (3e-3 * 0.25 here) moves
# each weight by less than 1e-3 per step: parameters agree to 1e-6 absolute (measured: 6e-8), losses
# to 1e-6 relative (measured 1e-7).


@pytest.mark.parametrize("mesh", [LAYOUT, dict(data=4, fsdp=2)])
def test_sharded_run_equals_one_device(mesh):
    """4 steps crossing the refresh at step 2 give the one-device losses and parameters, at ZeRO-1.
    data2 x fsdp2 x tensor2: the projections' rows split over fsdp, wk/wv's columns over tensor,
    the layers over data; R reduce-scattered along r (rank 4 over 2 devices). data4 x fsdp2: the
    rows over (fsdp, data) for wq, w_gate, w_up, where rank 4 does not divide over 8 devices, so R
    is all-reduced and the moments replicated; wo and w_down reduce-scatter over fsdp."""
    want = _run("one_device", _galore())
    c = _galore(mesh)
    c.train.zero_stage = 1
    assert_same_run(want, run(c, steps=4), str(mesh))
    assert want[2][-1] < want[2][0]


@pytest.mark.slow
def test_pipeline_run_equals_one_device():
    """pipe2 x data2 x tensor2 (1F1B, 4 micro-batches; the layers' projections split over pipe)."""
    from tests.helpers import pipeline_config

    cfg = lambda mesh: _with_galore(pipeline_config(mesh))
    assert_same_run(run(cfg({}), steps=3), run(cfg(dict(pipe=2, data=2, tensor=2)), steps=3), "pipeline")


def test_offloaded_parameters_give_the_same_run():
    """config.offload.params with GaLore (device update): the same arithmetic, bit for bit."""
    want = _run("one_device", _galore())
    c = _galore()
    c.offload.params = True
    got = run(c, steps=4)
    np.testing.assert_array_equal(got[2], want[2])
    chex.assert_trees_all_equal(got[3].params, want[3].params)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(got[3].params)} == {offload.HOST}


# ----------------------------------------------------------------------------- memory


def _nbytes(tree, per_device=False):
    if per_device:
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


COUNTS = 8  # two int32 step counts: GaLore's Adam and the learning-rate schedule's


@pytest.mark.parametrize(
    "mesh, zero_stage", [({}, 0), (LAYOUT, 1), (dict(data=4, tensor=2), 2), (dict(data=4, fsdp=2), 1)]
)
def test_state_bytes_equal_the_formula(mesh, zero_stage):
    """Measured: the optimizer state of an initialised program (global) and the shards of its
    abstract state (per device). Formula: galore.state_bytes, m r + 2 r n (left) or n r + 2 m r
    (right) per projected matrix and 2 m n for Adam's leaves, plus the two step counts."""
    from jaxsys.analysis import cost_model

    c = _galore(mesh)
    c.train.zero_stage = zero_stage
    program = program_for(c)
    plans = galore.plan(c.train.galore, program.specs, program.grad_pspecs, program.layout.mesh_sizes)
    state = program.init()
    assert _nbytes(state.opt_state) == galore.state_bytes(plans) + COUNTS
    sizes = dict(program.layout.mesh_sizes)
    abstract = program.abstract_state()
    assert _nbytes(abstract.opt_state, per_device=True) == galore.state_bytes(plans, 4, sizes) + COUNTS
    assert cost_model.zero_memory(c)["optimizer"] == galore.state_bytes(plans, 4, sizes)
    # by hand for the test model (D=64, L=2, N=8, K=2, H=16, F=128, V=256), rank 4, one device
    if not mesh:
        r, d, f, kh, nh = 4, 64, 128, 32, 128
        projected = 2 * (
            2 * (d * r + 2 * r * nh)  # wq, wo: 64 x 128, left
            + 2 * (kh * r + 2 * d * r)  # wk, wv: 64 x 32, right
            + 3 * (d * r + 2 * r * f)
        )  # w_gate, w_up, w_down: 64 x 128, left
        adam = 2 * (2 * 256 * d + d + 2 * 2 * d)  # embed, unembed, final norm, 2 x 2 layer norms
        assert galore.state_bytes(plans) == 4 * (projected + adam)
        adamw = program_for(small_config()).init().opt_state
        assert galore.state_bytes(plans) < _nbytes(adamw) - COUNTS


@pytest.mark.parametrize("mesh, zero_stage", [(LAYOUT, 1), (dict(data=4, tensor=2), 1), (dict(data=4, fsdp=2), 1)])
def test_collectives_equal_the_formula(mesh, zero_stage):
    """What GaLore adds to the step's program (the GaLore step's collectives less AdamW's, by kind
    and mesh axes) equals cost_model.galore_rows in count and bytes: the projection's
    reduce-scatter (or all-reduce) over the contracted side's axes, the all-gather of N back, and
    the refresh's all-gathers of G (docs/galore.md). With data=4 ZeRO-1 slices the embed rows over
    `data` (L=2 does not divide by 4), so the projections are summed over `data` (or (fsdp, data))
    and some refresh gathers run over (tensor, data)."""
    from jaxsys.analysis import cost_model, report

    adamw, config = small_config(mesh), _galore(mesh)
    adamw.train.zero_stage = config.train.zero_stage = zero_stage
    added = collectives_added(adamw, config)
    formula = report.by_kind_axes(
        [dict(kind=r.kind, axes=r.axes, count=r.count, bytes=r.bytes) for r in cost_model.galore_rows(config)]
    )
    assert added == {k: tuple(v) for k, v in formula.items()}
    assert {k[0] for k in added} >= {"reduce_scatter", "all_gather"}


# ----------------------------------------------------------------------------- checkpoints


def _losses(workdir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(workdir / "metrics.jsonl"))}


@pytest.mark.slow  # CI time; tests/test_muon.py keeps a bitwise resume of a matrix optimizer
def test_resume_across_a_refresh_is_bitwise(tmp_path, monkeypatch):
    """Checkpoint at step 3 (projections from step 2's refresh, moments in their space), crash,
    resume: steps 4-5, which cross the refresh at step 4, give the uninterrupted run's losses; the
    checkpoint restores onto one device with the same values."""

    def config():
        c = _galore(LAYOUT)
        c.train.steps, c.checkpoint.every_steps, c.train.log_every = 5, 3, 1
        return c

    train.main(config(), str(tmp_path / "full"))
    records = crash_then_resume(monkeypatch, config, str(tmp_path / "resumed"))
    assert [r["step"] for r in records] == [4, 5]
    full, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "resumed")
    for step in range(1, 6):
        assert resumed[step] == full[step], step
    # the GaLore state (sharded projections and moments) onto another mesh: the same values
    saved = Checkpointer(str(tmp_path / "full"), config().checkpoint)
    on_layout = saved.restore(program_for(config()).abstract_state())
    one = _galore()
    on_one = saved.restore(program_for(one).abstract_state())
    assert galore.is_state(on_one.opt_state[0]) and on_one.opt_state[0].proj
    chex.assert_trees_all_equal(on_layout, on_one)


# ----------------------------------------------------------------------------- bad input


def test_rank_above_a_matrix_dimension_names_the_leaf():
    c = _galore(rank=33)  # wk, wv are 64 x 32 (D x K H)
    with pytest.raises(ConfigError, match=r"rank=33 is larger than min\(m, n\) = 32 of the leaf layers/wk"):
        program_for(c)
    c.train.galore.leaves = "wq,wo"
    program_for(c)  # 64 x 128: rank 33 fits


def test_unknown_or_unfit_leaf_is_named():
    c = _galore()
    c.train.galore.leaves = "wq,w_qkv"
    with pytest.raises(ConfigError, match=r"names \['w_qkv'\], which this model does not have; its leaves are"):
        program_for(c)
    c.train.galore.leaves = "wq,embed"  # [vocab, embed]: projectable (rows = embed)
    program_for(c)
    c.train.galore.leaves = "attn_norm"  # [layers, embed]: no columns
    with pytest.raises(ConfigError, match="attn_norm"):
        program_for(c)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.galore.rank", 0, "positive integer"),
        ("train.galore.update_every", 0, "positive integer"),
        ("train.galore.scale", 0.0, "must be a number > 0"),
        ("train.galore.leaves", " ", "leaves empty"),
        ("offload.optimizer", True, "offload.optimizer=False"),
    ],
)
def test_bad_config_is_named(key, value, message):
    c = _galore()
    section, *rest = key.split(".")
    node = c[section]
    for k in rest[:-1]:
        node = node[k]
    node[rest[-1]] = value
    with pytest.raises(ConfigError, match=message):
        validate(c)


def test_expert_rebalancing_is_refused():
    c = _galore(mlp_pattern="moe")
    c.parallel.expert_rebalance_every = 10
    with pytest.raises(ConfigError, match="expert_rebalance_every=0"):
        validate(c)
