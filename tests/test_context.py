"""Context parallelism over `seq`: ring, all-gather and TokenRing attention, zigzag load balance, and
LASP-2 for linear attention, against the single-device model; their communication against the
cost model's formulas.

Tolerance: the blockwise softmax (merged by log-sum-exp), LASP-2's chunk-state scan and the split
gradient sums reorder fp32 arithmetic. Losses agree to ~1e-6 relative; a gradient entry is allowed
1e-5 relative plus 2e-5 of its leaf's largest entry (entries built by cancellation carry the
rounding of the large terms: up to ~1.4e-5 of the max seen, for LASP-2). A wrong mask, position,
decay or merge is off by >1e-3 of the max.
"""

import collections

import numpy as np
import pytest

from jaxsys.analysis import collectives, cost_model, report
from jaxsys.config import ConfigError
from jaxsys.parallel import context
from tests.helpers import assert_trees_close_leafwise, program_for, run, small_config

_reference = {}


def _single_device(pattern):
    if pattern not in _reference:
        _reference[pattern] = run(small_config({}, layer_pattern=pattern, linear_chunk=8), steps=0)
    return _reference[pattern]


def _assert_matches(config, pattern):
    ref_loss, ref_grads, _, _ = _single_device(pattern)
    loss, grads, _, _ = run(config, steps=0)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close_leafwise(grads, ref_grads, rtol=1e-5, atol=lambda want: 2e-5 * np.abs(want).max())


LAYOUTS = {"seq8": dict(seq=8), "seq2_tensor2_data2": dict(seq=2, tensor=2, data=2)}


def _softmax_cases():
    """Every (variant, chunks, layout); seq=2 x tensor=2 x data=2 by default (TokenRing contiguous
    only), the rest `slow` (the same code on more devices, 10-45 s each)."""
    for layout in LAYOUTS:
        for balance in (False, True):
            for variant in context.VARIANTS:
                heavy = layout == "seq8" or (variant == "tokenring" and balance)
                ids = f"{variant}-{'zigzag' if balance else 'contiguous'}-{layout}"
                yield pytest.param(variant, balance, layout, id=ids, marks=[pytest.mark.slow] if heavy else [])


@pytest.mark.parametrize("variant,balance,layout", list(_softmax_cases()))
def test_softmax_context_parallel_matches_single_device(variant, balance, layout):
    _assert_matches(small_config(LAYOUTS[layout], context_parallel=variant, context_load_balance=balance), "softmax")


@pytest.mark.parametrize(
    "layout,pattern,balance",
    [
        ("seq8", "linear", False),
        ("seq8", "linear", True),
        ("seq2_tensor2_data2", "linear", False),
        # LASP-2H: the hybrid's softmax layers by all-gather CP, its linear layers by LASP-2
        ("seq2_tensor2_data2", "linear,softmax", True),
    ],
)
def test_lasp2_matches_single_device(layout, pattern, balance):
    _assert_matches(
        small_config(
            LAYOUTS[layout],
            layer_pattern=pattern,
            linear_chunk=8,
            context_parallel="allgather",
            context_load_balance=balance,
        ),
        pattern,
    )


def test_zigzag_balances_causal_work():
    for size in (2, 4, 8):
        work = context.causal_work(size, balance=True, chunk_len=64)
        assert work.max() / work.min() - 1 < 0.05, work
        # without it the last device does ~2P-1 times the first's work: the check can fail
        unbalanced = context.causal_work(size, balance=False, chunk_len=64)
        assert unbalanced.max() / unbalanced.min() - 1 > 0.05
    # the counts are the visible pairs of a causal mask: all devices together see T(T+1)/2
    t = 8 * 2 * 64
    assert context.causal_work(8, True, 64).sum() == t * (t + 1) // 2


def test_sequence_assignment_and_positions():
    table = context.chunk_table(4, balance=True)
    assert table.tolist() == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert sorted(table.reshape(-1).tolist()) == list(range(8))
    assert context.chunk_table(4, balance=False).reshape(-1).tolist() == [0, 1, 2, 3]


def _measured(config):
    program = program_for(config)
    sizes = dict(program.layout.mesh_sizes)
    found = collectives.parse(report.lower_unrolled(program).as_text(), sizes)
    seq_ops = [
        c for c in found if c.axes == ("seq",) and c.kind in ("collective_permute", "all_gather", "reduce_scatter")
    ]
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for c in seq_ops:
        n = sizes["seq"]
        by_kind[c.kind][0] += 1
        by_kind[c.kind][1] += cost_model.ring_bytes(c.kind, c.operand_bytes, n)
    return dict(by_kind), found


def _formula(config):
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for row in cost_model.context_parallel_rows(config):
        by_kind[row.kind][0] += row.count
        by_kind[row.kind][1] += row.bytes
    return dict(by_kind)


@pytest.mark.parametrize(
    "variant,pattern,remat,dtype",
    [
        ("ring", "softmax", "none", "float32"),
        ("ring", "softmax", "full", "float32"),
        ("ring", "softmax", "none", "bfloat16"),
        ("allgather", "softmax", "none", "bfloat16"),
        ("tokenring", "softmax", "none", "bfloat16"),
        ("allgather", "linear", "none", "float32"),
        ("allgather", "linear", "full", "float32"),
    ],
)
def test_communication_equals_the_formula(variant, pattern, remat, dtype):
    config = small_config(
        dict(seq=8), context_parallel=variant, layer_pattern=pattern, remat=remat, linear_chunk=8, compute_dtype=dtype
    )
    measured, _ = _measured(config)
    formula = _formula(config)
    assert set(measured) == set(formula), (measured, formula)
    for kind in formula:
        assert measured[kind][0] == formula[kind][0], (kind, measured, formula)
        assert measured[kind][1] == pytest.approx(formula[kind][1], rel=1e-9), (kind, measured, formula)


def test_lasp2_one_state_all_gather_per_layer_independent_of_length():
    sizes = []
    for seq_len in (32, 128):
        config = small_config(dict(seq=8), layer_pattern="linear", linear_chunk=8)
        config.data.seq_len = seq_len
        _, found = _measured(config)
        gathers = [c for c in found if c.kind == "all_gather" and c.axes == ("seq",)]
        assert len(gathers) == config.model.n_layers  # one per linear layer forward
        sizes.append({c.shape for c in gathers})
    assert sizes[0] == sizes[1]  # [c, B, N, H, H]: the same at 4x the sequence


def test_bad_context_parallel_settings_are_named():
    with pytest.raises(ConfigError, match="not divisible into the 16 chunks"):
        c = small_config(dict(seq=8))
        c.data.seq_len = 40
        program_for(c)
    with pytest.raises(ConfigError, match="context_parallel='ulysses'"):
        program_for(small_config(dict(seq=8), context_parallel="ulysses"))
    with pytest.raises(ConfigError, match="'cudnn' cannot run context parallelism"):
        program_for(small_config(dict(seq=8), attention_impl="cudnn"))


@pytest.mark.slow
def test_ring_with_the_pallas_kernel_matches_single_device():
    """The ring's forward and custom backward through the flash kernel's block entry points
    (interpret mode): seq=2, contiguous, so one causal and one full block per device."""
    _assert_matches(
        small_config(
            dict(seq=2, data=4),
            context_parallel="ring",
            context_load_balance=False,
            attention_impl="pallas",
            attention_block=16,
        ),
        "softmax",
    )
