"""Pipeline schedules (jaxsys/parallel/schedules.py): every schedule is complete and respects its
dependencies, and its bubble and stored activations equal the closed forms of GPipe, PipeDream-flush
(1F1B) and Megatron's interleaved 1F1B exactly. Pure Python: no devices, no compilation."""

import dataclasses
import re
from fractions import Fraction

import pytest

from jaxsys.parallel import schedules as S

PS = (2, 4, 8)


def _ms(p):
    return (p, p + 1, 2 * p, 3 * p, 4 * p)


def _ms_interleaved(p):
    return (p, 2 * p, 3 * p, 4 * p)


def _all(p, backward_cost=2):
    out = []
    for m in _ms(p):
        out += [
            S.gpipe(p, m, backward_cost),
            S.one_f_one_b(p, m, backward_cost),
            S.eager_one_f_one_b(p, m, backward_cost),
        ]
    for m in _ms_interleaved(p):
        out += [S.interleaved_one_f_one_b(p, m, v, backward_cost) for v in (2, 4)]
    return out


@pytest.mark.parametrize("p", (1,) + PS)
def test_every_schedule_validates(p):
    for s in _all(p):
        S.validate(s)  # simulate validates too; this states it
        work = {(a.kind, a.microbatch, a.stage) for row in s.actions for a in row if a}
        assert len(work) == 2 * s.m * s.v * s.p


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("backward_cost", (1, 2, 3))
def test_bubble_fraction_equals_the_formulas(p, backward_cost):
    # Megatron (Narayanan et al. 2021): bubble / ideal time = (p-1)/m, and (p-1)/(v m) interleaved;
    # as a fraction of the whole iteration that is (p-1)/(m+p-1), and (p-1)/(v m + p - 1).
    for m in _ms(p):
        assert S.bubble_fraction(S.gpipe(p, m, backward_cost)) == Fraction(p - 1, m + p - 1)
        assert S.bubble_fraction(S.one_f_one_b(p, m, backward_cost)) == Fraction(p - 1, m + p - 1)
        assert S.bubble_fraction(S.eager_one_f_one_b(p, m, backward_cost)) == Fraction(p - 1, m + p - 1)
    for m in _ms_interleaved(p):
        for v in (2, 4):
            s = S.interleaved_one_f_one_b(p, m, v, backward_cost)
            assert S.bubble_fraction(s) == Fraction(p - 1, v * m + p - 1), (p, m, v)


def test_ticks_are_work_plus_bubble():
    # each device does m v (1 + b) ticks of work; the makespan adds (p-1)(1+b) (Megatron's t_pb)
    p, m, v, b = 4, 8, 2, 2
    assert S.gpipe(p, m).ticks == S.one_f_one_b(p, m).ticks == (m + p - 1) * (1 + b)
    assert S.interleaved_one_f_one_b(p, m, v).ticks == (v * m + p - 1) * (1 + b)


@pytest.mark.parametrize("p", PS)
def test_in_flight_activations(p):
    for m in _ms(p):
        assert S.peak_in_flight(S.gpipe(p, m)) == (m,) * p
        one = S.peak_in_flight(S.one_f_one_b(p, m))
        assert one == tuple(p - d for d in range(p)) and max(one) == p
        # eager: its 2(p-d)-1 warm-up forwards plus the first steady one, never more than m
        assert S.peak_in_flight(S.eager_one_f_one_b(p, m)) == tuple(min(m, 2 * (p - d)) for d in range(p))
    for m in _ms_interleaved(p):
        for v in (2, 4):
            got = S.peak_in_flight(S.interleaved_one_f_one_b(p, m, v))
            # Megatron's warm-up, (v-1) p + 2 (p-d-1) forwards, plus the first steady forward
            assert got == tuple(min(v * m, (v - 1) * p + 2 * (p - d - 1) + 1) for d in range(p))
            # in whole-device micro-batches: device 0 holds p + (p-1)/v once m >= 2p, a little more
            # than 1F1B's p, never more than GPipe's m
            whole = [Fraction(c, v) for c in got]
            assert max(whole) <= m
            if m >= 2 * p:
                assert whole[0] == p + Fraction(p - 1, v)


