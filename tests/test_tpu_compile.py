"""Every parallel layout of the parity suite compiles with the TPU compiler (libtpu, ahead of time,
no TPU): the same configs the parity tests check against one device on CPU, built by those tests'
own tables, compiled for a v5p slice with as many chips as the layout has devices. Also the two
things refused on CPU because XLA:CPU cannot run them: ring / TokenRing context parallelism under a
pipeline, and the ragged all-to-all expert dispatch.

Compiling checks what the TPU compiler accepts (shapes, shardings, collectives, memory); numerics
are the parity tests' job, on CPU. The train step is compiled as training runs it (rolled scan,
donated state).
"""

import numpy as np
import pytest

from jaxsys import train
from jaxsys.analysis import report, targets
from jaxsys.mesh import make_mesh
from jaxsys.parallel import context
from tests import test_context, test_expert_parallel, test_parity, test_pipeline, test_pipeline_composed
from tests.helpers import pipeline_config, small_config

TOPOLOGY = "v5p:2x2x2"  # 8 chips; a layout of n devices takes the first n of them


@pytest.fixture(scope="module")
def tpu_devices():
    return targets.devices(targets.parse(TOPOLOGY))


def _ragged(make):
    def build():
        c = make()
        c.parallel.expert_dispatch = "ragged"
        return c

    return build


def _ring_under_pipeline(variant):
    def build():
        c = pipeline_config(dict(pipe=2, seq=2, tensor=2), "1f1b", 2)
        c.model.context_parallel = variant
        return c

    return build


def _layouts():
    cases = {}
    for name, (mesh, opts, model) in test_parity.LAYOUTS.items():
        cases[f"parity-{name}"] = lambda a=(mesh, opts, model): test_parity._configure(*a)
    for layout, mesh in test_context.LAYOUTS.items():
        for variant in context.VARIANTS:
            cases[f"cp-{layout}-{variant}"] = lambda m=mesh, v=variant: small_config(
                m, context_parallel=v, context_load_balance=True
            )
        cases[f"cp-{layout}-lasp2"] = lambda m=mesh: small_config(
            m, layer_pattern="linear,softmax", linear_chunk=8, context_parallel="allgather"
        )
    for name, (pipe, schedule, m, v) in test_pipeline.CASES.items():
        cases[f"pipe-{name}"] = lambda a=(dict(pipe=pipe), schedule, m, v): pipeline_config(*a)
    for name in test_pipeline_composed.CASES:
        cases[f"pipe-composed-{name}"] = lambda n=name: test_pipeline_composed.configure(n)[0]
    for name, (mesh, sp, moe) in test_expert_parallel.LAYOUTS.items():
        make = lambda a=(mesh, sp), kw=moe: test_expert_parallel.moe_config(*a, **kw)
        cases[f"ep-{name}"] = make
        if not moe.get("capacity_factor"):  # the dropless path is the one with a ragged dispatch
            cases[f"ep-ragged-{name}"] = _ragged(make)
    # the Pallas kernels (their Mosaic variants on TPU), alone and under ring context parallelism
    cases["pallas-data2-tensor4"] = lambda: small_config(
        dict(data=2, tensor=4), n_kv_heads=4, attention_impl="pallas", attention_block=16
    )
    cases["pallas-seq8-ring"] = lambda: small_config(
        dict(seq=8), attention_impl="pallas", attention_block=16, context_parallel="ring"
    )
    cases["pallas-hybrid-data2-tensor4"] = lambda: small_config(  # both kernels, as test_attention_impl
        dict(data=2, tensor=4),
        layer_pattern="linear,softmax",
        n_kv_heads=4,
        attention_impl="pallas",
        attention_block=16,
        linear_chunk=16,
    )
    cases["pallas-hybrid-seq2-tensor2-data2-lasp2"] = lambda: small_config(
        dict(seq=2, tensor=2, data=2),
        layer_pattern="linear,softmax",
        linear_chunk=8,
        context_parallel="allgather",
        attention_impl="pallas",
    )
    cases["pipe2-seq2-tensor2-ring"] = _ring_under_pipeline("ring")
    cases["pipe2-seq2-tensor2-tokenring"] = _ring_under_pipeline("tokenring")
    return cases


LAYOUTS = _layouts()
# By default one layout of each family compiles for the TPU (about 70 s here); the other layouts
# are `slow` (their CPU parity tests run by default; 4-140 s each on the TPU compiler, 15 min in all).
DEFAULT = {
    "parity-data2_fsdp2_tensor2_hybrid",
    "parity-tensor8_sp",
    "cp-seq2_tensor2_data2-ring",
    "pipe-pipe2_1f1b",
    "pipe-composed-pipe2_data2_tensor2_1f1b",
    "ep-ep4_data2",
    "ep-ragged-ep4_data2",
    "pallas-data2-tensor4",
    "pallas-hybrid-data2-tensor4",
}
assert DEFAULT <= set(LAYOUTS)
SLOW = set(LAYOUTS) - DEFAULT


def compile_on_tpu(config, devices):
    """The train step of `config` compiled for the first devices of `devices` (any target)."""
    n = int(np.prod([config.mesh[a] for a in config.mesh]))
    program = train.build(config, make_mesh(config, devices[:n]))
    with targets.quiet_libtpu():
        return program.train_step_fn().lower(program.abstract_state(), report._batch(program)).compile()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_layout_compiles_for_tpu(name, tpu_devices):
    config = LAYOUTS[name]()
    compiled = compile_on_tpu(config, tpu_devices)
    text = compiled.as_text()
    stats = compiled.memory_analysis()
    assert stats.temp_size_in_bytes > 0 and stats.argument_size_in_bytes > 0
    if config.parallel.expert_dispatch == "ragged":  # the TPU runs the op XLA:CPU lacks
        assert "ragged-all-to-all" in text
    if config.mesh.pipe > 1 and config.mesh.seq > 1 and config.model.context_parallel != "allgather":
        assert "collective-permute" in text
    if config.model.attention_impl == "pallas":  # the Mosaic kernels, chosen by platform
        assert 'custom_call_target="tpu_custom_call"' in text
