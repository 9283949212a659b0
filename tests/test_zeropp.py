"""ZeRO++ (parallel/zeropp.py, docs/zeropp.md) on data=2 x fsdp=4, the tiny model in fp32.

- hpZ sums the same gradients in the same order as ZeRO-3 over fsdp with ZeRO-2 over data (the
  layers' reduce-scatter over fsdp, then one over data): the step-0 loss and gradients and the
  losses of two steps are bitwise equal. Against ZeRO-3 over fsdp x data (one reduce-scatter over
  all 8 ranks) the loss is bitwise equal and the gradients differ by the order of the 8-term sums.
- qwZ, qgZ: int8 with one absmax scale per row has a step of (row's absmax) / 127, an error of at
  most half of it per element; int4 qgZ a step of (row's absmax) / 7. Tolerances (relative to the
  leaf's largest entry) are stated below.
- Bytes per link class: the analysis formula equals the compiled (XLA:CPU) step's collectives, and
  both equal the closed form from the parameter count.
"""

import math

import jax
import numpy as np
import pytest

from jaxsys import data
from jaxsys.analysis import hlo
from jaxsys.analysis import zeropp as analysis
from jaxsys.config import ConfigError, validate
from jaxsys.models import transformer
from tests.helpers import program_for, run, small_config

MESH = dict(data=2, fsdp=4)


def _config(embed="fsdp,data", hpz=False, qwz=False, qgz=False, stage=0, lora=0, bits=8):
    c = small_config(MESH)
    c.lora.rank = lora
    c.sharding.params.embed = embed
    c.train.zero_stage = stage
    c.parallel.zeropp_hpz, c.parallel.zeropp_qwz, c.parallel.zeropp_qgz = hpz, qwz, qgz
    c.parallel.zeropp_qgz_bits = bits
    return c


def _prefetch(c):
    c.parallel.fsdp_prefetch = True
    return c


VARIANTS = {
    "zero3_fsdp_zero2_data": lambda: _config("fsdp", stage=2),
    "zero3": lambda: _config(),
    "hpz": lambda: _config(hpz=True),
    "hpz_prefetch": lambda: _prefetch(_config(hpz=True)),
    "hpz_qwz": lambda: _config(hpz=True, qwz=True),
    "hpz_qwz_qgz": lambda: _config(hpz=True, qwz=True, qgz=True),
    "hpz_qwz_qgz4": lambda: _config(hpz=True, qwz=True, qgz=True, bits=4),
}


STEPPED = ("zero3_fsdp_zero2_data", "hpz")  # the others: step-0 loss and gradients only


def _loss_grads_and_bytes(config):
    """Step-0 loss and gradients, and the bytes per link class of the compiled (XLA:CPU) program
    that computed them (the step's collectives: its update communicates nothing more at stage 0)."""
    program = program_for(config)
    corpus = data.load_corpus(config.data)
    batch = data.global_batch(
        corpus, program.batch_sharding, config.seed, 0, config.train.batch_size, config.data.seq_len
    )
    params = program.init().params
    compiled = program.loss_and_grads_fn().lower(params, batch).compile()
    loss, grads = compiled(params, batch)
    found = hlo.parse(compiled.as_text()).collectives({a: config.mesh[a] for a in config.mesh})
    return float(loss), jax.tree.map(np.asarray, grads), analysis.hlo_link_bytes(found)


@pytest.fixture(scope="module")
def runs():
    return {
        name: run(make(), steps=2) if name in STEPPED else _loss_grads_and_bytes(make())
        for name, make in VARIANTS.items()
    }


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _max_error(got, want) -> float:
    """Largest |got - want| over the leaves, relative to each leaf's largest |want|."""
    return max(float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for g, w in zip(_leaves(got), _leaves(want)))


def test_hpz_bitwise_equals_zero3_fsdp_with_zero2_data(runs):
    loss, grads, losses, state = runs["hpz"]
    ref_loss, ref_grads, ref_losses, ref_state = runs["zero3_fsdp_zero2_data"]
    assert loss == ref_loss
    for g, r in zip(_leaves(grads), _leaves(ref_grads)):
        np.testing.assert_array_equal(g, r)
    np.testing.assert_array_equal(losses, ref_losses)
    # the master weights: ZeRO-3 over every rank (fsdp major, data minor)
    assert state.params["layers"]["w_up"].sharding.spec[1] == ("fsdp", "data")
    # after the updates: equal up to the optimizer's elementwise fusion (a few ulps)
    assert _max_error(state.params, ref_state.params) < 1e-6


def test_hpz_with_fsdp_prefetch_is_bitwise_hpz(runs):
    loss, grads, _ = runs["hpz_prefetch"]
    assert loss == runs["hpz"][0]
    for g, r in zip(_leaves(grads), _leaves(runs["hpz"][1])):
        np.testing.assert_array_equal(g, r)


def test_hpz_matches_zero3_over_fsdp_and_data(runs):
    loss, grads, _, _ = runs["hpz"]
    ref_loss, ref_grads, _ = runs["zero3"]
    assert loss == ref_loss  # the same weights reach the layers
    assert _max_error(grads, ref_grads) < 1e-6  # 8-term sums in two hops instead of one