@pytest.mark.parametrize("p", PS)
def test_interleaving_shrinks_the_bubble(p):
    for m in _ms_interleaved(p):
        base = S.bubble_fraction(S.one_f_one_b(p, m))
        bubbles = [S.bubble_fraction(S.interleaved_one_f_one_b(p, m, v)) for v in (1, 2, 4)]
        assert bubbles[0] == base and base > bubbles[1] > bubbles[2]


def test_one_f_one_b_shape():
    s = S.one_f_one_b(4, 8)
    for d in range(4):
        kinds = "".join(a.kind for _, a in s.device_order(d))
        warm = 4 - d - 1
        assert kinds == "F" * warm + "FB" * (8 - warm) + "B" * warm


def test_interleaved_stages_and_chunks():
    p, v = 4, 2
    s = S.interleaved_one_f_one_b(p, 8, v)
    for d in range(p):
        stages = {a.stage for _, a in s.device_order(d)}
        assert stages == {d + j * p for j in range(v)}
    # the first forwards of device 0: micro-batches 0..p-1 of chunk 0, then of chunk 1
    first = [a.label(v) for _, a in s.device_order(0)[: 2 * p]]
    assert first == ["F0.0", "F1.0", "F2.0", "F3.0", "F0.1", "F1.1", "F2.1", "F3.1"]


@pytest.mark.parametrize(
    "call, constraint",
    [
        (lambda: S.one_f_one_b(4, 3), "m >= p"),
        (lambda: S.interleaved_one_f_one_b(4, 6, 2), "m % p == 0"),
        (lambda: S.interleaved_one_f_one_b(4, 2, 2), "m >= p"),
        (lambda: S.interleaved_one_f_one_b(4, 8, 0), "v >= 1"),
        (lambda: S.gpipe(0, 4), "p >= 1"),
        (lambda: S.one_f_one_b(0, 4), "p >= 1"),
        (lambda: S.interleaved_one_f_one_b(0, 4, 2), "p >= 1"),
        (lambda: S.gpipe(2, 0), "m >= 1"),
        (lambda: S.gpipe(2, 4, backward_cost=0), "backward_cost must be >= 1"),
    ],
)
def test_bad_input_names_the_constraint(call, constraint):
    with pytest.raises(ValueError, match=re.escape(constraint)):
        call()


def test_gpipe_allows_fewer_microbatches_than_stages():
    s = S.gpipe(8, 3)
    assert S.bubble_fraction(s) == Fraction(7, 10) and S.peak_in_flight(s) == (3,) * 8


def _replace(s, tick, device, action):
    rows = [list(r) for r in s.actions]
    rows[tick][device] = action
    return dataclasses.replace(s, actions=tuple(tuple(r) for r in rows))


def test_validate_names_the_violated_dependency():
    s = S.one_f_one_b(2, 2)
    # device 1's F0 moved to tick 0, before device 0 has produced its input
    f0 = s.actions[1][1]
    bad = _replace(_replace(s, 1, 1, None), 0, 1, f0)
    with pytest.raises(
        ValueError,
        match=r"F\(micro-batch 0, stage 1\).* before "
        r"F\(micro-batch 0, stage 0\)",
    ):
        S.validate(bad)
    # a missing backward
    t, b = next((t, a) for t, a in s.device_order(0) if a.kind == "B")
    missing = _replace(_replace(s, t, 0, None), t + 1, 0, None)
    with pytest.raises(ValueError, match="B of micro-batch 0, stage 0 never runs"):
        S.validate(missing)
    # a backward cut short
    with pytest.raises(ValueError, match="2 consecutive ticks"):
        S.validate(_replace(s, t + 1, 0, None))


def test_simulate_rejects_a_deadlocked_order():
    # device 0 wants B0 before F0, but B0 needs the whole forward through both stages first
    orders = [[("B", 0, 0), ("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        S.simulate("bad", 2, 1, 1, orders)


def test_render():
    text = S.render(S.one_f_one_b(2, 2))
    assert text.splitlines()[1:] == [
        "dev 0: F0 F1 .  .  B0 -- .  B1 --",
        "dev 1: .  F0 B0 -- F1 B1 -- .  .",
    ]
    assert "F3.1" in S.render(S.interleaved_one_f_one_b(4, 8, 2))
