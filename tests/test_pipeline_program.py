"""The lockstep programs that the pipeline executor runs (jaxsys/parallel/pipeline.py `lockstep`):
every action once, dependencies in earlier ticks, buffer slots that always hold the right
micro-batch, and their sizes and lockstep times in closed form. Pure Python: no devices."""

import itertools
import re

import pytest

from jaxsys.parallel import pipeline as PL
from jaxsys.parallel import schedules as S

CASES = [
    (name, p, m, v)
    for p in (2, 4, 8)
    for m in (p, 2 * p, 4 * p)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("eager_1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3))
]


def _programs():
    for (name, p, m, v), backward, vp in itertools.product(CASES, (True, False), (False, True)):
        yield PL.lockstep(PL.make_schedule(name, p, m, v), backward=backward, vocab_parallel=vp)


def test_every_action_runs_once_after_its_dependency():
    for prog in _programs():
        last = prog.p * prog.v - 1
        ran = {}
        for t in range(prog.ticks):
            for d in range(prog.p):
                for a in (prog.forward[t][d], prog.backward[t][d]):
                    if a is None:
                        continue
                    assert a.stage % prog.p == d
                    key = (a.kind, a.microbatch, a.stage)
                    assert key not in ran, key
                    ran[key] = t
        kinds = ("F", "B") if prog.has_backward else ("F",)
        assert set(ran) == {(k, i, s) for k in kinds for i in range(prog.m) for s in range(last + 1)}
        for (kind, i, s), t in ran.items():
            need = (
                (("F", i, s - 1) if s > 0 else None)
                if kind == "F"
                else (("B", i, s + 1) if s < last else ("F", i, last))
            )
            assert need is None or ran[need] < t, (prog.name, kind, i, s)


def _replay(prog):
    """Run the tables on symbols: every read must find the value of its own (micro-batch, stage).
    Returns the peak number of live stage inputs per device."""
    p, spare_a, spare_g, last = prog.p, prog.act_slots, prog.grad_slots, prog.p * prog.v - 1
    tb = prog.tables
    act, grad = [dict() for _ in range(p)], [dict() for _ in range(p)]
    for t in range(prog.ticks):
        out_f, out_b, stash = [None] * p, [None] * p, [None] * p
        for d in range(p):
            f, b = prog.forward[t][d], prog.backward[t][d]
            if f is not None:
                i, s = f.microbatch, f.stage
                assert tb["f_kind"][t, d] == (PL.FIRST if s == 0 else PL.LAST if s == last else PL.MID)
                assert (tb["f_mb"][t, d], tb["f_chunk"][t, d]) == (i, f.chunk)
                if s > 0:
                    assert act[d].get(tb["f_slot"][t, d]) == ("x", i, s)
                else:
                    stash[d] = ("x", i, 0)
                out_f[d] = ("x", i, s + 1) if s < last else ("h", i)
                assert (tb["out_mb"][t] == i) == (s == last and prog.vocab_parallel)
                assert (tb["embed_mb"][t] == i) == (s == 0 and prog.vocab_parallel)
            else:
                assert tb["f_kind"][t, d] == PL.NONE
            if b is not None:
                i, s = b.microbatch, b.stage
                assert act[d].get(tb["b_act"][t, d]) == ("x", i, s)
                if s < last or prog.vocab_parallel:
                    assert grad[d].get(tb["b_grad"][t, d]) == ("g", i, s)
                out_b[d] = ("g", i, s - 1)
                assert (tb["embed_bwd_mb"][t] == i) == (s == 0 and prog.vocab_parallel)
            else:
                assert tb["b_kind"][t, d] == PL.NONE
        for d in range(p):  # end of tick: the writes
            if tb["recv_act"][t, d] != spare_a:
                sent = out_f[(d - 1) % p]
                assert sent is not None and sent[0] == "x" and tb["send_fwd"][t]
                act[d][tb["recv_act"][t, d]] = sent
            if tb["f_stash"][t, d] != spare_a:
                act[d][tb["f_stash"][t, d]] = stash[d]
            if tb["recv_grad"][t, d] != spare_g:
                sent = out_b[(d + 1) % p]
                assert sent is not None and sent[2] >= 0 and tb["send_bwd"][t]
                grad[d][tb["recv_grad"][t, d]] = sent
            if tb["own_grad"][t, d] != spare_g:
                assert prog.vocab_parallel and out_f[d][0] == "h"
                grad[d][tb["own_grad"][t, d]] = ("g", out_f[d][1], last)


def test_buffer_slots_always_hold_the_right_microbatch():
    for prog in _programs():
        _replay(prog)


def _live_inputs(prog, d):
    """Most stage inputs device d must hold at a tick boundary, from the action tables alone."""
    ran = {}
    for t in range(prog.ticks):
        for a in (prog.forward[t][d], prog.backward[t][d]):
            if a is not None:
                ran[(a.kind, a.microbatch, a.stage)] = t
    # (i, s) lives from its arrival to its last use; arrival = its producer's tick
    producer = {}
    for t in range(prog.ticks):
        for dd in range(prog.p):
            a = prog.forward[t][dd]
            if a is not None and (a.stage + 1) % prog.p == d and a.stage + 1 < prog.p * prog.v:
                producer[(a.microbatch, a.stage + 1)] = t
    for (kind, i, s), t in ran.items():
        if kind == "F" and s == 0 and prog.has_backward:
            producer[(i, 0)] = t
    use = {(i, s): ran[("B" if prog.has_backward else "F", i, s)] for (i, s) in producer}
    return max(sum(producer[k] <= t < use[k] for k in producer) for t in range(prog.ticks))


def test_slots_are_the_most_live_inputs_and_1f1b_keeps_its_bound():
    for name, p, m, v in CASES:
        prog = PL.lockstep(PL.make_schedule(name, p, m, v))
        assert prog.act_slots == max(_live_inputs(prog, d) for d in range(p))
        if name == "gpipe":
            assert prog.act_slots == m
        if name == "1f1b":  # Megatron's bound survives the lockstep packing
            assert prog.act_slots == p
        if name == "eager_1f1b":
            assert prog.act_slots == min(m, 2 * p - 1)


@pytest.mark.parametrize("b", (1, 2, 3))
def test_lockstep_time(b):
    # GPipe and eager 1F1B both take (m + p - 1)(1 + b), the asynchronous makespan; Megatron's 1F1B
    # order, whose p-d-1 warm-up is too short for lockstep, takes longer once m > p.
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            gpipe = PL.lockstep_time(PL.lockstep(S.gpipe(p, m)), b)
            eager = PL.lockstep_time(PL.lockstep(S.eager_one_f_one_b(p, m)), b)
            megatron = PL.lockstep_time(PL.lockstep(S.one_f_one_b(p, m)), b)
            assert gpipe == eager == (m + p - 1) * (1 + b)
            assert megatron >= gpipe and (m == p or megatron > gpipe)
            # Megatron's interleaved warm-up keeps its table's bubble in lockstep too: the v m
            # chunk-sized forwards and backwards plus (p-1) chunk-sized ticks of each
            for v in (2, 3, 4):
                interleaved = PL.lockstep_time(PL.lockstep(S.interleaved_one_f_one_b(p, m, v)), b)
                assert interleaved == (v * m + p - 1) * (1 + b), (p, m, v)


def test_render_shows_fused_ticks():
    text = PL.render(PL.lockstep(S.eager_one_f_one_b(2, 4)))
    assert "ticks=7" in text and "act_slots=3" in text
    assert re.search(r"dev 1: \.\s+F0\s+F1\+B0", text), text


def test_unknown_schedule():
    with pytest.raises(ValueError, match="choose gpipe, 1f1b, eager_1f1b or interleaved_1f1b"):
        PL.make_schedule("zero_bubble", 2, 4)
