"""Expert parallelism: every EP layout gives the single-device MoE loss, gradients and routing
statistics; the padded ragged all-to-all keeps `lax.ragged_all_to_all`'s contract; a re-placement
of the experts computes the same model; its collectives equal the cost model.

Tolerances as tests/test_parity.py: EP moves token copies between devices but computes each copy's
expert MLP the same way; sums over tokens (expert weight gradients) reassociate, ~1e-6 relative.
A lost, doubled or misrouted copy is off by its whole contribution.
"""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxsys import data, train
from jaxsys.analysis import report
from jaxsys.parallel import expert, expert_placement
from tests.helpers import config_file, pipeline_config, program_for

MOE_KEYS = ("experts", "top_k", "d_ff", "shared_experts", "shared_expert_gate", "router", "capacity_factor")


def moe_config(mesh=None, sp=False, pattern="moe", **moe):
    """configs/moe.py:test (D=64, L=2, T=32, B=8, 8 experts of 32 units, top-2) on `mesh`."""
    c = config_file("moe", "test")
    c.model.mlp_pattern = pattern
    for key, value in moe.items():
        c.model.moe[key] = value
    for axis, size in (mesh or {}).items():
        c.mesh[axis] = size
    c.parallel.sequence_parallel = sp
    return c


def batch_for(program, config, step=0, rows=None):
    corpus = data.load_corpus(config.data)
    batch = data.global_batch(
        corpus, program.batch_sharding, config.seed, step, config.train.batch_size, config.data.seq_len
    )
    return batch if rows is None else jax.device_put(np.asarray(batch)[rows], program.batch_sharding)


def grads_and_metrics(config, rows=None, params=None):
    """Objective, reduced gradients and MoE metrics (numpy) at the initial parameters on batch 0
    (its rows reordered by `rows`)."""
    program = program_for(config)
    params = program.init().params if params is None else params
    loss, grads, metrics = program.loss_and_grads_fn(metrics=True)(params, batch_for(program, config, 0, rows))
    return float(loss), jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, metrics)


_reference = {}


def reference(config, rows=None):
    """The same model on one device (cached per model and micro-batching)."""
    single = config.copy_and_resolve_references()
    for axis in single.mesh:
        single.mesh[axis] = 1
    single.parallel.sequence_parallel = False
    single.train.pipeline_schedule, single.train.virtual_stages = "1f1b", 1
    key = (single.to_json(), None if rows is None else tuple(rows))
    if key not in _reference:
        _reference[key] = grads_and_metrics(single, rows)
    return _reference[key]


def assert_same(got, want):
    (loss, grads, metrics), (ref_loss, ref_grads, ref_metrics) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-7)
    for key in ("moe_load", "moe_pairs", "moe_dropped"):  # integer counts: exactly
        np.testing.assert_array_equal(metrics[key], ref_metrics[key], err_msg=key)
    np.testing.assert_allclose(metrics["moe_aux_loss"], ref_metrics["moe_aux_loss"], rtol=1e-5)


