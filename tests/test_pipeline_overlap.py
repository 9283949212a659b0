"""Pipeline send/receive overlap (config.parallel.pipeline_overlap, jaxsys/parallel/pipeline.py):

- the lockstep tables with overlap: replayed on symbols in the executor's order (gradients written
  at the start of the tick after their send), every read still finds its own micro-batch;
- the training step with overlap against the same layout without it, for every schedule, with
  vocabulary parallelism and composed with data / FSDP / tensor parallelism: losses and every
  gradient leaf bitwise equal, and equal to one device as tests/test_pipeline.py checks;
- evaluation (the forward-only program) the same;
- the TPU compiler (ahead of time, v5p) schedules the two pipe collective-permutes asynchronously
  with the forward and the backward conditional between their starts and dones; without overlap
  each permute sits alone in a conditional branch (docs/comm_overlap.md);
- a bad value is refused.

Bitwise: overlap changes when a value is sent and written into its slot, not what is computed; the
forward and backward conds get the same operands, and the default path lowers to the same program
as before the option existed.
"""

import re

import chex
import numpy as np
import pytest

from jaxsys.config import ConfigError, validate
from jaxsys.parallel import pipeline as PL
from tests.helpers import loss_and_grads, pipeline_config, program_for
from tests.test_pipeline import assert_matches, reference
from tests.test_pipeline_program import CASES as PROGRAM_CASES

CASES = {  # name: (mesh, schedule, micro-batches, virtual stages, vocab parallel, options)
    "pipe2_gpipe": (dict(pipe=2), "gpipe", 2, 1, False, {}),
    "pipe4_1f1b": (dict(pipe=4), "1f1b", 8, 1, False, {}),
    "pipe4_eager_1f1b": (dict(pipe=4), "eager_1f1b", 4, 1, False, {}),
    "pipe4_interleaved_v2": (dict(pipe=4), "interleaved_1f1b", 4, 2, False, {}),
    "vp_pipe2_interleaved_v2": (dict(pipe=2), "interleaved_1f1b", 4, 2, True, {}),
    "vp_pipe2_data2_tensor2_1f1b": (dict(pipe=2, data=2, tensor=2), "1f1b", 4, 1, True, {}),
    "pipe2_fsdp2_tensor2_sp_eager": (dict(pipe=2, fsdp=2, tensor=2), "eager_1f1b", 2, 1, False, dict(sp=True)),
}


def configure(name, overlap):
    mesh, schedule, m, v, vp, opts = CASES[name]
    c = pipeline_config(mesh, schedule, m, v, vp)
    c.parallel.sequence_parallel = opts.get("sp", False)
    c.parallel.pipeline_overlap = overlap
    return c


