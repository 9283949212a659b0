"""AdamW and its learning-rate schedules. Clipping by global norm is done by the train step with
`jaxsys.parallel.zero.global_norm`, which is correct when gradients are sharded."""

from __future__ import annotations

import jax
import optax

from jaxsys.models.params import ParamSpec


def schedule(t) -> optax.Schedule:
    """Linear warmup, then `cosine` (to min_lr_ratio * lr), `wsd` (warmup-stable-decay: constant,
    then linear decay over the last decay_fraction of the steps), or `constant`."""
    warmup = max(int(t.warmup_steps), 0)
    rest = max(int(t.steps) - warmup, 1)
    floor = t.lr * t.min_lr_ratio
    ramp = optax.linear_schedule(0.0, t.lr, warmup) if warmup else optax.constant_schedule(t.lr)
    if t.schedule == "cosine":
        tail = optax.cosine_decay_schedule(t.lr, rest, alpha=t.min_lr_ratio)
    elif t.schedule == "wsd":
        decay = max(int(round(rest * t.decay_fraction)), 1)
        tail = optax.join_schedules(
            [optax.constant_schedule(t.lr), optax.linear_schedule(t.lr, floor, decay)], [rest - decay])
    else:
        tail = optax.constant_schedule(t.lr)
    return optax.join_schedules([ramp, tail], [warmup]) if warmup else tail


def make_optimizer(t, specs) -> optax.GradientTransformation:
    """AdamW with weight decay on the leaves whose ParamSpec says so (not norms)."""
    if t.optimizer == "zo":  # MeZO: no state; jaxsys/zo.py makes the update from two forwards
        from jaxsys import zo
        return zo.optimizer()
    mask = jax.tree.map(lambda s: s.decay, specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    return optax.adamw(schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=mask)
