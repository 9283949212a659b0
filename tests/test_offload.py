"""Host offloading (jaxsys/parallel/offload.py, config.offload): numerics never change, the state
lives in host memory, checkpoints move between runs with and without offload, and the TPU
compiler's memory analysis moves the formula's bytes from HBM to the host.

XLA:CPU has one memory, so the moves lower to nothing there: the CPU tests check the numerics
(bitwise against the same layout without offload, since the same arithmetic runs) and the memory
kinds of the arrays the step returns; the TPU compiler (libtpu, ahead of time) checks the bytes.
"""

import math

import chex
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsys import train
from jaxsys.checkpoint import Checkpointer
from jaxsys.config import ConfigError
from jaxsys.parallel import offload
from tests.helpers import program_for, run, small_config

OPTIONS = {
    "optimizer_device": dict(optimizer=True),
    "optimizer_host": dict(optimizer=True, optimizer_update="host"),
    "optimizer_half_host": dict(optimizer=True, optimizer_update="host", optimizer_fraction=0.5),
    "params": dict(params=True),
    "activations": dict(activations="layer_input,attention_output,mlp_hidden"),
    "all": dict(optimizer=True, optimizer_update="host", params=True, activations="layer_input"),
}
LAYOUTS = {"one_device": ({}, 0), "data2_fsdp2_tensor2_zero1": (dict(data=2, fsdp=2, tensor=2), 1)}


def _config(mesh, zero_stage, remat="none", **options):
    c = small_config(mesh)
    c.train.zero_stage, c.model.remat = zero_stage, remat
    for key, value in options.items():
        c.offload[key] = value
    return c


_baseline = {}


def _reference(layout, remat):
    if (layout, remat) not in _baseline:
        _baseline[layout, remat] = run(_config(*LAYOUTS[layout], remat=remat), steps=3)
    return _baseline[layout, remat]


