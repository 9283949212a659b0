"""DiLoCo, Streaming DiLoCo and CO2: islands that synchronise rarely (`config.train.outer`,
docs/diloco.md).

DiLoCo (Douillard et al. 2023). The ranks of the `data` axis are M islands. Each takes H inner steps
of `config.train.optimizer` (AdamW, each island with its own moments) on its own batch shard, its
gradients reduced only inside the island (`island_plans`: the `data` axis is dropped from every
leaf's reduction). Then, with theta the parameters all islands started the round from and
theta_i island i's after it:

    outer gradient  Delta = theta - mean_i theta_i          (parallel/diloco.py: one all-reduce)
    momentum        m     = mu m + Delta
    step            u     = Delta + mu m   (Nesterov)   or   m
    theta'                = theta - lr_out u,   and every island continues from theta'

Streaming DiLoCo (Douillard et al. 2025): the parameters are P fragments (fragment p: layers
p, p+P, ... of every layer-stacked leaf; the other leaves, embeddings and final norm, go with
fragment 0), each synchronised every H steps, fragment p at steps s with s % H == (p+1) H / P % H:
one fragment's bytes every H / P steps, so the peak bandwidth falls by P. With overlap_steps = tau
> 0 a fragment's average (of the deltas as of its sync step s) is applied at s + tau, and each island
keeps alpha (`merge`) of its own current values: theta_i <- alpha theta_i + (1 - alpha) theta'
(`start` and `finish` phases of `local_sync`). The outer gradients may be quantized to int8 or int4
before the average (`quantize` / `dequantize`: symmetric round-to-nearest with one f32 scale per
block of `BLOCK` values; the islands all-gather codes and scales and average in f32), with error
feedback (each island adds its last quantization residual to the next round's outer gradient).

CO2 (Sun et al. 2024): the outer update applies the previous round's averaged outer gradient, so
the all-reduce of round k can run during round k+1's inner steps; theta' = theta - lr_out u(Delta_{k-1})
and the islands continue from theta'. Its staleness gap penalty (`gap_penalized`) and outer
momentum clipping are options (docs/diloco.md states the equations). XLA:CPU runs the all-reduce
between the steps: the arithmetic is CO2's and Streaming DiLoCo's, the overlap is not measured here.

State: `TrainState.params` is theta (what evaluation and checkpoints' consumers read); the islands'
parameters and inner optimizer states are in `OuterState`, stacked [M, ...] and split over `data`,
so that every island's own values are saved and restored (a checkpoint restores onto the same M).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxsys.config import ConfigError
from jaxsys.kernels.quantized_matmul import reference as qref
from jaxsys.models.params import is_spec
from jaxsys.optim.schedules import schedule
from jaxsys.parallel import diloco, zero

BLOCK = 128  # values per quantization scale
BITS = {"int8": 8, "int4": 4}


class OuterState(NamedTuple):
    inner: Any  # the inner optimizer's state of every island, each leaf [M, ...] split over `data`
    local: Any  # the islands' parameters, [M, ...] split over `data`
    momentum: Any  # the outer momentum, shaped and split as the parameters (equal on every island)
    # CO2: the last round's averaged outer gradient; Streaming DiLoCo with overlap_steps > 0: the
    # average in flight (as the parameters); () otherwise
    delayed: Any = ()
    residual: Any = ()  # error feedback: each island's last quantization residual, [M, ...] as `local`
    last_step: Any = ()  # CO2's gap penalty: the last outer step theta' - theta (as the parameters)


def enabled(t) -> bool:
    return t.outer.method != "none"


def island_plans(plans):
    """ZeRO plans without the `data` axis in any gradient reduction: islands do not talk in inner steps."""
    return jax.tree.map(
        lambda p: dataclasses.replace(p, sum_axes=tuple(a for a in p.sum_axes if a != diloco.ISLAND_AXIS)),
        plans,
        is_leaf=lambda x: isinstance(x, zero.LeafPlan),
    )


def check(config, mesh_sizes) -> None:
    """What only the built mesh tells (config.py validated the rest)."""
    m = mesh_sizes.get(diloco.ISLAND_AXIS, 1)
    if m < 2:
        raise ConfigError(
            f"config.train.outer.method={config.train.outer.method!r} with config.mesh.data={m}: the islands are "
            "the ranks of the `data` axis; set config.mesh.data >= 2 (data parallelism inside an island goes "
            "on fsdp or expert)"
        )


def _holds(o) -> dict[str, bool]:
    """Which optional `OuterState` fields config.train.outer `o` keeps."""
    return dict(
        delayed=o.method == "co2" or o.overlap_steps > 0,
        residual=bool(o.error_feedback),
        last_step=bool(o.co2_penalty),
    )


def make(inner: optax.GradientTransformation, t, islands: int):
    """The optimizer slot of an outer run: `init` makes the `OuterState` around `inner`'s; the
    update is `local_step`'s and `sync`'s. `.inner` is the inner optimizer."""
    holds = _holds(t.outer)

    def init(params):
        stack = lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (islands, *jnp.shape(x)))
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return OuterState(
            jax.tree.map(stack, inner.init(params)),
            jax.tree.map(stack, params),
            zeros(),
            zeros() if holds["delayed"] else (),
            jax.tree.map(stack, zeros()) if holds["residual"] else (),
            zeros() if holds["last_step"] else (),
        )

    def refuse(updates, state, params=None):
        raise TypeError("config.train.outer: the inner update is jaxsys.optim.outer.local_step's")

    transform = optax.GradientTransformation(init, refuse)
    return _Outer(transform.init, transform.update, inner)


class _Outer(NamedTuple):
    init: Any
    update: Any
    inner: optax.GradientTransformation


def state_pspecs(inner_pspecs, param_pspecs, t) -> OuterState:
    stacked = lambda spec: P(diloco.ISLAND_AXIS, *spec)
    over = lambda tree: jax.tree.map(stacked, tree, is_leaf=lambda x: isinstance(x, P))
    holds = _holds(t.outer)
    return OuterState(
        over(inner_pspecs),
        over(param_pspecs),
        param_pspecs,
        param_pspecs if holds["delayed"] else (),
        over(param_pspecs) if holds["residual"] else (),
        param_pspecs if holds["last_step"] else (),
    )


# ----------------------------------------------------------------------------- quantization


def quantize(x, bits: int):
    """Symmetric round-to-nearest of `x` (any shape) in blocks of BLOCK values: (codes, scales).
    codes: int8 [n/BLOCK, BLOCK] in [-q, q], q = 2^(bits-1) - 1, packed two to a uint8
    ([n/BLOCK, BLOCK/2]) for 4 bits; scales: f32 [n/BLOCK] = block absmax / q. The error of every
    value is at most scale / 2."""
    q = 2 ** (bits - 1) - 1
    flat = x.astype(jnp.float32).reshape(-1)
    flat = jnp.pad(flat, (0, -flat.size % BLOCK)).reshape(-1, BLOCK)
    absmax = jnp.max(jnp.abs(flat), axis=1)
    scales = jnp.where(absmax > 0, absmax / q, 1.0)
    codes = jnp.clip(jnp.round(flat / scales[:, None]), -q, q).astype(jnp.int8)
    if bits == 4:  # values 2i, 2i + 1 of a block in one byte
        codes = qref.pack_int4(codes.reshape(-1, 1)).reshape(codes.shape[0], -1)
    return codes, scales


def dequantize(codes, scales, shape, bits: int):
    if bits == 4:
        codes = qref.unpack_int4(codes.reshape(-1, 1), signed=True).reshape(codes.shape[0], -1)
    values = codes.astype(jnp.float32) * scales[:, None]
    n = 1
    for d in shape:
        n *= d
    return values.reshape(-1)[:n].reshape(shape)


def quantized_bytes(n: int, bits: int) -> int:
    """Bytes of one island's quantized outer gradient of n values: codes and f32 scales."""
    blocks = -(-n // BLOCK)
    return blocks * BLOCK * bits // 8 + 4 * blocks


# ----------------------------------------------------------------------------- fragments


def layer_stacked(spec) -> bool:
    return bool(spec.axes) and spec.axes[0] == "layers"


def fragment_due(t, step: int) -> list[int]:
    """The fragments synchronised after inner step `step` (1-based): p with step % H == (p+1) H/P % H."""
    o = t.outer
    h, f = o.every, o.fragments
    return [p for p in range(f) if step % h == ((p + 1) * h // f) % h]


def fragment_part(x, spec, fragment: int, fragments: int):
    """The part of leaf `x` in `fragment`, or None: rows fragment::P of a layer-stacked leaf; the
    whole of another leaf in fragment 0."""
    if fragments == 1:
        return x
    if layer_stacked(spec):
        return x[fragment::fragments]
    return x if fragment == 0 else None


def fragment_put(x, value, spec, fragment: int, fragments: int):
    if fragments == 1 or not layer_stacked(spec):
        return value
    return x.at[fragment::fragments].set(value)


def fragment_sizes(specs, fragments: int) -> list[list[int]]:
    """Values of every leaf's part in each fragment (one list per fragment)."""
    sizes: list[list[int]] = [[] for _ in range(fragments)]
    for spec in jax.tree.leaves(specs, is_leaf=is_spec):
        n = 1
        for d in spec.shape:
            n *= d
        if fragments == 1 or not layer_stacked(spec):
            sizes[0].append(n)
        else:
            layers = spec.shape[0]
            for p in range(fragments):
                sizes[p].append(n // layers * len(range(p, layers, fragments)))
    return sizes


# ----------------------------------------------------------------------------- per-shard steps


def _unstack(tree):
    return jax.tree.map(lambda a: a[0], tree)


def _stack(tree):
    return jax.tree.map(lambda a: a[None], tree)


def local_step(program, state, batch):
    """One inner step of this island (inside the train step's shard_map): (new state, metrics).
    The island's gradient is reduced over its own devices only; `TrainState.params` (theta) does not
    change."""
    t = program.config.train
    islands = program.layout.mesh_sizes[diloco.ISLAND_AXIS]
    o = state.opt_state
    params = _unstack(o.local)
    _, grads, metrics = program._local_grads(params, batch)
    # each shard's objective is its share of the global mean: the island's mean is M times its sum
    grads = jax.tree.map(lambda g: g * islands, grads)
    grad_norm = zero.global_norm(grads, program.grad_pspecs, program.layout, skip=(diloco.ISLAND_AXIS,))
    if t.grad_clip > 0:
        scale = jnp.minimum(1.0, t.grad_clip / (grad_norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
    updates, inner = program.optimizer.inner.update(grads, _unstack(o.inner), params)
    params = optax.apply_updates(params, updates)
    metrics.update(grad_norm=diloco.island_mean(grad_norm), lr=schedule(t)(state.step))
    return state._replace(step=state.step + 1, opt_state=o._replace(inner=_stack(inner), local=_stack(params))), metrics


def gap_penalized(stale, gap, lr: float):
    """CO2's staleness gap penalty (docs/diloco.md): the stale outer gradient divided, element by
    element, by 1 + |gap| / |lr stale|: the parameters' move since it was computed (the last outer
    step) in units of the plain step it would take itself."""
    tiny = jnp.finfo(jnp.float32).tiny  # 0 / 0 -> no penalty; a gap over a zero gradient -> 0
    return stale / (1 + jnp.abs(gap) / (lr * jnp.abs(stale) + tiny))


PHASES = ("all", "start", "finish")  # one sync; Streaming DiLoCo's overlap: the average, then the step


def local_sync(program, state, fragment: int, phase: str = "all"):
    """The outer step of `fragment` (inside a shard_map): the islands' outer gradients averaged over
    `data` (quantized when config.train.outer.quantize says, with error feedback), theta and the
    momentum updated, every island restarted from the new theta (or merged with it). With
    overlap_steps > 0 the sync is two programs: `start` averages and keeps the average in
    `delayed`, `finish` (tau steps later) takes the outer step with it."""
    o_cfg = program.config.train.outer
    bits = BITS.get(o_cfg.quantize)
    co2, ef, penalty = o_cfg.method == "co2", bool(o_cfg.error_feedback), bool(o_cfg.co2_penalty)
    s = state.opt_state
    leaves, treedef = jax.tree.flatten(state.params)
    specs = jax.tree.leaves(program.specs, is_leaf=is_spec)  # the parameters' order
    pspecs = jax.tree.leaves(program.param_pspecs, is_leaf=lambda x: isinstance(x, P))
    absent = lambda tree, f=lambda t: t: [None] * len(leaves) if _empty(tree) else jax.tree.leaves(f(tree))
    fields = dict(
        theta=leaves,
        local=jax.tree.leaves(_unstack(s.local)),
        momentum=jax.tree.leaves(s.momentum),
        delayed=absent(s.delayed),
        residual=absent(s.residual, _unstack),
        last_step=absent(s.last_step),
    )
    out = {k: list(v) for k, v in fields.items()}
    mine = [i for i, spec in enumerate(specs) if fragment_part(leaves[i], spec, fragment, o_cfg.fragments) is not None]
    part = lambda k, i: fragment_part(fields[k][i], specs[i], fragment, o_cfg.fragments)

    def put(k, i, value):
        out[k][i] = fragment_put(fields[k][i], value.astype(fields[k][i].dtype), specs[i], fragment, o_cfg.fragments)

    avg = {}
    if phase in ("all", "start"):
        for i in mine:
            delta = (part("theta", i) - part("local", i)).astype(jnp.float32)
            if bits is None:
                avg[i] = diloco.island_mean(delta)
                continue
            sent = delta + part("residual", i) if ef else delta
            avg[i], own = diloco.island_mean_quantized(
                sent, lambda v: quantize(v, bits), lambda c, sc: dequantize(c, sc, sent.shape, bits)
            )
            if ef:
                put("residual", i, sent - own)  # what this island's codes left out, sent next round
        if phase == "start":
            for i in mine:
                put("delayed", i, avg[i])
            return _rebuild(state, treedef, out)
    applied, moms = {}, {}
    for i in mine:
        if phase == "finish" or co2:
            stale = part("delayed", i).astype(jnp.float32)
            if penalty:
                stale = gap_penalized(stale, part("last_step", i), o_cfg.lr)
            applied[i] = stale
        else:
            applied[i] = avg[i]
        moms[i] = o_cfg.momentum * part("momentum", i) + applied[i]
    if o_cfg.momentum_clip > 0:  # one norm over the fragment's momentum, equal on every island
        norm = zero.global_norm(
            [moms[i] for i in mine], [pspecs[i] for i in mine], program.layout, skip=(diloco.ISLAND_AXIS,)
        )
        clip = jnp.minimum(1.0, o_cfg.momentum_clip / (norm + 1e-12))
        moms = {i: m * clip for i, m in moms.items()}
    alpha = o_cfg.merge
    for i in mine:  # the outer Nesterov-SGD step: u = Delta + mu m (or m), theta' = theta - lr u
        m = moms[i]
        u = applied[i] + o_cfg.momentum * m if o_cfg.nesterov else m
        theta = part("theta", i)
        new = (theta - o_cfg.lr * u).astype(theta.dtype)
        put("theta", i, new)
        put("momentum", i, m)
        # Streaming DiLoCo's merge: alpha of the island's own (current) values, 1 - alpha of the global
        put("local", i, new if alpha == 0 else alpha * part("local", i) + (1 - alpha) * new)
        if co2:
            put("delayed", i, avg[i])
        if penalty:
            put("last_step", i, new - theta)
    return _rebuild(state, treedef, out)


def _empty(tree) -> bool:
    return isinstance(tree, tuple) and not tree


def _rebuild(state, treedef, out):
    s = state.opt_state
    unflat = lambda k: jax.tree.unflatten(treedef, out[k])
    opt_state = s._replace(
        local=_stack(unflat("local")),
        momentum=unflat("momentum"),
        delayed=() if _empty(s.delayed) else unflat("delayed"),
        residual=() if _empty(s.residual) else _stack(unflat("residual")),
        last_step=() if _empty(s.last_step) else unflat("last_step"),
    )
    return state._replace(params=unflat("theta"), opt_state=opt_state)


def sync_fn(program, fragment: int, phase: str = "all"):
    """jit(state -> state) of `local_sync` of `fragment` (`phase`: PHASES); the state is donated."""
    step = program._shard_map(
        lambda st: local_sync(program, st, fragment, phase), (program.state_pspecs,), program.state_pspecs
    )
    return jax.jit(step, donate_argnums=0)


class Syncs:
    """The training loop's outer steps: `syncs(state, step)` after inner step `step` runs the outer
    step of every fragment due then; with overlap_steps = tau > 0, the `start` of those due at
    `step` and the `finish` of those started at `step - tau`. Compiled ahead (`state`: one to lower
    against)."""

    def __init__(self, program, state):
        self.t = program.config.train
        self.tau = self.t.outer.overlap_steps
        compile_ = lambda p, phase: sync_fn(program, p, phase).lower(state).compile()
        phases = ("start", "finish") if self.tau else ("all",)
        self.fns = {(p, ph): compile_(p, ph) for p in range(self.t.outer.fragments) for ph in phases}

    def __call__(self, state, step: int):
        if self.tau and step - self.tau >= 1:
            for p in fragment_due(self.t, step - self.tau):
                state = self.fns[p, "finish"](state)
        for p in fragment_due(self.t, step):
            state = self.fns[p, "start" if self.tau else "all"](state)
        return state


def round_bytes(specs, t, islands: int) -> dict:
    """Per device, one outer round (every fragment once): `operand` bytes each island contributes
    (f32 outer gradients, or codes + scales) and `wire` bytes it receives in a ring collective
    (all-reduce 2 (M-1)/M x operand; quantized all-gather (M-1) x operand)."""
    sizes = fragment_sizes(specs, t.outer.fragments)
    bits = BITS.get(t.outer.quantize)
    m = islands
    if bits is None:
        operand = [sum(4 * n for n in parts) for parts in sizes]
        wire = [2 * (m - 1) / m * b for b in operand]
    else:
        operand = [sum(quantized_bytes(n, bits) for n in parts) for parts in sizes]
        wire = [(m - 1) * b for b in operand]
    return {"fragments": operand, "operand": sum(operand), "wire": sum(wire)}