def assert_bitwise(got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert loss == ref_loss
    chex.assert_trees_all_equal(grads, ref_grads)


def _replay_with_overlap(prog):
    """The tables on symbols in the executor's order with overlap: a tick first writes the gradients
    sent at the previous tick (`recv_grad` row t), then runs its forwards and backwards, then writes
    the activations it sent and its stashes (and with vocabulary parallelism the last stage's own
    gradient). Every read must find the value of its own (micro-batch, stage)."""
    p, spare_a, spare_g, last = prog.p, prog.act_slots, prog.grad_slots, prog.p * prog.v - 1
    tb = prog.tables
    act, grad = [dict() for _ in range(p)], [dict() for _ in range(p)]
    sent_b = [None] * p  # the gradients the previous tick sent, per sender
    for t in range(prog.ticks):
        for d in range(p):
            if tb["recv_grad"][t, d] != spare_g:
                sent = sent_b[(d + 1) % p]
                assert sent is not None and sent[2] >= 0 and tb["send_bwd"][t - 1]
                grad[d][tb["recv_grad"][t, d]] = sent
        out_f, out_b, stash = [None] * p, [None] * p, [None] * p
        for d in range(p):
            f, b = prog.forward[t][d], prog.backward[t][d]
            if f is not None:
                i, s = f.microbatch, f.stage
                if s > 0:
                    assert act[d].get(tb["f_slot"][t, d]) == ("x", i, s)
                else:
                    stash[d] = ("x", i, 0)
                out_f[d] = ("x", i, s + 1) if s < last else ("h", i)
            if b is not None:
                i, s = b.microbatch, b.stage
                assert act[d].get(tb["b_act"][t, d]) == ("x", i, s)
                if s < last or prog.vocab_parallel:
                    assert grad[d].get(tb["b_grad"][t, d]) == ("g", i, s), (prog.name, t, d)
                out_b[d] = ("g", i, s - 1)
        for d in range(p):
            if tb["recv_act"][t, d] != spare_a:
                act[d][tb["recv_act"][t, d]] = out_f[(d - 1) % p]
            if tb["f_stash"][t, d] != spare_a:
                act[d][tb["f_stash"][t, d]] = stash[d]
            if tb["own_grad"][t, d] != spare_g:
                grad[d][tb["own_grad"][t, d]] = ("g", out_f[d][1], last)
        sent_b = out_b
    # the send carried out of the last tick is empty: nothing is left to flush
    assert all(g is None or g[2] < 0 for g in sent_b)


def test_delayed_gradient_writes_still_meet_their_backwards():
    for name, p, m, v in PROGRAM_CASES:
        for vp in (False, True):
            plain = PL.lockstep(PL.make_schedule(name, p, m, v), vocab_parallel=vp)
            prog = PL.lockstep(PL.make_schedule(name, p, m, v), vocab_parallel=vp, overlap=True)
            _replay_with_overlap(prog)
            # the same sends, now one permute of each kind every tick
            plain_count, count = PL.pipe_transfers(plain), PL.pipe_transfers(prog)
            assert count["activation_permutes"] == count["gradient_permutes"] == prog.ticks
            assert {k: n for k, n in count.items() if "permutes" not in k} == {
                k: n for k, n in plain_count.items() if "permutes" not in k
            }


def test_transfer_counts():
    """1F1B at p 4, m 8: 20 ticks; 14 activation and 15 gradient sends, so overlap adds 6 + 5
    permutes of zeros; 10 and 11 of the sends have compute beside them. GPipe: none."""
    one = PL.pipe_transfers(PL.lockstep(PL.make_schedule("1f1b", 4, 8), overlap=True))
    assert one == dict(
        activation_sends=14,
        activation_sends_beside_backward=10,
        gradient_sends=15,
        gradient_sends_beside_forward=11,
        activation_permutes=20,
        gradient_permutes=20,
    )
    gpipe = PL.pipe_transfers(PL.lockstep(PL.make_schedule("gpipe", 4, 8), overlap=True))
    assert gpipe["activation_sends_beside_backward"] == gpipe["gradient_sends_beside_forward"] == 0


SLOW_CASES = (  # CI time
    "pipe2_gpipe",
    "pipe4_eager_1f1b",
    "pipe4_interleaved_v2",
    "vp_pipe2_data2_tensor2_1f1b",
    "pipe2_fsdp2_tensor2_sp_eager",
)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES])
def test_overlap_keeps_losses_and_gradients_bitwise(name):
    got = loss_and_grads(configure(name, True))
    assert_bitwise(got, loss_and_grads(configure(name, False)))
    assert_matches(got, reference())


@pytest.mark.parametrize("name", ["pipe4_1f1b", "vp_pipe2_interleaved_v2"])
def test_evaluation_with_overlap(name):
    from jaxsys import data

    losses = []
    for overlap in (False, True):
        c = configure(name, overlap)
        program = program_for(c)
        batch = data.global_batch(
            data.load_corpus(c.data), program.batch_sharding, c.seed, 0, c.train.batch_size, c.data.seq_len
        )
        losses.append(float(program.eval_loss_fn()(program.init().params, batch)))
    assert losses[0] == losses[1]
    np.testing.assert_allclose(losses[1], reference()[0], rtol=1e-6)