def _kinds(tree):
    return [leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_offload_gives_the_losses_and_parameters_of_the_run_without(option, layout):
    remat = "full" if option in ("activations", "all") else "none"
    ref_loss0, ref_grads, ref_losses, ref_state = _reference(layout, remat)
    loss0, grads, losses, state = run(_config(*LAYOUTS[layout], remat=remat, **OPTIONS[option]), steps=3)
    # the same arithmetic in the same order: only the memory the operands live in differs
    np.testing.assert_array_equal(losses, ref_losses)
    chex.assert_trees_all_equal(state.params, ref_state.params)
    chex.assert_trees_all_equal(state.opt_state, ref_state.opt_state)
    # where the state lives after three steps
    opts = OPTIONS[option]
    moments = [k for k, leaf in zip(_kinds(state.opt_state), jax.tree.leaves(state.opt_state)) if leaf.ndim]
    if opts.get("optimizer"):
        fraction = opts.get("optimizer_fraction", 1.0)
        assert offload.HOST in moments
        if fraction == 1.0:
            assert set(moments) == {offload.HOST}
        else:
            assert offload.DEVICE in moments
    else:
        assert set(_kinds(state.opt_state)) == {offload.DEVICE}
    assert set(_kinds(state.params)) == {offload.HOST if opts.get("params") else offload.DEVICE}


def test_compiled_step_outputs_the_state_in_host_memory():
    program = program_for(_config(dict(data=2, fsdp=2, tensor=2), 1, optimizer=True, params=True))
    state = program.abstract_state()
    compiled = (
        program.train_step_fn()
        .lower(
            state,
            jax.ShapeDtypeStruct(
                (program.config.train.batch_size, program.config.data.seq_len + 1),
                np.int32,
                sharding=program.batch_sharding,
            ),
        )
        .compile()
    )
    out_state, _ = compiled.output_shardings
    assert {s.memory_kind for s in jax.tree.leaves(out_state.params)} == {offload.HOST}
    moments = [
        s.memory_kind
        for s, leaf in zip(jax.tree.leaves(out_state.opt_state), jax.tree.leaves(state.opt_state))
        if leaf.ndim
    ]
    assert set(moments) == {offload.HOST}
    assert out_state.step.memory_kind == offload.DEVICE


def test_choose_offloads_the_largest_leaves_first():
    sizes = [10, 400, 30, 200, 60]
    assert offload.choose(sizes, 0.0) == [False] * 5
    assert offload.choose(sizes, 1.0) == [True] * 5
    assert offload.choose(sizes, 0.5) == [False, True, False, False, False]  # 400 of 700
    chosen = offload.choose(sizes, 0.6)  # 400 < 420: the next largest joins
    assert chosen == [False, True, False, True, False]
    assert sum(s for s, c in zip(sizes, chosen) if c) >= 0.6 * sum(sizes)


def test_hidden_fraction_balances_transfer_against_compute():
    # 1 GB of state, 10 GB/s link: the round trip of all of it takes 0.2 s
    assert offload.hidden_fraction(0.1, 1e9, 10e9) == pytest.approx(0.5)
    assert offload.hidden_fraction(1.0, 1e9, 10e9) == 1.0
    assert offload.transfer_seconds([1e9], 10e9) == pytest.approx(0.1 + offload.TRANSFER_LATENCY_S)


def test_checkpoint_moves_between_runs_with_and_without_offload(tmp_path):
    mesh = dict(data=2, fsdp=2, tensor=2)
    on = _config(mesh, 1, optimizer=True, params=True)
    on.train.steps, on.checkpoint.every_steps = 2, 2
    train.main(on, str(tmp_path / "on"))
    off_program = program_for(_config(mesh, 1))
    on_program = program_for(on)
    restored_off = Checkpointer(str(tmp_path / "on"), on.checkpoint).restore(off_program.abstract_state())
    restored_on = Checkpointer(str(tmp_path / "on"), on.checkpoint).restore(on_program.abstract_state())
    assert set(_kinds(restored_off)) == {offload.DEVICE}
    assert offload.HOST in _kinds(restored_on.params)
    chex.assert_trees_all_equal(restored_off, restored_on)
    # the run without offload resumes the offloaded run's checkpoint, and the other way round
    off = _config(mesh, 1)
    off.train.steps, off.checkpoint.every_steps = 2, 2
    train.main(off, str(tmp_path / "off"))
    restored = Checkpointer(str(tmp_path / "off"), off.checkpoint).restore(on_program.abstract_state())
    assert offload.HOST in _kinds(restored.params)


def test_host_update_refuses_an_optimizer_it_cannot_split():
    c = _config({}, 0, optimizer=True, optimizer_update="host")
    c.train.optimizer = "galore"
    with pytest.raises(ConfigError, match="optimizer_update='host'"):
        program_for(c)


def test_backend_without_host_memory_is_named():
    class NoHostDevice:
        platform = "weird"

        def addressable_memories(self):
            class Memory:
                kind = "device"

            return [Memory()]

    with pytest.raises(offload.OffloadError, match="pinned_host"):
        offload.require_host_memory([NoHostDevice()], "config.offload.optimizer")


def test_bad_offload_keys_are_named():
    for key, value, message in (
        ("activations", "qkv", "unknown name"),
        ("optimizer_update", "cpu", "choose one"),
        ("optimizer_fraction", 1.5, r"\[0, 1\]"),
    ):
        c = _config({}, 0)
        c.offload[key] = value
        with pytest.raises(ConfigError, match=message):
            from jaxsys.config import validate

            validate(c)


# ----------------------------------------------------------------------------- the TPU compiler


_TPU_MEMORY: dict = {}  # config JSON -> memory analysis: the tests below share their baselines


def _tpu_memory(config, devices):
    from tests.test_tpu_compile import compile_on_tpu

    key = config.to_json_best_effort(sort_keys=True)
    if key not in _TPU_MEMORY:
        _TPU_MEMORY[key] = compile_on_tpu(config, devices).memory_analysis()
    return _TPU_MEMORY[key]


@pytest.fixture(scope="module")
def tpu_devices():
    from jaxsys.analysis import targets

    if not targets.has_libtpu():
        pytest.skip("libtpu is not installed (bash scripts/bootstrap --test installs it)")
    return targets.devices(targets.parse("v5p:2x2x1"))


def _tpu_config(remat="none", **options):
    c = _config(dict(fsdp=4), 0, remat=remat, **options)
    c.model.d_model, c.model.d_ff, c.model.n_layers = 256, 1024, 8
    c.model.n_heads, c.model.head_dim, c.data.seq_len = 4, 64, 256
    return c


def _shard_bytes(tree, pspecs, mesh) -> int:
    """Bytes of one chip's shards of `tree`'s (non-scalar) leaves."""
    return sum(
        math.prod(NamedSharding(mesh, spec).shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(pspecs, is_leaf=lambda x: isinstance(x, P)))
        if leaf.ndim
    )


# The TPU stores arrays in (8, 128) tiles in a layout of its choosing: shards with a dimension of
# 64 here (D/fsdp = 64, H = 64) take more bytes than their elements. The compiler's figure may
# exceed the element count by that padding (20% for this model), never fall below it.
TILE_PADDING = 1.25


def test_tpu_memory_moves_the_optimizer_state_to_the_host(tpu_devices):
    base = _tpu_memory(_tpu_config(), tpu_devices)
    off = _tpu_memory(_tpu_config(optimizer=True), tpu_devices)
    program = program_for(_tpu_config())
    state = program.abstract_state()
    moved = base.argument_size_in_bytes - off.argument_size_in_bytes
    assert base.host_argument_size_in_bytes == 0
    assert off.host_argument_size_in_bytes == moved  # what leaves HBM is what the host holds
    # ZeRO-Offload's formula: the optimizer state (2 moments x 4 bytes per parameter of the shard)
    formula = _shard_bytes(state.opt_state, program.state_pspecs.opt_state, program.mesh)
    assert formula <= moved <= TILE_PADDING * formula


def _update_bound_config(**options):
    """`_tpu_config` with wide layers (D=1024, F=4096), remat "full" and 64 tokens: the optimizer
    state (244 MB per chip) outweighs the activations, so the update sets the HBM peak."""
    c = _tpu_config(remat="full", **options)
    c.data.seq_len = 64
    c.model.d_model, c.model.d_ff, c.model.n_heads, c.model.head_dim = 1024, 4096, 8, 128
    return c


@pytest.mark.slow  # CI time; test_tpu_memory_moves_the_optimizer_state_to_the_host stays
def test_tpu_streamed_update_lowers_the_peak_by_the_optimizer_state(tpu_devices):
    # The device update streams the moments layer by layer (offload.streamed_update), so HBM's
    # peak falls by about the optimizer state (244 MB here). A whole-tree update (before
    # 2026-11-25) let XLA bring every leaf's moments in at once: temp rose by 255 MB (1.04 x the
    # state), as much as the arguments fell, and the peak rose (636.5 -> 647.4 MB). Streamed:
    # temp +38 MB (0.16 x), peak 430.5 MB (falls 0.84 x the state).
    peak = lambda m: m.argument_size_in_bytes + m.temp_size_in_bytes
    base = _tpu_memory(_update_bound_config(), tpu_devices)
    off = _tpu_memory(_update_bound_config(optimizer=True), tpu_devices)
    program = program_for(_update_bound_config())
    formula = _shard_bytes(program.abstract_state().opt_state, program.state_pspecs.opt_state, program.mesh)
    assert off.host_argument_size_in_bytes >= formula
    assert peak(base) - peak(off) >= 0.5 * formula
    assert off.temp_size_in_bytes <= base.temp_size_in_bytes + 0.5 * formula


@pytest.mark.slow  # CI time; test_tpu_memory_moves_the_optimizer_state_to_the_host stays
def test_tpu_memory_moves_the_parameters_to_the_host(tpu_devices):
    base = _tpu_memory(_tpu_config(), tpu_devices)
    off = _tpu_memory(_tpu_config(params=True), tpu_devices)
    program = program_for(_tpu_config())
    moved = base.argument_size_in_bytes - off.argument_size_in_bytes
    assert off.host_argument_size_in_bytes == moved
    formula = _shard_bytes(program.abstract_state().params, program.param_pspecs, program.mesh)
    assert formula <= moved <= TILE_PADDING * formula


@pytest.mark.slow  # CI time
def test_tpu_memory_offloads_the_layer_inputs(tpu_devices):
    from jaxsys.analysis import cost_model

    base = _tpu_memory(_tpu_config(remat="full"), tpu_devices)
    config = _tpu_config(remat="full", activations="layer_input")
    off = _tpu_memory(config, tpu_devices)
    stacked = cost_model.offloaded_activation_bytes(config)  # L x [B, T, D] per device
    assert base.host_temp_size_in_bytes == 0
    assert off.host_temp_size_in_bytes >= stacked
    assert off.temp_size_in_bytes < base.temp_size_in_bytes


def test_pipeline_with_offload_gives_the_losses_of_the_run_without():
    from tests.helpers import pipeline_config

    _, _, ref_losses, ref_state = run(pipeline_config(dict(pipe=2, data=2, tensor=2)), steps=2)
    c = pipeline_config(dict(pipe=2, data=2, tensor=2))
    c.offload.optimizer, c.offload.params, c.offload.activations = True, True, "layer_input"
    _, _, losses, state = run(c, steps=2)
    np.testing.assert_array_equal(losses, ref_losses)
    chex.assert_trees_all_equal(state.params, ref_state.params)