LAYOUTS = {  # name: (mesh, sequence parallel, MoE settings)
    "ep8": (dict(expert=8), False, {}),
    "ep4_data2": (dict(expert=4, data=2), False, {}),
    "ep2_tensor2_data2_sp": (dict(expert=2, tensor=2, data=2), True, {}),
    "ep8_capacity": (dict(expert=8), False, dict(capacity_factor=1.0)),
    "ep2_tensor2_data2_sp_capacity": (dict(expert=2, tensor=2, data=2), True, dict(capacity_factor=1.0)),
    "ep4_fsdp2_shared_sigmoid": (
        dict(expert=4, fsdp=2),
        False,
        dict(shared_experts=1, router="sigmoid", capacity_factor=1.0),
    ),
    "ep2_seq2_data2": (dict(expert=2, seq=2, data=2), False, {}),  # dropless: CP does not change it
    # Qwen2-MoE's gated shared experts split over tensor with SP: the gate on this rank's positions
    "ep2_tensor2_data2_sp_gated_shared": (
        dict(expert=2, tensor=2, data=2),
        True,
        dict(shared_experts=2, shared_expert_gate=True, renormalize=False),
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layout_matches_single_device(name):
    mesh, sp, moe = LAYOUTS[name]
    config = moe_config(mesh, sp, **moe)
    got = grads_and_metrics(config)
    assert_same(got, reference(config))
    if moe.get("capacity_factor"):
        assert got[2]["moe_dropped"].sum() > 0, "the capacity layouts should drop copies"
    copies = config.train.batch_size * config.data.seq_len * 2  # B T k per layer
    assert got[2]["moe_load"].sum() == 2 * copies  # 2 MoE layers
    # traffic[l, i, j]: copies the tokens of expert-axis device i send to device j's experts
    ep = mesh.get("expert", 1)
    traffic = got[2]["moe_traffic"]
    assert traffic.shape == (2, ep, ep)
    np.testing.assert_array_equal(traffic.sum(1), expert_placement.device_load(got[2]["moe_load"], ep))
    assert np.all(traffic.sum(2) == copies // ep)  # every device routes its own tokens' copies


def test_training_steps_match_single_device():
    """Three optimizer steps with the dense/MoE pattern: losses and parameters agree."""

    def steps(config):
        program = program_for(config)
        state, step_fn, losses = program.init(), program.train_step_fn(), []
        for s in range(3):
            state, metrics = step_fn(state, batch_for(program, config, s))
            losses.append(float(metrics["loss"]))
        return np.array(losses), jax.tree.map(np.asarray, state.params)

    want_losses, want = steps(moe_config(pattern="dense,moe"))
    got_losses, got = steps(moe_config(dict(expert=4, data=2), pattern="dense,moe"))
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    assert got_losses[-1] < got_losses[0]
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)


def test_pipeline_with_expert_parallelism_matches_single_device():
    """pipe=2 x expert=2 x data=2, 1F1B over 4 micro-batches. The balance loss is per micro-batch
    and micro-batch i holds the i-th quarter of every batch shard's rows, so the single-device
    reference runs 4 micro-batches of the same rows (the batch reordered)."""
    config = pipeline_config(dict(pipe=2, expert=2, data=2), "1f1b", microbatches=4)
    config.model.mlp_pattern, config.train.batch_size = "dense,moe", 16
    config.model.moe.experts, config.model.moe.d_ff = 4, 32
    shards, m = 4, 4
    local = config.train.batch_size // shards
    rows = [s * local + i * (local // m) + j for i in range(m) for s in range(shards) for j in range(local // m)]
    got, want = grads_and_metrics(config), reference(config, rows)
    # each stage's first MoE layer (MoE layer 2 of 4 here) sees no previous layer: no co-routing pairs
    assert np.all(got[2]["moe_pairs"][2] == 0) and want[2]["moe_pairs"][2].sum() > 0
    want[2]["moe_pairs"] = want[2]["moe_pairs"].copy()
    want[2]["moe_pairs"][2] = 0
    assert_same(got, want)


# ----------------------------------------------------------------------------- the all-to-all


def _ragged_case(ep=4, rows=12, width=3, seed=0):
    """Per-device arguments of a ragged all-to-all that follow its contract, with gaps."""
    rng = np.random.default_rng(seed)
    send = rng.integers(0, 4, size=(ep, ep))  # send[i, j]: rows device i sends device j
    operand = rng.normal(size=(ep, rows, width)).astype(np.float32)
    input_offsets = np.zeros((ep, ep), np.int32)
    for i in range(ep):
        gaps = rng.integers(0, 2, size=ep)
        input_offsets[i] = np.cumsum(np.r_[gaps[0], send[i, :-1] + gaps[1:]])
    out_rows = 24
    output_offsets = np.zeros((ep, ep), np.int32)  # [i, j]: where i's slice lands on j
    for j in range(ep):
        output_offsets[:, j] = np.cumsum(np.r_[1, send[:-1, j] + 1])
    return operand, input_offsets, send.astype(np.int32), output_offsets, send.T.copy().astype(np.int32), out_rows


def _ragged_reference(operand, input_offsets, send, output_offsets, out_rows, output):
    """`lax.ragged_all_to_all`'s docstring pseudo-code, in numpy."""
    ep = operand.shape[0]
    result = output.copy()
    for i in range(ep):
        for j in range(ep):
            chunk = operand[i, input_offsets[i, j] : input_offsets[i, j] + send[i, j]]
            result[j, output_offsets[i, j] : output_offsets[i, j] + send[i, j]] = chunk
    return result


def test_padded_ragged_all_to_all_keeps_the_contract():
    ep = 4
    mesh = Mesh(np.array(jax.devices()[:ep]), ("expert",))
    operand, in_off, send, out_off, recv, out_rows = _ragged_case(ep)
    output = np.full((ep, out_rows, operand.shape[-1]), -1.0, np.float32)  # kept where nothing lands

    def local(x, out, a, b, c, d, impl):
        return expert.ragged_all_to_all(x[0], out[0], a[0], b[0], c[0], d[0], ("expert",), impl)[None]

    def run(impl):
        return jax.jit(
            jax.shard_map(
                lambda *args: local(*args, impl),
                mesh=mesh,
                in_specs=P("expert"),
                out_specs=P("expert"),
                check_vma=False,
            )
        )

    args = tuple(map(jnp.asarray, (operand, output, in_off, send, out_off, recv)))
    got = run("padded")(*args)
    np.testing.assert_array_equal(np.asarray(got), _ragged_reference(operand, in_off, send, out_off, out_rows, output))
    # backward: each operand row gets the cotangent of the output row it landed in
    cotangent = np.random.default_rng(1).normal(size=got.shape).astype(np.float32)
    d_operand = jax.grad(lambda x: jnp.sum(run("padded")(x, *args[1:]) * cotangent))(args[0])
    want = np.zeros_like(operand)
    for i in range(ep):
        for j in range(ep):
            for r in range(send[i, j]):
                want[i, in_off[i, j] + r] = cotangent[j, out_off[i, j] + r]
    np.testing.assert_array_equal(np.asarray(d_operand), want)
    # the native op: XLA:CPU cannot run it, but the program lowers to it with the same arguments
    assert "ragged_all_to_all" in run("ragged").lower(*args).as_text()


def test_ragged_dispatch_is_refused_on_cpu():
    config = moe_config(dict(expert=8))
    config.parallel.expert_dispatch = "ragged"
    with pytest.raises(Exception, match="expert_dispatch='ragged'.*GPU or TPU"):
        program_for(config)


# ----------------------------------------------------------------------------- placement


def test_a_re_placement_computes_the_same_model():
    """Permuting the experts of each layer (weights, router columns, Adam moments) leaves the loss
    unchanged, permutes the gradients and routing statistics, and trains on identically."""
    config = moe_config(dict(expert=4, data=2))
    program = program_for(config)
    step_fn = program.train_step_fn()
    state = program.init()
    state, _ = step_fn(state, batch_for(program, config, 0))  # non-zero Adam moments
    perm = np.stack([np.random.default_rng(l).permutation(8) for l in range(2)])
    moved = program.place_experts_fn()(jax.tree.map(jnp.copy, state), perm)

    grads_fn = program.loss_and_grads_fn(metrics=True)
    batch = batch_for(program, config, 1)
    loss, grads, metrics = grads_fn(state.params, batch)
    loss_moved, grads_moved, metrics_moved = grads_fn(moved.params, batch)
    np.testing.assert_allclose(float(loss_moved), float(loss), rtol=1e-6)
    want = expert_placement.permute_params(grads, program.specs, perm)
    chex.assert_trees_all_close(grads_moved, want, rtol=1e-5, atol=1e-7)
    load, pairs = expert_placement.permute_stats(metrics["moe_load"], metrics["moe_pairs"], perm)
    np.testing.assert_array_equal(metrics_moved["moe_load"], load)
    np.testing.assert_array_equal(metrics_moved["moe_pairs"], pairs)
    after, _ = step_fn(state, batch)
    after_moved, _ = step_fn(moved, batch)
    want = expert_placement.permute_params(after.params, program.specs, perm)
    chex.assert_trees_all_close(after_moved.params, want, rtol=1e-5, atol=1e-7)


def _zipf_load(layers, experts, seed=0, skew=1.2):
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(1000 / np.arange(1, experts + 1) ** skew) for _ in range(layers)]).astype(np.int64)


@pytest.mark.parametrize("skew", [0.6, 1.2])
def test_balance_evens_out_a_skewed_load(skew):
    load = _zipf_load(3, 16, skew=skew)
    perm = expert_placement.balance(load, ep=4, colocate=False)
    assert all(sorted(row) == list(range(16)) for row in perm)
    new_load, _ = expert_placement.permute_stats(load, None, perm)
    before, after = expert_placement.imbalance(load, 4), expert_placement.imbalance(new_load, 4)
    assert np.all(after < before)
    # optimal here: no device can carry less than the mean, nor less than the heaviest expert plus
    # the three lightest (every device holds 4)
    per_device = expert_placement.device_load(new_load, 4)
    ordered = np.sort(load, axis=1)
    bound = np.maximum(per_device.mean(1), ordered[:, -1] + ordered[:, :3].sum(1))
    np.testing.assert_allclose(per_device.max(1), bound, rtol=0.02)


def test_colocation_follows_consecutive_layers():
    """Layer l+1 sends the tokens of expert i (of layer l) to expert sigma(i). With even loads every
    such pair can share a device (MoETuner's locality) without touching the balance."""
    e, ep, layers = 16, 4, 3
    rng = np.random.default_rng(0)
    load = np.full((layers, e), 100)
    pairs = np.zeros((layers, e, e), np.int64)
    for l in range(1, layers):
        pairs[l, np.arange(e), rng.permutation(e)] = 100
    assert expert_placement.colocation(pairs, ep) < 0.5
    new_load, new_pairs = expert_placement.permute_stats(load, pairs, expert_placement.balance(load, ep, pairs))
    assert expert_placement.colocation(new_pairs, ep) == 1.0
    assert np.all(expert_placement.imbalance(new_load, ep) == 1.0)


def test_colocation_never_costs_balance():
    load, e, ep = _zipf_load(4, 16, seed=3), 16, 4
    rng = np.random.default_rng(1)
    pairs = rng.integers(0, 50, size=(4, e, e))
    pairs[1:, np.arange(e), rng.permutation(e)] += 400  # a strong preferred successor per expert
    alone = expert_placement.permute_stats(load, pairs, expert_placement.balance(load, ep, colocate=False))
    both = expert_placement.permute_stats(load, pairs, expert_placement.balance(load, ep, pairs))
    assert np.all(expert_placement.imbalance(both[0], ep) <= expert_placement.imbalance(alone[0], ep) + 1e-12)
    assert expert_placement.colocation(both[1], ep) > expert_placement.colocation(alone[1], ep) + 0.1


def test_re_placement_without_co_routing_pairs():
    """A pipeline with one MoE layer per stage records no pairs (the choices stay on their stage):
    the re-placement still balances, and reports no co-location rather than failing."""
    log = expert_placement.RoutingLog(n_layers=2, n_experts=8, ep=4)
    log.add(_zipf_load(2, 8, skew=1.2), np.zeros((2, 8, 8), np.int64))
    perm, summary = log.rebalance(colocate=True)
    assert all(sorted(row) == list(range(8)) for row in perm)
    assert summary["moe_window_imbalance_after"] < summary["moe_window_imbalance_before"]
    assert not any(key.startswith("moe_window_colocation") for key in summary)


def test_training_run_logs_routing_and_re_places_experts(tmp_path):
    config = moe_config(dict(expert=4, data=2))
    config.train.steps, config.parallel.expert_rebalance_every = 4, 2
    config.checkpoint.enabled = False
    train.main(config, str(tmp_path))
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert len(r["moe_expert_load"]) == 2 and all(abs(sum(row) - 1) < 1e-3 for row in r["moe_expert_load"])
        assert len(r["moe_device_imbalance"]) == 2 and min(r["moe_device_imbalance"]) >= 1.0
        assert r["moe_dropped_fraction"] == 0.0 and r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0
    placed = [r for r in records if "moe_window_imbalance_after" in r]
    assert len(placed) == 1 and placed[0]["step"] == 3  # re-placed after step 2, noted at the next record
    assert placed[0]["moe_window_imbalance_after"] <= placed[0]["moe_window_imbalance_before"]
    saved = np.load(tmp_path / "moe_routing.npz")
    assert saved["load"].shape == (2, 8) and saved["steps"] == 2  # the window since the re-placement
    assert saved["load"].sum() == 2 * 2 * config.train.batch_size * config.data.seq_len * 2


def test_checkpoint_restores_onto_another_expert_layout(tmp_path):
    """Saved on expert=8 after a re-placement, restored on expert=2 x data=4 and on one device: the
    same values, and the same loss and gradients from them."""
    from jaxsys.checkpoint import Checkpointer

    config = moe_config(dict(expert=8))
    config.train.steps, config.parallel.expert_rebalance_every = 2, 1
    train.main(config, str(tmp_path))
    restored = {}
    for name, mesh in (("ep2_data4", dict(expert=2, data=4)), ("single", {})):
        other = moe_config(mesh)
        program = program_for(other)
        checkpointer = Checkpointer(str(tmp_path), other.checkpoint, read_only=True)
        state = checkpointer.restore(program.abstract_state())
        checkpointer.close()
        assert int(state.step) == 2
        loss, grads = program.loss_and_grads_fn()(state.params, batch_for(program, other, 5))
        restored[name] = (jax.tree.map(np.asarray, state), float(loss), jax.tree.map(np.asarray, grads))
    (state_a, loss_a, grads_a), (state_b, loss_b, grads_b) = restored["ep2_data4"], restored["single"]
    chex.assert_trees_all_equal(state_a, state_b)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    chex.assert_trees_all_close(grads_a, grads_b, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- accounting


@pytest.mark.parametrize("capacity_factor, remat", [(0.0, "none"), (1.0, "full")])
def test_collectives_equal_the_cost_model(capacity_factor, remat):
    config = moe_config(dict(expert=8), pattern="dense,moe", capacity_factor=capacity_factor)
    config.model.remat = remat
    r = report.analyze(config, devices=jax.devices()[:8], flops=False)
    measured, formula = report.by_kind_axes(r["collectives"]), report.by_kind_axes(r["collectives_formula"])
    assert ("all_to_all", ("expert",)) in formula
    assert set(measured) == set(formula), (measured, formula)
    for key in formula:
        assert measured[key][0] == formula[key][0], (key, measured[key], formula[key])
        assert measured[key][1] == pytest.approx(formula[key][1], rel=1e-12), (key, measured[key], formula[key])
    assert sum(row["count"] for row in r["collectives"] if row["scalar"]) == r["metric_scalars_formula"]
    m = r["memory"]
    assert m["params_bytes"] == m["formula"]["params"]  # expert leaves counted 1/ep
