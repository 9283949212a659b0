"""Each layout's step contains exactly the collectives its technique prescribes, over the right
mesh axes: read from the lowered program (the collectives jaxsys wrote, as written)."""

import jax
import pytest

from jaxsys.analysis import collectives
from tests.helpers import program_for, small_config


def _step_collectives(mesh, zero_stage=0, sp=False, **model):
    c = small_config(mesh, **model)
    c.train.zero_stage, c.parallel.sequence_parallel = zero_stage, sp
    program = program_for(c)
    batch = jax.ShapeDtypeStruct((c.train.batch_size, c.data.seq_len + 1), "int32", sharding=program.batch_sharding)
    text = program.train_step_fn().lower(program.abstract_state(), batch).as_text()
    return collectives.parse(text)


def _nonscalar(found, kind):
    return [c for c in found if c.kind == kind and c.shape]


def test_single_device_has_no_collectives():
    assert _step_collectives({}) == []


def test_data_parallel_all_reduces_gradients():
    found = _step_collectives(dict(data=8))
    assert collectives.kinds_by_axes(found) == {("all_reduce", ("data",))}
    assert len(_nonscalar(found, "all_reduce")) >= 10  # one per gradient leaf (at least)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stages(stage):
    found = _step_collectives(dict(data=8), zero_stage=stage)
    kinds = collectives.kinds_by_axes(found)
    assert ("all_gather", ("data",)) in kinds  # updated slices gathered back
    if stage == 2:  # gradients reduce-scattered; only scalars (loss, norm) are all-reduced
        assert ("reduce_scatter", ("data",)) in kinds
        assert _nonscalar(found, "all_reduce") == []
    else:  # gradients all-reduced, then sliced locally
        assert ("reduce_scatter", ("data",)) not in kinds
        assert len(_nonscalar(found, "all_reduce")) >= 10


def test_fsdp_gathers_weights_and_reduce_scatters_gradients():
    found = _step_collectives(dict(fsdp=8))
    kinds = collectives.kinds_by_axes(found)
    assert {("all_gather", ("fsdp",)), ("reduce_scatter", ("fsdp",))} <= kinds
    assert _nonscalar(found, "all_reduce") == []  # every leaf is fsdp-sharded


def test_tensor_parallel_all_reduces_activations():
    found = _step_collectives(dict(tensor=8), n_kv_heads=8)
    assert collectives.kinds_by_axes(found) == {("all_reduce", ("tensor",))}
    activations = [c for c in found if c.kind == "all_reduce" and c.shape == (8, 32, 64)]
    assert activations  # [B, T, D] partial sums of the row-parallel matmuls


def test_sequence_parallel_replaces_activation_all_reduces():
    found = _step_collectives(dict(tensor=8), sp=True, n_kv_heads=8)
    kinds = collectives.kinds_by_axes(found)
    assert {("all_gather", ("tensor",)), ("reduce_scatter", ("tensor",))} <= kinds
    assert not [c for c in found if c.kind == "all_reduce" and len(c.shape) == 3]
    gathers = [c for c in found if c.kind == "all_gather"]
    assert all(c.shape == (8, 32 // 8, 64) for c in gathers)  # [B, T/tp, D] in
