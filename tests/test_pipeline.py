"""Pipeline parallelism over `pipe` alone: every schedule gives the single-device loss and gradients
with pipe=2 and pipe=4 (jaxsys/parallel/pipeline.py), and bad pipeline configs fail early.

Tolerances: a pipeline adds the fp32 gradients of m micro-batches (in schedule order) where the
single device sums all tokens at once; the reassociation moves results by a few ulps of the partial
sums (~1e-7 absolute was seen on gradients of size ~1e-2). A lost or doubled micro-batch or stage
is off by >= 1/m of a gradient, orders of magnitude above rtol 1e-5 / atol 2e-7.
"""

import numpy as np
import pytest

from jaxsys.config import ConfigError, validate
from tests.helpers import assert_trees_close_leafwise, loss_and_grads, pipeline_config, program_for

_reference = {}


def reference(**model):
    key = tuple(sorted(model.items()))
    if key not in _reference:
        _reference[key] = loss_and_grads(pipeline_config(microbatches=1, **model))
    return _reference[key]


def assert_matches(got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    # plus 1e-5 of the leaf's largest entry for entries built by cancellation (tests/test_parity.py)
    assert_trees_close_leafwise(grads, ref_grads, rtol=1e-5, atol=lambda w: max(2e-7, 1e-5 * np.abs(w).max()))


CASES = {  # name: (pipe, schedule, micro-batches, virtual stages)
    "pipe2_gpipe": (2, "gpipe", 2, 1),
    "pipe2_1f1b": (2, "1f1b", 4, 1),
    "pipe2_eager_1f1b": (2, "eager_1f1b", 4, 1),
    "pipe2_interleaved_v2": (2, "interleaved_1f1b", 4, 2),
    "pipe4_gpipe": (4, "gpipe", 4, 1),
    "pipe4_1f1b": (4, "1f1b", 8, 1),
    "pipe4_eager_1f1b": (4, "eager_1f1b", 4, 1),
    "pipe4_interleaved_v2": (4, "interleaved_1f1b", 4, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_matches_single_device(name):
    pipe, schedule, m, v = CASES[name]
    got = loss_and_grads(pipeline_config(dict(pipe=pipe), schedule, m, v))
    assert_matches(got, reference())


def test_gradient_accumulation_without_pipeline_matches():
    assert_matches(loss_and_grads(pipeline_config(dict(data=2), microbatches=4)), reference())


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(n_layers=6, mesh=dict(pipe=4)), "n_layers=6 does not split into 4 pipeline stages"),
        (
            dict(n_layers=8, mesh=dict(pipe=4), virtual_stages=4, schedule="interleaved_1f1b", m=4),
            "n_layers=8 does not split into 16 pipeline stages",
        ),
        (dict(mesh=dict(pipe=4), m=2), "microbatches=2 is fewer than the 4 pipeline stages"),
        (
            dict(mesh=dict(pipe=4), m=6, batch=12, schedule="interleaved_1f1b", virtual_stages=2),
            "microbatches=6 must be a multiple of 4",
        ),
        (dict(mesh=dict(pipe=2), m=4, virtual_stages=2), "virtual_stages=2 needs config.train.pipeline_schedule"),
        (dict(mesh=dict(pipe=1), m=1, virtual_stages=2), "virtual_stages=2 needs a pipeline"),
        (dict(mesh=dict(pipe=2, data=2), m=3), "batch_size=8 does not split into 2 batch shards x 3"),
        (dict(mesh=dict(pipe=2), m=2, schedule="zero_bubble"), "pipeline_schedule='zero_bubble'"),
        (
            dict(mesh=dict(pipe=2, tensor=2), m=2, vocab_parallel=True, vocab_size=258),
            "vocab_size=258 does not split over the 4 shards of vocabulary parallelism",
        ),
        (dict(mesh=dict(pipe=2), m=2, layer_pattern="linear,softmax", n_layers=6), "not a whole number of periods"),
    ],
)
def test_bad_pipeline_config_is_refused(change, message):
    change = dict(change)
    mesh, m = change.pop("mesh"), change.pop("m", 4)
    schedule, v = change.pop("schedule", "1f1b"), change.pop("virtual_stages", 1)
    batch = change.pop("batch", None)
    c = pipeline_config(mesh, schedule, m, v, change.pop("vocab_parallel", False), **change)
    c.train.batch_size = batch or c.train.batch_size
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(c)


@pytest.mark.parametrize("variant", ["ring", "tokenring"])
def test_ring_context_parallelism_under_a_pipeline_is_refused_on_cpu(variant):
    """XLA:CPU pairs the ring's collective-permutes inside the per-stage branches wrongly; TPU and
    GPU compile it (tests/test_tpu_compile.py), so the refusal is by platform, in train.build."""
    c = pipeline_config(dict(pipe=2, seq=2), microbatches=2, context_parallel=variant)
    validate(c)
    with pytest.raises(ConfigError, match="use 'allgather' with a pipeline here"):
        program_for(c)


def test_layers_rule_must_be_pipe():
    c = pipeline_config(dict(pipe=2))
    c.sharding.params.layers = c.sharding.compute.layers = ""
    with pytest.raises(ConfigError, match="set it \\(and .compute.layers\\) to 'pipe'"):
        validate(c)
