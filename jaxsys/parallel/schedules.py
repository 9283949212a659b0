"""Pipeline schedules as data: which device runs which forward or backward at each tick.

A schedule for p devices on the `pipe` axis, m micro-batches and v model chunks per device is a
table `actions[tick][device]`: None (idle) or an `Action` (F or B, micro-batch i, chunk j). With v
chunks the model is cut into v*p stages; device d holds stages d, d+p, ..., d+(v-1)p, so chunk j of
device d is global stage s = j*p + d (Megatron's interleaving). v = 1 is the ordinary pipeline.

Cost convention. One tick is the forward of one chunk (1/v of a device's layers) for one
micro-batch. A backward takes `backward_cost` ticks, 2 by default (the usual estimate: a backward
does two matmuls, for the input and the weight gradients, per forward matmul), and fills that many
consecutive cells of its device's row. Communication takes no time: a consumer may start on the
tick after its producer's last tick.

Dependencies (`validate` checks them):
    F(i, s)       needs F(i, s-1) finished                       (s > 0)
    B(i, s)       needs B(i, s+1) finished                       (s < last stage)
    B(i, last)    needs F(i, last) finished

A schedule is built by `simulate`: each device gets an ordered list of actions, and each action is
placed at the earliest tick that its device is free and its dependencies have finished. The table is
derived from these orders and the rules above, not drawn by hand. The three orders:

    gpipe                      all m forwards, then all m backwards             (Huang et al. 2019)
    one_f_one_b                p-d-1 warm-up forwards on device d, then one forward / one backward
                               alternately, then the remaining backwards      (PipeDream-flush;
                               Megatron's default schedule, Narayanan et al. 2021)
    interleaved_one_f_one_b    the same with v chunks per device, micro-batches taken in groups of p
                               (Megatron's interleaved schedule)

Closed forms (tests assert them exactly; the bubble fractions hold for every backward_cost):

    bubble fraction (idle / total device-ticks)
        gpipe, one_f_one_b        (p-1) / (m + p - 1)      Megatron: bubble / ideal = (p-1)/m
        interleaved               (p-1) / (v*m + p - 1)    Megatron: bubble / ideal = (p-1)/(v*m)
    peak in-flight (micro-batch, chunk) activations on device d (`peak_in_flight`)
        gpipe                     m
        one_f_one_b               p - d
        interleaved               min(v*m, (v-1)*p + 2*(p-d-1) + 1); on device 0 with m >= 2p that
                                  is v*p + p - 1 chunks = p + (p-1)/v micro-batches of a whole
                                  device's layers, against p for one_f_one_b
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Literal, Sequence

Kind = Literal["F", "B"]


@dataclasses.dataclass(frozen=True)
class Action:
    """One forward or backward of one model chunk for one micro-batch."""

    kind: Kind
    microbatch: int
    chunk: int  # 0..v-1, the model chunk on this device
    stage: int  # global model stage = chunk * p + device

    def label(self, v: int = 1) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if v > 1 else "")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """`actions[tick][device]`: the action occupying that cell, or None (idle). A backward of cost
    c occupies c consecutive cells of its device's row, each holding the same Action."""

    name: str
    p: int
    m: int
    v: int
    actions: tuple[tuple[Action | None, ...], ...]
    backward_cost: int = 2

    @property
    def ticks(self) -> int:
        return len(self.actions)

    def cost(self, kind: Kind) -> int:
        return 1 if kind == "F" else self.backward_cost

    def device_order(self, device: int) -> list[tuple[int, Action]]:
        """(start tick, action) for each action of one device, in time order."""
        out: list[tuple[int, Action]] = []
        previous = None
        for t, row in enumerate(self.actions):
            if row[device] is not None and row[device] != previous:
                out.append((t, row[device]))
            previous = row[device]
        return out


# --------------------------------------------------------------------------- checks of the input


