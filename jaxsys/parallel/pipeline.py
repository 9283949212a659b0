"""Pipeline parallelism over `pipe` (GPipe, 1F1B, interleaved 1F1B) with vocabulary parallelism.

The layers are cut into v*p stages (p devices on `pipe`, v model chunks per device): device d holds
stages d, d+p, ..., d+(v-1)p (`transformer.param_specs(m, chunks=v)` lays the layer leaves out so
that sharding over `pipe` gives exactly these). The local batch is split into m micro-batches.

A schedule (`schedules.py`) is a per-device order of forwards F(i, s) and backwards B(i, s). The
executor runs it in lockstep ticks inside the training shard_map; every tick each device runs at
most one forward and one backward from its order (in 1F1B's steady state, one of each), then:

    activations  -> ppermute to device d+1 (cyclic: with v > 1 device p-1 feeds device 0)
    gradients    -> ppermute to device d-1
    both are written into slots of per-device buffers until the stage that needs them runs.

`lockstep` packs a schedule into such ticks and assigns the buffer slots: an activation occupies a
slot from its arrival until the backward of its stage has used it (the stage's forward is
recomputed there from this stashed input: Megatron's full activation recomputation, at stage
granularity), so the buffers hold exactly the schedule's in-flight micro-batches: m per device for
GPipe, at most p for 1F1B. Gradients are explicit per-stage VJPs (`jax.vjp`) accumulated over the
micro-batches, not `jax.grad` of the whole loop, which could only give GPipe's order.

Which branch (first stage with the embedding, middle, last stage with the loss, or nothing) a
device runs is a `lax.switch` on its row of the tick table; the tensor, FSDP and context collectives
inside a stage run over axes whose groups share one `pipe` index, so all members take the same
branch. Collectives over `pipe` itself sit outside device-dependent branches.

Vocabulary parallelism (Yeung et al. 2024): with `config.parallel.vocab_parallel` the embedding and
output layer are split over (pipe, tensor) instead of living on the first and last stage. Then:

    embedding   at the tick where F(i, 0) runs, every device looks up its vocabulary rows of
                micro-batch i and one all-reduce over `pipe` (and `tensor`) assembles x0 on all
    output      at the end of the tick where F(i, last) ran, its normed hidden state is broadcast
                over `pipe`; every device computes its logits slice, the cross-entropy is reduced
                over (pipe, tensor) and its gradient w.r.t. the hidden state is all-reduced back
    embedding backward   at the end of B(i, 0)'s tick the gradient of x0 is broadcast and every
                device accumulates its rows' gradient

These passes are tick-uniform (every device runs them at the same ticks), so they may hold `pipe`
collectives.

Send/receive overlap (`config.parallel.pipeline_overlap`, `lockstep(..., overlap=True)`). Without
it each ppermute sits in a tick-uniform cond after both computes of its tick, and a conditional is
one instruction to XLA: nothing can run beside the transfer. With it both ppermutes are issued
unconditionally (zeros on ticks without a send) where they can run beside the other compute:

    activations  sent right after the tick's forward, beside the same tick's backward (another
                 micro-batch); received into the buffer after it (its first reader is a forward
                 of the next tick at the earliest)
    gradients    the tick's dx is carried to the next tick and sent at its start, beside that
                 tick's forward (which reads no gradient); written into the buffer before that
                 tick's backward, the earliest reader of a gradient sent a tick before

The values, slots and computes are the same; only when a gradient is written into its slot moves,
from the end of tick t to the start of tick t+1, before any read of it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsys.parallel import schedules
from jaxsys.parallel.schedules import Action

PIPE = "pipe"
NONE, FIRST, MID, LAST = 0, 1, 2, 3  # branch of a device in a tick


def make_schedule(name: str, p: int, m: int, v: int = 1) -> schedules.Schedule:
    """`config.train.pipeline_schedule` -> the schedule table."""
    if name == "gpipe":
        return schedules.gpipe(p, m)
    if name == "1f1b":
        return schedules.one_f_one_b(p, m)
    if name == "eager_1f1b":
        return schedules.eager_one_f_one_b(p, m)
    if name == "interleaved_1f1b":
        return schedules.interleaved_one_f_one_b(p, m, v)
    raise ValueError(f"unknown pipeline schedule {name!r}: choose gpipe, 1f1b, eager_1f1b or interleaved_1f1b")


# --------------------------------------------------------------------------- lockstep program


@dataclasses.dataclass(frozen=True)
class Program:
    """A schedule packed into lockstep ticks, with its buffer slots. `forward[t][d]` and
    `backward[t][d]` are the actions device d runs at tick t (either may be None). `tables` are the
    int32 arrays the executor reads: [ticks, p] per device, [ticks] for tick-uniform fields."""

    name: str
    p: int
    m: int
    v: int
    forward: tuple[tuple[Action | None, ...], ...]
    backward: tuple[tuple[Action | None, ...], ...]
    act_slots: int  # stage inputs held per device (stashed for the backward)
    grad_slots: int  # received output gradients waiting for their backward
    vocab_parallel: bool
    tables: dict
    overlap: bool = False  # sends issued beside the other compute (module docstring); shifts `recv_grad`

    @property
    def ticks(self) -> int:
        return len(self.forward)

    @property
    def has_backward(self) -> bool:
        return any(a is not None for row in self.backward for a in row)


def _kind(stage: int, n_stages: int) -> int:
    return FIRST if stage == 0 else LAST if stage == n_stages - 1 else MID


def _allocate(intervals: dict) -> tuple[dict, int]:
    """Slots for (write tick, last read tick) intervals: a value written at the end of tick w and
    last read during tick r; its slot can take a new write at the end of tick r."""
    slot_of, free_at = {}, []  # free_at[slot]: tick whose end may rewrite the slot
    for key, (w, r) in sorted(intervals.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        slot = next((s for s, f in enumerate(free_at) if f <= w), None)
        if slot is None:
            slot, free_at = len(free_at), free_at + [0]
        slot_of[key], free_at[slot] = slot, r
    return slot_of, len(free_at)


def lockstep(
    schedule: schedules.Schedule, backward: bool = True, vocab_parallel: bool = False, overlap: bool = False
) -> Program:
    """Pack each device's action order of `schedule` into ticks: a device takes the next action of
    its order when the action it depends on ran in an earlier tick, at most one forward and one
    backward per tick. `backward=False` keeps the forwards only (evaluation). `overlap=True`: the
    executor sends a tick's gradients at the start of the next tick, so `recv_grad` row t names the
    slot of the gradient sent at tick t-1."""
    p, m, v = schedule.p, schedule.m, schedule.v
    n_stages, last = p * v, p * v - 1
    orders = [[a for _, a in schedule.device_order(d) if backward or a.kind == "F"] for d in range(p)]

    def needs(a: Action):
        if a.kind == "F":
            return ("F", a.microbatch, a.stage - 1) if a.stage > 0 else None
        return ("B", a.microbatch, a.stage + 1) if a.stage < last else ("F", a.microbatch, last)

    ran: dict[tuple[str, int, int], int] = {}
    pos, fwd, bwd = [0] * p, [], []
    remaining = sum(len(o) for o in orders)
    while remaining:
        t, rows = len(fwd), {"F": [None] * p, "B": [None] * p}
        for d in range(p):
            while pos[d] < len(orders[d]):
                a = orders[d][pos[d]]
                need = needs(a)
                if rows[a.kind][d] is not None or (need is not None and ran.get(need, t) >= t):
                    break
                rows[a.kind][d] = a
                ran[(a.kind, a.microbatch, a.stage)] = t
                pos[d], remaining = pos[d] + 1, remaining - 1
        if all(a is None for a in rows["F"] + rows["B"]):
            raise ValueError(f"{schedule.name}: the device orders deadlock in lockstep at tick {t}")
        fwd.append(tuple(rows["F"]))
        bwd.append(tuple(rows["B"]))
    ticks = len(fwd)

    # Buffer slots, per device; the buffers are sized by the busiest device.
    act_iv, grad_iv = [dict() for _ in range(p)], [dict() for _ in range(p)]
    for i in range(m):
        for s in range(n_stages):
            d = s % p
            if s > 0 or backward:  # stage 0's input is stashed only for its backward
                w = ran[("F", i, s - 1)] if s > 0 else ran[("F", i, 0)]
                act_iv[d][(i, s)] = (w, ran[("B", i, s)] if backward else ran[("F", i, s)])
            if backward and (s < last or vocab_parallel):
                w = ran[("B", i, s + 1)] if s < last else ran[("F", i, last)]
                grad_iv[d][(i, s)] = (w, ran[("B", i, s)])
    act_alloc = [_allocate(iv) for iv in act_iv]
    grad_alloc = [_allocate(iv) for iv in grad_iv]
    act_slots = max(n for _, n in act_alloc)
    grad_slots = max(n for _, n in grad_alloc)
    act_slot = lambda d, key: act_alloc[d][0].get(key, act_slots)  # missing -> the spare slot
    grad_slot = lambda d, key: grad_alloc[d][0].get(key, grad_slots)

    per_device = (
        "f_kind",
        "f_mb",
        "f_chunk",
        "f_slot",
        "f_stash",
        "b_kind",
        "b_mb",
        "b_chunk",
        "b_act",
        "b_grad",
        "recv_act",
        "recv_grad",
        "own_grad",
    )
    tables = {k: np.zeros((ticks, p), np.int32) for k in per_device}
    for k in ("f_stash", "recv_act"):
        tables[k][:] = act_slots
    for k in ("recv_grad", "own_grad"):
        tables[k][:] = grad_slots
    for k in ("embed_mb", "out_mb", "embed_bwd_mb"):
        tables[k] = np.full((ticks,), -1, np.int32)
    for k in ("send_fwd", "send_bwd"):
        tables[k] = np.zeros((ticks,), np.int32)
    for t in range(ticks):
        for d in range(p):
            a = fwd[t][d]
            if a is not None:
                i, s = a.microbatch, a.stage
                kind = _kind(s, n_stages)
                tables["f_kind"][t, d], tables["f_mb"][t, d], tables["f_chunk"][t, d] = kind, i, a.chunk
                tables["f_slot"][t, d] = act_slot(d, (i, s)) if s > 0 else act_slots
                if s == 0:
                    tables["f_stash"][t, d] = act_slot(d, (i, 0))
                    if vocab_parallel:
                        tables["embed_mb"][t] = i
                if s < last:
                    tables["send_fwd"][t] = 1
                    tables["recv_act"][t, (d + 1) % p] = act_slot((d + 1) % p, (i, s + 1))
                elif vocab_parallel:
                    tables["out_mb"][t] = i
                    tables["own_grad"][t, d] = grad_slot(d, (i, s))
            b = bwd[t][d]
            if b is not None:
                i, s = b.microbatch, b.stage
                tables["b_kind"][t, d], tables["b_mb"][t, d], tables["b_chunk"][t, d] = _kind(s, n_stages), i, b.chunk
                tables["b_act"][t, d] = act_slot(d, (i, s))
                tables["b_grad"][t, d] = grad_slot(d, (i, s))
                if s > 0:
                    tables["send_bwd"][t] = 1
                    tables["recv_grad"][t, (d - 1) % p] = grad_slot((d - 1) % p, (i, s - 1))
                elif vocab_parallel:
                    tables["embed_bwd_mb"][t] = i
    if overlap:
        # a gradient is sent at tick t >= 1 only for a backward that runs later, never at the last tick:
        # the send carried out of the scan is always empty
        assert tables["send_bwd"][-1] == 0, schedule.name
        tables["recv_grad"] = np.concatenate([np.full((1, p), grad_slots, np.int32), tables["recv_grad"][:-1]])
    return Program(
        schedule.name, p, m, v, tuple(fwd), tuple(bwd), act_slots, grad_slots, vocab_parallel, tables, overlap
    )


def pipe_transfers(program: Program) -> dict[str, int]:
    """The ppermutes over `pipe` of one step, each one x[Bm, T, D] per device: ticks with something
    to send (`*_sends`), ppermutes run (`*_permutes`: the sends without overlap; with it one of each
    every tick, the others carrying zeros), and the sends that overlap can hide behind compute: an
    activation sent in a tick where some device runs a backward, a gradient sent in a tick followed
    by one where some device runs a forward."""
    tb, ticks = program.tables, program.ticks
    busy = lambda actions, t: t < ticks and any(a is not None for a in actions[t])
    out = {
        "activation_sends": int(tb["send_fwd"].sum()),
        "activation_sends_beside_backward": sum(
            int(tb["send_fwd"][t]) for t in range(ticks) if busy(program.backward, t)
        ),
        "gradient_sends": 0,
        "gradient_sends_beside_forward": 0,
    }
    if program.has_backward:
        out["gradient_sends"] = int(tb["send_bwd"].sum())
        out["gradient_sends_beside_forward"] = sum(
            int(tb["send_bwd"][t]) for t in range(ticks) if busy(program.forward, t + 1)
        )
    out["activation_permutes"] = ticks if program.overlap else out["activation_sends"]
    out["gradient_permutes"] = ticks if program.overlap and program.has_backward else out["gradient_sends"]
    return out


def lockstep_time(program: Program, backward_cost: float = 2) -> float:
    """Duration of the program when each tick lasts as long as its busiest device: a forward of a
    chunk costs 1, a backward `backward_cost` (3 with the stage recomputation here). In units of
    one chunk's forward (divide by v for a whole device's forward)."""
    return sum(
        max(
            (program.forward[t][d] is not None) + backward_cost * (program.backward[t][d] is not None)
            for d in range(program.p)
        )
        for t in range(program.ticks)
    )


def render(program: Program) -> str:
    """One row per device, one column per tick: the forward and/or backward run in that tick
    (`F3`, `B1`, `F3+B1`, `F3.1` for chunk 1 when v > 1), `.` when idle."""
    cells = []
    for d in range(program.p):
        row = []
        for t in range(program.ticks):
            parts = [a.label(program.v) for a in (program.forward[t][d], program.backward[t][d]) if a]
            row.append("+".join(parts) or ".")
        cells.append(row)
    width = max(len(c) for row in cells for c in row)
    head = (
        f"{program.name} in lockstep: p={program.p} m={program.m} v={program.v} "
        f"ticks={program.ticks} act_slots={program.act_slots} grad_slots={program.grad_slots}"
    )
    return "\n".join(
        [head] + [f"dev {d}: " + " ".join(c.ljust(width) for c in row).rstrip() for d, row in enumerate(cells)]
    )


# --------------------------------------------------------------------------- executor


class StageFns(NamedTuple):
    """The model in the pieces the executor runs; all per shard, inside the shard_map.

    embed(shared, inputs[Bm, T]) -> x[Bm, T, D]
    stack(layers, x) -> (y, term, stats)   the layers of one stage (leaves [L/(v p), ...]); `term`
                                    a scalar the stage adds to the objective (the MoE losses,
                                    normalised), `stats` what to report of its layers: scalars,
                                    or arrays with a leading layer axis (MoE routing statistics);
                                    stack(layers, x, extras) when `run` is given per-micro-batch
                                    extras (packed rows: segment ids and positions)
    norm(shared, y) -> h            final norm (on the last stage)
    loss(shared, h, targets) -> ()  output layer + cross-entropy, summed and normalised;
                                    loss(shared, h, targets, extras) with extras (loss weights)
    `shared` is every parameter but "layers"."""

    embed: Callable
    stack: Callable
    norm: Callable
    loss: Callable


def run(fns: StageFns, params, inputs, targets, program: Program, extras=None):
    """(loss, gradients, stats): the cross-entropy loss (summed over micro-batches and `pipe`);
    if the program has backwards, the gradients of this device's parameters of the objective, loss
    plus the stages' `stack` terms (before any reduction over other axes; the shared parameters'
    gradients still need a sum over `pipe` where they are replicated over it); and the stages'
    `stack` stats summed over micro-batches, scalars summed over the stages and per-layer arrays
    concatenated over them in layer order (on every device).

    inputs, targets: [m, Bm, T] this shard's micro-batches. extras: None, or a pytree of
    [m, Bm, ...] arrays that travel with the micro-batches (packed rows: their segment ids and
    positions, loss weights); every forward and recomputed forward of micro-batch i calls
    `fns.stack(layers, x, extras[i])`, and its loss `fns.loss(shared, h, targets[i], extras[i])`.
    Every device holds them, as it holds the micro-batch's tokens, so nothing extra is sent
    between stages."""
    p, v, vp = program.p, program.v, program.vocab_parallel
    backward, overlap = program.has_backward, program.overlap
    d = lax.axis_index(PIPE)
    shared = {k: a for k, a in params.items() if k != "layers"}
    layers = params["layers"]  # leaves [v, L/(v p), ...], or [L/p, ...] when v = 1
    x_struct = jax.eval_shape(fns.embed, shared, inputs[0])
    zeros_x = lambda: jnp.zeros(x_struct.shape, x_struct.dtype)
    f32_zero = jnp.zeros((), jnp.float32)
    one_chunk = layers if v == 1 else jax.tree.map(lambda a: a[0], layers)

    take = lambda buf, i: lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)

    def stage(w, x, mb):
        """The stage's layers on micro-batch mb's activations, with its extras when there are any."""
        if extras is None:
            return fns.stack(w, x)
        return fns.stack(w, x, jax.tree.map(lambda a: take(a, mb), extras))

    def loss_of(sh, h, mb):
        """The output layer's loss of micro-batch mb, with its extras when there are any."""
        if extras is None:
            return fns.loss(sh, h, take(targets, mb))
        return fns.loss(sh, h, take(targets, mb), jax.tree.map(lambda a: take(a, mb), extras))

    stats_struct = jax.eval_shape(lambda w, x: stage(w, x, 0), one_chunk, x_struct)[2]

    put = lambda buf, i, x: lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), i, 0)
    add = lambda acc, g: jax.tree.map(jnp.add, acc, g)

    def chunk_of(j):
        return layers if v == 1 else jax.tree.map(lambda a: take(a, j), layers)

    def add_to_chunk(acc, j, g):  # v = 1 without a chunk dimension: indexing it cost XLA copies
        return add(acc, g) if v == 1 else jax.tree.map(lambda a, b: put(a, j, take(a, j) + b), acc, g)

    def embed_grad(g_shared, mb, dx0):
        _, pull = jax.vjp(lambda sh: fns.embed(sh, take(inputs, mb)), shared)
        return add(g_shared, pull(dx0)[0])

    # One forward and one backward of the stage's layers per tick; only the embedding and the head
    # differ by stage, in small conds around them (three stage-kind branches each holding the
    # layers' VJP tripled XLA's temporaries and the compile time).
    def forward(x_in, x0, loss, stats, row):
        first, last, mb = row["f_kind"] == FIRST, row["f_kind"] == LAST, row["f_mb"]
        if vp:
            x = jnp.where(first, x0, x_in)
        else:
            x = lax.cond(first, lambda: fns.embed(shared, take(inputs, mb)), lambda: x_in)
        y, _, layer_stats = stage(chunk_of(row["f_chunk"]), x, mb)
        stats = add_to_chunk(stats, row["f_chunk"], layer_stats)

        def head(y, loss):
            h = fns.norm(shared, y)
            if vp:
                return h, loss  # to the output pass
            return zeros_x(), loss + loss_of(shared, h, mb)

        send, loss = lax.cond(last, head, lambda y, loss: (y, loss), y, loss)
        return send, x, loss, stats  # x: stage 0's input, stashed for its backward

    def backward_step(x_in, dy_in, g_chunks, g_shared, row):
        j, mb, last = row["b_chunk"], row["b_mb"], row["b_kind"] == LAST

        def stack_with_term(w, x):
            y, term, layer_stats = stage(w, x, mb)
            return (y, term), layer_stats

        (y, term), pull_stack, _ = jax.vjp(stack_with_term, chunk_of(j), x_in, has_aux=True)  # recompute
        pull = lambda dy: pull_stack((dy, jnp.ones_like(term)))  # the term enters the objective as is

        def head(y, g_shared):
            if vp:
                _, pull_head = jax.vjp(fns.norm, shared, y)
                dsh, dy = pull_head(dy_in)
            else:
                _, pull_head = jax.vjp(lambda sh, y: loss_of(sh, fns.norm(sh, y), mb), shared, y)
                dsh, dy = pull_head(jnp.ones((), jnp.float32))
            return dy, add(g_shared, dsh)

        dy, g_shared = lax.cond(last, head, lambda y, g: (dy_in, g), y, g_shared)
        dw, dx = pull(dy)
        g_chunks = add_to_chunk(g_chunks, j, dw)
        if not vp:
            g_shared = lax.cond(row["b_kind"] == FIRST, lambda g: embed_grad(g, mb, dx), lambda g: g, g_shared)
        return dx, g_chunks, g_shared

    def uniform(flag, on, off, *args):
        """A branch every device takes at the same ticks (may hold `pipe` collectives)."""
        return lax.cond(flag, on, off, *args)

    def broadcast_from(device, x):
        return lax.psum(jnp.where(d == device, x, jnp.zeros_like(x)), PIPE)

    def tick(carry, row_all):
        act, grad, last_send_b, g_chunks, g_shared, loss, stats = carry
        row = {k: (a[d] if a.ndim == 1 else a) for k, a in row_all.items()}  # [p] -> this device
        x0 = zeros_x()
        if vp:
            x0 = uniform(
                row["embed_mb"] >= 0,
                lambda mb: fns.embed(shared, take(inputs, mb)),
                lambda mb: zeros_x(),
                jnp.maximum(row["embed_mb"], 0),
            )
        if backward and overlap:  # the last tick's gradients, sent beside this tick's forward
            recv_b = lax.ppermute(last_send_b, PIPE, _ring(p, -1))
        # Slots are read here, outside the conds, so that XLA updates the buffers in place (as a
        # cond operand the whole buffer was copied every tick: twice the stash).
        send_f, stash, loss, stats = lax.cond(
            row["f_kind"] != NONE,
            forward,
            lambda x, x0, loss, stats, row: (zeros_x(), zeros_x(), loss, stats),
            take(act, row["f_slot"]),
            x0,
            loss,
            stats,
            row,
        )
        if overlap:  # right after the forward, outside any cond: it can run beside the backward
            recv_f = lax.ppermute(send_f, PIPE, _ring(p, +1))
        send_b = zeros_x()
        if backward:
            if overlap:  # before the backward, the first reader of a gradient sent last tick
                grad = put(grad, row["recv_grad"], recv_b)
            send_b, g_chunks, g_shared = lax.cond(
                row["b_kind"] != NONE,
                backward_step,
                lambda x, dy, gc, gs, row: (zeros_x(), gc, gs),
                take(act, row["b_act"]),
                take(grad, row["b_grad"]),
                g_chunks,
                g_shared,
                row,
            )

        if not overlap:
            recv_f = uniform(row["send_fwd"] > 0, lambda x: lax.ppermute(x, PIPE, _ring(p, +1)), jnp.zeros_like, send_f)
        act = put(put(act, row["recv_act"], recv_f), row["f_stash"], stash)
        if backward and not overlap:
            recv_b = uniform(row["send_bwd"] > 0, lambda x: lax.ppermute(x, PIPE, _ring(p, -1)), jnp.zeros_like, send_b)
            grad = put(grad, row["recv_grad"], recv_b)

        if vp:
            if backward and overlap:
                # the passes after both sends have landed: else the TPU scheduler ran the backward
                # before the forward, and the activation send after the passes, beside nothing
                send_f, send_b, _ = lax.optimization_barrier((send_f, send_b, recv_f))

            def output_pass(g_shared, loss, mb):
                h = broadcast_from(p - 1, send_f)
                if backward:
                    value, pull = jax.vjp(lambda sh, h: loss_of(sh, h, mb), shared, h)
                    dsh, dh = pull(jnp.ones((), jnp.float32))
                    g_shared = add(g_shared, dsh)
                else:
                    value, dh = loss_of(shared, h, mb), zeros_x()
                return g_shared, loss + jnp.where(d == p - 1, value, 0.0), dh.astype(x_struct.dtype)

            g_shared, loss, dh = uniform(
                row["out_mb"] >= 0,
                output_pass,
                lambda g, l, mb: (g, l, zeros_x()),
                g_shared,
                loss,
                jnp.maximum(row["out_mb"], 0),
            )
            if backward:
                grad = put(grad, row["own_grad"], dh)
                g_shared = uniform(
                    row["embed_bwd_mb"] >= 0,
                    lambda g, mb: embed_grad(g, mb, broadcast_from(0, send_b)),
                    lambda g, mb: g,
                    g_shared,
                    jnp.maximum(row["embed_bwd_mb"], 0),
                )
        last_send_b = send_b if backward and overlap else None
        return (act, grad, last_send_b, g_chunks, g_shared, loss, stats), None

    act = jnp.zeros((program.act_slots + 1,) + x_struct.shape, x_struct.dtype)
    grad = jnp.zeros((program.grad_slots + 1,) + x_struct.shape, x_struct.dtype) if backward else act[:0]
    g_chunks = jax.tree.map(jnp.zeros_like, layers) if backward else None
    g_shared = jax.tree.map(jnp.zeros_like, shared) if backward else None
    stats = jax.tree.map(lambda a: jnp.zeros(((v,) if v > 1 else ()) + a.shape, a.dtype), stats_struct)
    xs = {k: jnp.asarray(a) for k, a in program.tables.items()}
    last_send_b = zeros_x() if backward and overlap else None  # tick 0 receives zeros
    carry = (act, grad, last_send_b, g_chunks, g_shared, f32_zero, stats)
    # the last tick sends no gradient (`lockstep`): the carried send_b is empty
    (_, _, _, g_chunks, g_shared, loss, stats), _ = lax.scan(tick, carry, xs)
    loss = lax.psum(loss, PIPE)
    stats = jax.tree.map(lambda a: _over_stages(a, p, v), stats)
    return loss, ({"layers": g_chunks, **g_shared} if backward else None), stats


def _over_stages(x, p: int, v: int):
    """A statistic of this device's stages ([v, ...] with v > 1) over all stages: a scalar summed, an
    array with a leading layer axis concatenated in layer order (stage c p + d is device d's chunk c)."""
    if x.ndim == (1 if v > 1 else 0):
        return lax.psum(jnp.sum(x), PIPE)
    gathered = lax.all_gather(x if v > 1 else x[None], PIPE)  # [p, v, L_stage, ...]
    return jnp.swapaxes(gathered, 0, 1).reshape(-1, *x.shape[2 if v > 1 else 1 :])


def _ring(p: int, step: int) -> list[tuple[int, int]]:
    return [(i, (i + step) % p) for i in range(p)]
