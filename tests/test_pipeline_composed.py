"""Pipeline parallelism composed with data, FSDP, tensor (and sequence/context) parallelism, and
vocabulary parallelism: loss and gradients equal the single-device run; a few optimizer steps
agree too; 1F1B's per-device peak memory (XLA's own analysis) is below GPipe's.

Tolerances as in test_pipeline.py (same sums, reassociated over micro-batches and shards).
"""

import chex
import jax
import numpy as np
import pytest

from tests.helpers import loss_and_grads, pipeline_config, program_for, run, unchunked
from tests.test_pipeline import assert_matches, reference

CASES = {  # name: (mesh, schedule, micro-batches, virtual stages, vocab parallel, options)
    "pipe2_data2_tensor2_gpipe": (dict(pipe=2, data=2, tensor=2), "gpipe", 2, 1, False, {}),
    "pipe2_data2_tensor2_1f1b": (dict(pipe=2, data=2, tensor=2), "1f1b", 4, 1, False, {}),
    "pipe2_data2_tensor2_eager": (dict(pipe=2, data=2, tensor=2), "eager_1f1b", 4, 1, False, {}),
    "pipe2_data2_tensor2_interleaved": (dict(pipe=2, data=2, tensor=2), "interleaved_1f1b", 4, 2, False, {}),
    "pipe4_data2_interleaved": (dict(pipe=4, data=2), "interleaved_1f1b", 4, 2, False, {}),
    "pipe4_tensor2_1f1b": (dict(pipe=4, tensor=2), "1f1b", 4, 1, False, {}),
    "pipe2_fsdp2_tensor2_sp_zero2": (dict(pipe=2, fsdp=2, tensor=2), "1f1b", 2, 1, False, dict(sp=True, zero_stage=2)),
    "pipe2_seq2_tensor2_allgather": (
        dict(pipe=2, seq=2, tensor=2),
        "1f1b",
        2,
        1,
        False,
        dict(context_parallel="allgather"),
    ),
    # 4 layers: deeper stacks of linear layers are ill-conditioned (one device alone moves 9e-6
    # relative at 8 layers when only its chunk size changes), which would blur the tolerance
    "pipe2_data2_tensor2_hybrid": (
        dict(pipe=2, data=2, tensor=2),
        "1f1b",
        2,
        1,
        False,
        dict(layer_pattern="linear,softmax", linear_chunk=16, n_layers=4),
    ),
    # vocabulary parallelism: embedding and output layer over (pipe, tensor)
    "vp_pipe2_data2_tensor2_1f1b": (dict(pipe=2, data=2, tensor=2), "1f1b", 4, 1, True, {}),
    "vp_pipe4_tensor2_gpipe_tied": (dict(pipe=4, tensor=2), "gpipe", 4, 1, True, dict(tie_embeddings=True)),
    "vp_pipe2_fsdp2_tensor2_sp_interleaved": (
        dict(pipe=2, fsdp=2, tensor=2),
        "interleaved_1f1b",
        2,
        2,
        True,
        dict(sp=True),
    ),
    "vp_pipe4_eager": (dict(pipe=4), "eager_1f1b", 4, 1, True, {}),
}

_MODEL_KEYS = ("layer_pattern", "linear_chunk", "tie_embeddings", "context_parallel", "n_layers")


def configure(name):
    mesh, schedule, m, v, vp, opts = CASES[name]
    model = {k: opts[k] for k in _MODEL_KEYS if k in opts}
    c = pipeline_config(mesh, schedule, m, v, vp, **model)
    c.parallel.sequence_parallel = opts.get("sp", False)
    c.train.zero_stage = opts.get("zero_stage", 0)
    return c, model


@pytest.mark.parametrize("name", list(CASES))
def test_composed_pipeline_matches_single_device(name):
    c, model = configure(name)
    model.pop("context_parallel", None)  # one device has no context to split
    assert_matches(loss_and_grads(c), reference(**model))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vp_pipe2_data2_tensor2_1f1b", "pipe2_data2_tensor2_interleaved"])
def test_training_steps_match_single_device(name):
    c, model = configure(name)
    c.train.zero_stage = 1
    single = pipeline_config(microbatches=1, **model)
    single.train.zero_stage = 1
    _, _, ref_losses, ref_state = run(single)
    _, _, losses, state = run(c)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    params = unchunked(jax.tree.map(np.asarray, state.params)) if c.train.virtual_stages > 1 else state.params
    chex.assert_trees_all_close(params, ref_state.params, rtol=1e-4, atol=1e-6)


def _peak_bytes(schedule, m):
    c = pipeline_config(dict(pipe=2), schedule, m, d_model=128, d_ff=256)
    c.data.seq_len = 128
    c.train.batch_size = m
    program = program_for(c)
    state = program.abstract_state()
    batch = jax.ShapeDtypeStruct((c.train.batch_size, c.data.seq_len + 1), np.int32, sharding=program.batch_sharding)
    compiled = program.train_step_fn().lower(state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes, program.pipeline_train.act_slots


def test_1f1b_peak_memory_is_below_gpipe():
    # m = 8 micro-batches of one sequence (128 x 128 fp32 = 64 KiB of stage input each) on 2 stages:
    # GPipe stashes all 8 inputs per device, 1F1B 2, eager 1F1B 3.
    gpipe, gpipe_slots = _peak_bytes("gpipe", 8)
    one, one_slots = _peak_bytes("1f1b", 8)
    eager, eager_slots = _peak_bytes("eager_1f1b", 8)
    assert (gpipe_slots, one_slots, eager_slots) == (8, 2, 3)
    assert one < eager < gpipe
    # the difference is at least the stashed inputs that 1F1B does not keep
    assert gpipe - one >= (gpipe_slots - one_slots) * 128 * 128 * 4