@pytest.mark.parametrize(
    "mesh, value, message",
    [
        (dict(pipe=2), "yes", "config.parallel.pipeline_overlap='yes': choose True or False"),
        (dict(pipe=2), 1, "config.parallel.pipeline_overlap=1: choose True or False"),
        (dict(data=2), True, "config.parallel.pipeline_overlap=True needs a pipeline"),
    ],
)
def test_bad_value_is_refused(mesh, value, message):
    c = pipeline_config(mesh)
    with c.parallel.ignore_type():  # past the ConfigDict's own type check, which rejects most non-bools
        c.parallel.pipeline_overlap = value
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(c)


# --------------------------------------------------------------------------- TPU schedule


def _pipe_permute_windows(text: str):
    """The pipe collective-permutes of a scheduled HLO module: per start, its computation, its
    direction (+1 activations, -1 gradients: device i is pipe index i here), the instructions
    scheduled between start and done, and the conditionals among them by their matmul FLOPs.
    Also the computations that are conditional branches and loop bodies, and the module."""
    from jaxsys.analysis import hlo

    module = hlo.parse(text)
    flops = lambda cond: max(module.branch_cost(c)[0] for c in cond.called() if c in module.computations)
    everything = [i for insts in module.computations.values() for i in insts]
    branches = {c for i in everything if i.opcode == "conditional" for c in i.called()}
    bodies = {(i.attr("body") or "").lstrip("%") for i in everything if i.opcode == "while"}
    out = []
    for comp, insts in module.computations.items():
        for k, inst in enumerate(insts):
            if inst.opcode != "collective-permute-start":
                continue
            pairs = {tuple(map(int, q)) for q in re.findall(r"\{(\d+),(\d+)\}", inst.attr("source_target_pairs"))}
            done = next(j for j in range(k + 1, len(insts)) if inst.name in insts[j].operands)
            assert insts[done].opcode == "collective-permute-done"
            between = insts[k + 1 : done]
            conds = [flops(b) for b in between if b.opcode == "conditional"]
            out.append((comp, +1 if (0, 1) in pairs else -1, [b.opcode for b in between], conds))
    return out, branches, bodies, module, flops


@pytest.mark.parametrize(
    "schedule, vp",
    [
        pytest.param("1f1b", False, marks=pytest.mark.slow),
        pytest.param("gpipe", False, marks=pytest.mark.slow),
        ("1f1b", True),
    ],
)
def test_tpu_schedule_runs_the_sends_beside_the_forward_and_backward(schedule, vp):
    """pipe 4 on v5p:2x2x1, train step. With overlap: two async permutes in the loop body; the
    gradient's window holds this tick's forward conditional, the activation's the backward (the
    heaviest conditional: it recomputes the forward). Without: each permute alone in a branch of
    its tick-uniform conditional, nothing between start and done."""
    from jaxsys.analysis import targets

    if not targets.has_libtpu():
        pytest.skip("libtpu is not installed: no TPU compiler")
    from tests.test_tpu_compile import compile_on_tpu

    devices = targets.devices(targets.parse("v5p:2x2x1"))
    for overlap in (False, True):
        c = pipeline_config(dict(pipe=4), schedule, 4, 1, vp)
        c.parallel.pipeline_overlap = overlap
        text = compile_on_tpu(c, devices).as_text()
        windows, branches, bodies, module, flops = _pipe_permute_windows(text)
        # two permutes, both async (start/done), one each way
        assert sorted(direction for _, direction, _, _ in windows) == [-1, +1]
        if not overlap:
            assert all(comp in branches and between == [] for comp, _, between, _ in windows)
            continue
        (body,) = {comp for comp, _, _, _ in windows}
        assert body in bodies
        in_window = {direction: conds for _, direction, _, conds in windows}
        in_body = [flops(i) for i in module.computations[body] if i.opcode == "conditional"]
        backward = max(in_body)
        forward = max(f for f in in_body if f < backward)
        assert backward > 2.5 * forward  # the recomputed forward and its VJP
        assert forward in in_window[-1] and backward not in in_window[-1]
        assert backward in in_window[+1]
