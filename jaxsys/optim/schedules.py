"""Learning-rate schedules: the one schedule of `config.train`, used by every optimizer (AdamW and
GaLore through `optimizer.make_optimizer`, zeroth-order training through `zo.local_step`) and
reported as the step's `lr`."""

from __future__ import annotations

import optax


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
            [optax.constant_schedule(t.lr), optax.linear_schedule(t.lr, floor, decay)], [rest - decay]
        )
    else:
        tail = optax.constant_schedule(t.lr)
    return optax.join_schedules([ramp, tail], [warmup]) if warmup else tail
