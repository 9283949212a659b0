"""Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training"): the momentum of
each hidden weight matrix orthogonalized by a Newton-Schulz iteration, Adam for the other leaves,
inside the sharded train step.

A chosen leaf (`config.train.muon.leaves`) is seen as a batch of m x n matrices, GaLore's view
(galore.matrix_plans: rows the `embed` dimension, `layers` / `experts` / `chunks` batch
dimensions, the rest columns: wq [L, D, N, H] is L matrices of D x NH, the experts' w_gate
[L, E, D, F] L E matrices of D x F). Per step, with optax's bias-corrected momentum:

    mu <- beta mu + (1 - beta) G
    M   = beta mu^ + (1 - beta) G^   (Nesterov; mu^, G^ bias-corrected)   or mu^
    O   = NS(M / (|M|_F + eps))      five steps of X <- a X + (b A + c A^2) X, A = X X^T,
                                      (a, b, c) = (3.4445, -4.7750, 2.0315), on the wide side
    update = O sqrt(max(m, n)) rms   (Moonlight's: the update's RMS is AdamW's, ~rms, so AdamW's
                                      learning rate and weight decay carry over; rms = 0.2)
          or O sqrt(max(1, fan_out / fan_in))   (Keller Jordan's width scaling: consistent_rms=0)

fan_in is m when the rows come first among the leaf's non-batch dimensions (wq, wk, wv, w_gate,
w_up: [D, out]) and n otherwise (wo [N, H, D], w_down [F, D]). The other leaves (embeddings, the
output head, norms, biases, the router) get Adam, and the chain around it
(`optimizer.make_optimizer`) adds decoupled weight decay and the learning rate, as AdamW's does:
with no leaf chosen the optimizer is AdamW exactly.

Sharding: the update runs inside the train step's shard_map on each device's block of a gradient.
The momentum is elementwise, so it stays sharded like the gradient (ZeRO and FSDP split it as they
split Adam's moments). The orthogonalization needs whole matrices: M is all-gathered over the
row and column axes of its gradient spec (`galore.whole_matrices`: FSDP's, ZeRO's and tensor's),
each device runs NS on the matrices of its own batch slice (pipeline stages and expert shards
keep theirs), and keeps its own block of O (a slice). Per step and matrix that is an all-gather of
M (its bytes, once) and ~5 (2 m^2 n + 2 m^3) FLOPs on the smaller side m, run on every device of
the gather group. NS runs in fp32.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxsys.optim import galore
from jaxsys.parallel import muon as comm

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: the largest slope at zero that still converges


def newton_schulz(x, steps: int = 5, eps: float = 1e-8):
    """The Newton-Schulz orthogonalization of a batch of matrices x [b, m, n] (fp32): normalised by
    the Frobenius norm, iterated on the wide side (X X^T is min(m, n) square), ~U V^T of x's SVD
    with singular values in about [0.7, 1.2]."""
    a, b, c = NS_COEFFS
    wide = x.shape[-2] <= x.shape[-1]
    x = x if wide else jnp.swapaxes(x, -1, -2)
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
    mm = lambda p, q: jnp.matmul(p, q, precision=jax.lax.Precision.HIGHEST)
    for _ in range(steps):
        gram = mm(x, jnp.swapaxes(x, -1, -2))
        x = a * x + mm(b * gram + c * mm(gram, gram), x)
    return x if wide else jnp.swapaxes(x, -1, -2)


def shape_scale(pl: galore.LeafPlan, consistent_rms: float) -> float:
    """The update's factor for an m x n matrix: sqrt(max(m, n)) * consistent_rms, or with
    consistent_rms 0 sqrt(max(1, fan_out / fan_in)) (module docstring)."""
    m, n = pl.m, pl.n
    if consistent_rms:
        return math.sqrt(max(m, n)) * consistent_rms
    first = min(d for d in range(len(pl.shape)) if d not in pl.batch_dims)
    fan_in, fan_out = (m, n) if pl.row_dim == first else (n, m)
    return math.sqrt(max(1.0, fan_out / fan_in))


class MuonState(NamedTuple):
    count: Any  # int32 []
    mu: Any  # the momentum, shaped (and sharded) like the chosen leaves' gradients


def _spread(pl: galore.LeafPlan, local_shape, mesh_sizes) -> bool:
    """Whether the G devices that share a leaf's matrices (its row and column axes) can each take
    1/G of them: its local batch (layers, experts of this device) divides by G."""
    axes = (*pl.row_axes, *pl.col_axes)
    if not axes or mesh_sizes is None:
        return False
    group = math.prod(mesh_sizes[a] for a in axes)
    return math.prod(local_shape[d] for d in pl.batch_dims) % group == 0


def scale_by_muon(
    plans,
    beta: float = 0.95,
    steps: int = 5,
    nesterov: bool = True,
    consistent_rms: float = 0.2,
    eps: float = 1e-8,
    mesh_sizes=None,
) -> optax.GradientTransformation:
    """Muon's direction (module docstring) for the leaves `plans` (galore.matrix_plans) mark
    "full"; the other positions hold optax's MaskedNode (this runs inside optax.multi_transform)
    and pass through. `update` runs on local shards inside the train step's shard_map, or on whole
    arrays when nothing is sharded."""
    is_plan = lambda x: isinstance(x, galore.LeafPlan)

    def init(params):
        return MuonState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params))

    def direction(pl, m):
        if pl.side != "full":
            return m
        scale = shape_scale(pl, consistent_rms)
        if _spread(pl, m.shape, mesh_sizes):  # each device orthogonalizes 1/G of the matrices
            x = galore.to_matrices(m, pl)
            for axes, dim in ((pl.row_axes, 1), (pl.col_axes, 2)):
                x = comm.spread_matrices(x, dim, axes)
            x = newton_schulz(x.astype(jnp.float32), steps, eps) * scale
            for axes, dim in ((pl.col_axes, 2), (pl.row_axes, 1)):
                x = comm.gather_matrices(x, dim, axes)
            return galore.from_matrices(x, pl, m.shape).astype(m.dtype)
        o = newton_schulz(galore.whole_matrices(m, pl), steps, eps) * scale
        return galore.own_matrix_block(o, pl, m.shape).astype(m.dtype)

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: beta * m + (1 - beta) * g,
                optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                optax.tree.bias_correction(updates, beta, count),
            )
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        return jax.tree.map(direction, plans, mu_hat, is_leaf=is_plan), MuonState(count, mu)

    return optax.GradientTransformation(init, update)


def labels(plans):
    """ "muon" for the leaves Muon orthogonalizes, "adam" for the rest (optax.multi_transform)."""
    return jax.tree.map(
        lambda pl: "muon" if pl.side == "full" else "adam", plans, is_leaf=lambda x: isinstance(x, galore.LeafPlan)
    )


def plan(m, specs, grad_pspecs=None, mesh_sizes=None):
    """`config.train.muon` (`m`)'s leaves as galore.matrix_plans (ConfigError for a bad name)."""
    return galore.matrix_plans(m.leaves, "config.train.muon.leaves", specs, grad_pspecs, mesh_sizes)