def test_quantized_weight_gather_and_gradient_reduce_scatter(runs):
    loss, grads, _, _ = runs["hpz"]
    qw_loss, qw_grads, _ = runs["hpz_qwz"]
    qg_loss, qg_grads, _ = runs["hpz_qwz_qgz"]
    # qwZ: weights within half an int8 step (0.4% of a row's absmax) move the loss by far less
    assert qw_loss != loss and abs(qw_loss - loss) < 1e-3 * loss
    # the gradients at the perturbed weights: a few percent of each leaf's largest entry
    assert 0 < _max_error(qw_grads, grads) < 0.1
    # qgZ alone (same forward): two int8-rounded partials, each off by at most 1/254 of its row's
    # absmax; bounded by 2 / 254 of the leaf's largest partial, taken as 2.5x the total's here
    assert qg_loss == qw_loss
    assert 0 < _max_error(qg_grads, qw_grads) < 2.5 * 2 / 254
    # int4 qgZ (codes packed two to a byte): each partial off by at most 1/14 of its row's absmax,
    # bounded the same way; coarser than int8 (a check that int4 codes were sent)
    q4_loss, q4_grads, _ = runs["hpz_qwz_qgz4"]
    assert q4_loss == qw_loss
    assert 2 * _max_error(qg_grads, qw_grads) < _max_error(q4_grads, qw_grads) < 2.5 * 2 / 14


def _rows(c) -> dict:
    """Per device, over the leaves of 2 or more dims: `s` elements of the local shards (embed split
    over fsdp x data) and `r` rows (one scale each: the rows run along the last dim other than
    embed's); `flat`: the 1-D leaves' fp32 bytes in the data reduce-scatter, (d - 1) s 4."""
    n, d = MESH["fsdp"] * MESH["data"], MESH["data"]
    out = dict(s=0, r=0, flat=0)
    for spec in jax.tree.leaves(transformer.param_specs(c.model), is_leaf=lambda x: hasattr(x, "axes")):
        dim = spec.axes.index("embed")
        local = tuple(x // n if i == dim else x for i, x in enumerate(spec.shape))
        if len(local) == 1:
            out["flat"] += (d - 1) * local[0] * 4
            continue
        row = local[-1] if dim != len(local) - 1 else local[-2]
        out["s"] += math.prod(local)
        out["r"] += math.prod(local) // row
    return out


def test_bytes_per_link_class_formula_and_hlo(runs):
    c = _config()
    specs = transformer.param_specs(c.model)
    layer = sum(math.prod(s.shape) for s in jax.tree.leaves(specs["layers"], is_leaf=lambda x: hasattr(x, "axes")))
    total = sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=lambda x: hasattr(x, "axes")))
    f, d, b = MESH["fsdp"], MESH["data"], 4  # fp32 compute
    n = f * d
    # ZeRO-3 over all 8 ranks: all-gather (forward; again in the backward for the layers), reduce-scatter
    zero3 = {"intra": 0.0, "inter": (n - 1) / n * b * (3 * layer + 2 * (total - layer))}
    # hpZ: one all-gather and one reduce-scatter over data of the 1/n shards; the rest over fsdp
    hpz = {
        "intra": (f - 1) / f * b * (3 * layer + 2 * (total - layer)),
        "inter": 2 * (d - 1) * total / n * b,
    }
    assert analysis.link_bytes(c) == pytest.approx(zero3)
    # the same ZeRO-3 collectives run hierarchically: the data hop of the shards, then fsdp
    assert analysis.link_bytes(c, hierarchical=True) == pytest.approx(
        {"intra": hpz["intra"], "inter": (d - 1) / n * b * (3 * layer + 2 * (total - layer))}
    )
    assert analysis.link_bytes(_config(hpz=True)) == pytest.approx(hpz)
    quantized = analysis.link_bytes(_config(hpz=True, qwz=True, qgz=True))
    assert quantized["intra"] == pytest.approx(hpz["intra"])
    assert quantized["inter"] < 0.3 * hpz["inter"]  # int8 codes + scales for fp32
    # int4 qgZ: the gradient half of the data traffic shrinks by (s / 2 + 4 r) / (s + 4 r); every
    # quantized leaf of the test model has even rows (zeropp.grad_bits), its 1-D leaves go as fp32
    int4 = analysis.link_bytes(_config(hpz=True, qwz=True, qgz=True, bits=4))
    half = analysis.link_bytes(_config(hpz=True, qwz=True))["inter"] - hpz["inter"] / 2  # the qwZ gather
    rows = _rows(c)
    assert int4["inter"] - half == pytest.approx((d - 1) * (rows["s"] / 2 + 4 * rows["r"]) + rows["flat"])
    assert quantized["inter"] - half == pytest.approx((d - 1) * (rows["s"] + 4 * rows["r"]) + rows["flat"])
    for name in ("zero3", "hpz_qwz", "hpz_qwz_qgz", "hpz_qwz_qgz4"):
        assert runs[name][2] == pytest.approx(analysis.link_bytes(VARIANTS[name]()))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(embed="fsdp", hpz=True), r"zeropp_hpz needs ZeRO-3 over fsdp and data: set config.sharding.params.embed"),
        (dict(qwz=True), r"zeropp_qwz=True quantizes hpZ's `data` collectives: set config.parallel.zeropp_hpz"),
        (dict(stage=2), r"zero_stage=2 with `data` in config.sharding.params.embed.*set zero_stage=0"),
        (dict(embed="data,fsdp"), r"with `data` write 'fsdp,data'"),
        (dict(hpz=True, lora=4), r"zeropp_hpz is for the transformer's non-pipelined full training step.*lora.rank=0"),
        (dict(hpz=True, qgz=True, bits=2), r"zeropp_qgz_bits=2: choose 8 or 4"),
        (dict(hpz=True, bits=4), r"zeropp_qgz_bits=4 sets qgZ's codes: set config.parallel.zeropp_qgz=True"),
    ],
)
def test_bad_zeropp_config_is_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        validate(_config(**change), 8)
