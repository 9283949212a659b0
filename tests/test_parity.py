"""Every data/FSDP/tensor layout gives the single-device loss and gradients (fp32).

Tolerances: the layouts sum the same fp32 terms in other orders (all-reduce trees, split matmul
contractions), which moves results by a few ulps of the largest partial sums: ~1e-6 relative was
seen. A gradient entry gets 1e-5 relative plus 1e-5 of its leaf's largest entry: entries built by
cancellation carry the rounding of the large terms (the embedding row of the space character, the
corpus's most frequent byte, moved 8e-5 relative on an Intel Xeon host, whose XLA:CPU vector code
orders the sums differently from the AMD hosts the suite was written on; the worst excess over
1e-5 relative was 6e-7 of the leaf's largest entry). A wrong reduction (a missing or doubled
gradient sum is off by a factor of 2..8) fails by orders of magnitude.
"""

import chex
import numpy as np
import pytest

from tests.helpers import assert_trees_close_leafwise, run, small_config

LAYOUTS = {
    "data8_zero0": (dict(data=8), dict(zero_stage=0), {}),
    "data8_zero1": (dict(data=8), dict(zero_stage=1), {}),
    "data8_zero2": (dict(data=8), dict(zero_stage=2), {}),
    "fsdp8": (dict(fsdp=8), {}, {}),
    "tensor8": (dict(tensor=8), {}, dict(n_kv_heads=8)),
    "tensor8_sp": (dict(tensor=8), dict(sp=True), dict(n_kv_heads=8)),
    "data2_fsdp2_tensor2": (dict(data=2, fsdp=2, tensor=2), dict(zero_stage=2), {}),
    "data2_fsdp2_tensor2_sp_tied": (
        dict(data=2, fsdp=2, tensor=2),
        dict(zero_stage=1, sp=True),
        dict(tie_embeddings=True),
    ),
    "fsdp4_expert2": (dict(fsdp=4, expert=2), {}, {}),
    # a linear-attention layer then a softmax one; heads (and their decays) split over tensor
    "data2_fsdp2_tensor2_hybrid": (
        dict(data=2, fsdp=2, tensor=2),
        {},
        dict(layer_pattern="linear,softmax", linear_chunk=16),
    ),
}

_reference_cache = {}


def _configure(mesh, opts, model):
    c = small_config(mesh, **model)
    c.train.zero_stage = opts.get("zero_stage", 0)
    c.parallel.sequence_parallel = opts.get("sp", False)
    return c


def _reference(model):
    key = tuple(sorted(model.items()))
    if key not in _reference_cache:
        _reference_cache[key] = run(_configure({}, {}, model))
    return _reference_cache[key]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_device(name):
    mesh, opts, model = LAYOUTS[name]
    ref_loss0, ref_grads, ref_losses, ref_state = _reference(model)
    loss0, grads, losses, state = run(_configure(mesh, opts, model))

    np.testing.assert_allclose(loss0, ref_loss0, rtol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0], "three optimizer steps should lower the loss"
    assert_trees_close_leafwise(grads, ref_grads, rtol=1e-5, atol=lambda want: 1e-5 * np.abs(want).max())
    # parameters after the steps agree too (the optimizer update is sharded differently per stage)
    chex.assert_trees_all_close(state.params, ref_state.params, rtol=1e-4, atol=1e-6)