def _check_sizes(p: int, m: int, v: int = 1, backward_cost: int = 2) -> None:
    if p < 1:
        raise ValueError(f"a pipeline needs p >= 1 stages (devices on `pipe`); got p={p}")
    if m < 1:
        raise ValueError(f"a pipeline needs m >= 1 micro-batches; got m={m}")
    if v < 1:
        raise ValueError(f"each device needs v >= 1 model chunks; got v={v}")
    if backward_cost < 1:
        raise ValueError(f"backward_cost must be >= 1 tick; got {backward_cost}")


# --------------------------------------------------------------------------- simulation


def simulate(
    name: str, p: int, m: int, v: int, orders: Sequence[Sequence[tuple[Kind, int, int]]], backward_cost: int = 2
) -> Schedule:
    """Place each device's ordered (kind, micro-batch, chunk) list at the earliest ticks allowed.

    An action starts when its device has finished the previous action of its list and all its
    dependencies have finished. Raises ValueError if the orders deadlock (some action waits for
    one that can never run) or if an order is not a complete set of actions."""
    _check_sizes(p, m, v, backward_cost)
    if len(orders) != p:
        raise ValueError(f"need one action order per device: {len(orders)} orders for p={p}")
    n_stages = v * p
    cost = {"F": 1, "B": backward_cost}
    finish: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, stage) -> first free tick
    placed: list[list[tuple[int, Action]]] = [[] for _ in range(p)]
    free = [0] * p
    nxt = [0] * p

    def deps(kind: str, i: int, s: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", i, s - 1)] if s > 0 else []
        return [("B", i, s + 1)] if s < n_stages - 1 else [("F", i, s)]

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d in range(p):
            while nxt[d] < len(orders[d]):
                kind, i, j = orders[d][nxt[d]]
                s = j * p + d
                need = deps(kind, i, s)
                if any(k not in finish for k in need):
                    break
                start = max([free[d]] + [finish[k] for k in need])
                key = (kind, i, s)
                if key in finish:
                    raise ValueError(f"{name}: {kind} of micro-batch {i}, stage {s} is listed twice")
                finish[key] = start + cost[kind]
                free[d] = finish[key]
                placed[d].append((start, Action(kind, i, j, s)))
                nxt[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {d: orders[d][nxt[d]] for d in range(p) if nxt[d] < len(orders[d])}
            raise ValueError(f"{name}: the per-device orders deadlock; waiting: {stuck}")

    table: list[list[Action | None]] = [[None] * p for _ in range(max(free))]
    for d in range(p):
        for start, a in placed[d]:
            for t in range(start, start + cost[a.kind]):
                table[t][d] = a
    schedule = Schedule(name, p, m, v, tuple(tuple(r) for r in table), backward_cost)
    validate(schedule)
    return schedule


# --------------------------------------------------------------------------- the schedules


def gpipe(p: int, m: int, backward_cost: int = 2) -> Schedule:
    """GPipe: every device runs the forwards of all m micro-batches, then their backwards (the last
    stage starts the backward as soon as its last forward is done; earlier stages follow in reverse
    stage order as the gradients arrive)."""
    _check_sizes(p, m, 1, backward_cost)
    order = [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    return simulate("gpipe", p, m, 1, [order] * p, backward_cost)


def one_f_one_b(p: int, m: int, backward_cost: int = 2) -> Schedule:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule). Device d runs p-d-1 warm-up
    forwards, then alternates one forward and one backward, then runs the remaining backwards, so at
    most p-d micro-batches' activations are alive on device d. Requires m >= p (with fewer, the
    warm-up of the first devices would already hold every micro-batch: use `gpipe`)."""
    _check_sizes(p, m, 1, backward_cost)
    if m < p:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages: m >= p (got m={m}, p={p}); use gpipe for m < p"
        )
    return simulate("1f1b", p, m, 1, _one_f_one_b_orders(p, m, lambda d: p - d - 1), backward_cost)


def eager_one_f_one_b(p: int, m: int, backward_cost: int = 2) -> Schedule:
    """1F1B with 2(p-d)-1 warm-up forwards on device d instead of p-d-1: the order for devices
    that run in lockstep (one SPMD program, `pipeline.lockstep`). There a hop between stages costs
    a whole tick, so a micro-batch's round trip from device d to the last stage and back takes
    2(p-d)-1 ticks; by Little's law a device that starts one micro-batch per tick needs that many
    in flight. With Megatron's p-d-1 it could start only one per two ticks. Still independent of m
    (GPipe holds all m). Requires m >= p."""
    _check_sizes(p, m, 1, backward_cost)
    if m < p:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages: m >= p (got m={m}, p={p}); use gpipe for m < p"
        )
    return simulate("eager_1f1b", p, m, 1, _one_f_one_b_orders(p, m, lambda d: 2 * (p - d) - 1), backward_cost)


def _one_f_one_b_orders(p: int, m: int, warmup_of) -> list:
    orders = []
    for d in range(p):
        warmup = min(warmup_of(d), m)
        order = [("F", i, 0) for i in range(warmup)]
        for k in range(m - warmup):
            order += [("F", warmup + k, 0), ("B", k, 0)]
        order += [("B", i, 0) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def _interleaved_unit(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """The k-th forward (or backward) of a device: micro-batches go in groups of p, and within a
    group through the chunks in turn (0..v-1 forward, v-1..0 backward)."""
    group, r = divmod(k, p * v)
    chunk = r // p
    if not forward:
        chunk = v - 1 - chunk
    return group * p + r % p, chunk


def interleaved_one_f_one_b(p: int, m: int, v: int, backward_cost: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: device d holds v chunks (stages d, d+p, ..., d+(v-1)p). The
    forwards run micro-batches in groups of p through chunk 0, then chunk 1, ...; the backwards the
    same with the chunks reversed. Device d warms up with (v-1)*p + 2*(p-d-1) forwards (Megatron's
    count), then alternates, then drains. Requires m % p == 0 and m >= p (Megatron's constraint:
    a group of p micro-batches is what keeps each device busy while the group's first
    micro-batch travels round all p devices). v = 1 is `one_f_one_b`.

    The warm-up count is capped at v*m, as in current Megatron-core; older Megatron code instead ran
    all forwards first on every device when m == p. The bubble is the same either way (tested)."""
    _check_sizes(p, m, v, backward_cost)
    if m < p or m % p:
        raise ValueError(
            f"the interleaved schedule needs the micro-batches to be a multiple of "
            f"the stages: m % p == 0 and m >= p (got m={m}, p={p})"
        )
    if v == 1:
        return one_f_one_b(p, m, backward_cost)
    total = v * m
    orders = []
    for d in range(p):
        warmup = min((v - 1) * p + 2 * (p - d - 1), total)
        f = [("F", *_interleaved_unit(k, p, v, True)) for k in range(total)]
        b = [("B", *_interleaved_unit(k, p, v, False)) for k in range(total)]
        order = f[:warmup]
        for k in range(total - warmup):
            order += [f[warmup + k], b[k]]
        order += b[total - warmup :]
        orders.append(order)
    return simulate("interleaved_1f1b", p, m, v, orders, backward_cost)


# --------------------------------------------------------------------------- checks and measures


def validate(schedule: Schedule) -> None:
    """Raise ValueError unless every (kind, micro-batch, stage) runs exactly once, for its full
    cost, on the device that holds the stage, after all its dependencies have finished."""
    s = schedule
    n_stages = s.v * s.p
    start: dict[tuple[str, int, int], int] = {}
    if any(len(row) != s.p for row in s.actions):
        raise ValueError(f"{s.name}: every tick needs one cell per device (p={s.p})")
    for d in range(s.p):
        t = 0
        while t < s.ticks:
            a = s.actions[t][d]
            if a is None:
                t += 1
                continue
            if a.kind not in ("F", "B"):
                raise ValueError(f"{s.name}: unknown action kind {a.kind!r} at tick {t}, device {d}")
            c = s.cost(a.kind)
            if not (0 <= a.microbatch < s.m and 0 <= a.chunk < s.v):
                raise ValueError(f"{s.name}: {a} at tick {t} is outside m={s.m}, v={s.v}")
            if a.stage != a.chunk * s.p + d:
                raise ValueError(
                    f"{s.name}: {a} on device {d} at tick {t}: stage must be chunk * p + device = {a.chunk * s.p + d}"
                )
            run = [s.actions[u][d] for u in range(t, min(t + c, s.ticks))]
            if len(run) < c or any(x != a for x in run):
                raise ValueError(f"{s.name}: {a} on device {d} from tick {t} must occupy {c} consecutive ticks")
            key = (a.kind, a.microbatch, a.stage)
            if key in start:
                raise ValueError(
                    f"{s.name}: {a.kind} of micro-batch {a.microbatch}, stage "
                    f"{a.stage} runs twice (ticks {start[key]} and {t})"
                )
            start[key] = t
            t += c
    for kind in ("F", "B"):
        for i in range(s.m):
            for st in range(n_stages):
                if (kind, i, st) not in start:
                    raise ValueError(f"{s.name}: {kind} of micro-batch {i}, stage {st} never runs")

    def done(kind: str, i: int, st: int) -> int:
        return start[(kind, i, st)] + s.cost(kind)

    for (kind, i, st), t in start.items():
        if kind == "F":
            need = ("F", i, st - 1) if st > 0 else None
        else:
            need = ("B", i, st + 1) if st < n_stages - 1 else ("F", i, st)
        if need is not None and done(*need) > t:
            raise ValueError(
                f"{s.name}: {kind}(micro-batch {i}, stage {st}) starts at tick {t} "
                f"before {need[0]}(micro-batch {i}, stage {need[2]}) finishes at "
                f"tick {done(*need)}"
            )


def bubble_fraction(schedule: Schedule) -> Fraction:
    """Idle device-ticks / all device-ticks from the first tick to the last."""
    busy = [t for t, row in enumerate(schedule.actions) if any(a is not None for a in row)]
    if not busy:
        return Fraction(0)
    rows = schedule.actions[busy[0] : busy[-1] + 1]
    idle = sum(a is None for row in rows for a in row)
    return Fraction(idle, len(rows) * schedule.p)


def peak_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per device: the most (micro-batch, chunk) pairs whose forward has started and whose backward
    has not finished, at any tick: stored activations in units of one chunk for one micro-batch.
    Divide by v for units of one micro-batch through all of a device's layers."""
    peaks = []
    for d in range(schedule.p):
        alive: set[tuple[int, int]] = set()
        peak = 0
        for t, row in enumerate(schedule.actions):
            a = row[d]
            if a is not None and a.kind == "F":
                alive.add((a.microbatch, a.chunk))
            peak = max(peak, len(alive))
            nxt = schedule.actions[t + 1][d] if t + 1 < schedule.ticks else None
            if a is not None and a.kind == "B" and nxt != a:  # last tick of this backward
                alive.discard((a.microbatch, a.chunk))
        peaks.append(peak)
    return tuple(peaks)


def render(schedule: Schedule) -> str:
    """One row per device, one column per tick: `F3` (forward of micro-batch 3), `B3`, `F3.1`
    (micro-batch 3, chunk 1, when v > 1); a backward's later ticks are `--`; idle is `.`."""
    s = schedule
    cells = [["."] * s.ticks for _ in range(s.p)]
    for d in range(s.p):
        for start, a in s.device_order(d):
            cells[d][start] = a.label(s.v)
            for t in range(start + 1, start + s.cost(a.kind)):
                cells[d][t] = "--"
    width = max([len(c) for row in cells for c in row] + [1])
    head = (
        f"{s.name}: p={s.p} m={s.m} v={s.v} backward_cost={s.backward_cost} ticks={s.ticks} bubble={bubble_fraction(s)}"
    )
    rows = [f"dev {d}: " + " ".join(c.ljust(width) for c in cells[d]).rstrip() for d in range(s.p)]
    return "\n".join([head] + rows)
