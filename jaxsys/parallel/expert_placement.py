"""Expert placement: which device of the expert axis holds which expert of each MoE layer, chosen
from routing statistics so that every device gets a similar share of the routed tokens (the load
balance of SmartMoE / FlexMoE placement) and, after MoETuner (Go & Mahajan 2025), so that experts
that consecutive layers route the same tokens to sit on the same device.

Device j of the ep devices holds the experts in slots [j E_l, (j+1) E_l) of a layer's expert arrays
(E_l = E / ep). A placement is a permutation per MoE layer: `perm[l, s]` is the current slot of the
expert that moves to slot s. Applying it permutes the experts' weights, the router's output columns
and their optimizer moments alike, so the model computes exactly the same function with the
experts relabelled; only where the routed tokens go changes. Statistics are in slot order:

    load[l, e]        token copies routed to slot e of MoE layer l
    pairs[l, i, j]    copies routed to slot i of MoE layer l-1 and to slot j of layer l (pairs[0] = 0)

`balance` chooses the placement in two steps:
  1. per layer, split the experts into ep groups of exactly E_l with the smallest heaviest group:
     longest-processing-time first into the lightest group with room, then swaps between the
     heaviest group and the others while one lowers the heaviest load (an NP-hard balanced number
     partition; LPT is within 4/3 of optimal and the swaps close most of the rest);
  2. (colocate) put layer l+1's experts where their tokens come from: number its groups by a linear
     assignment (Hungarian algorithm) of the [ep, ep] co-routing counts with layer l's devices, then
     swap experts between devices while a swap raises the co-routed copies and keeps the layer's
     heaviest device no heavier (balance stays a constraint, locality is the objective, as in
     MoETuner's formulation; a greedy local search, not its ILP).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.models.params import ParamSpec, is_spec

EXPERT_AXES = ("experts", "router_experts")  # the logical axes a placement permutes


# ----------------------------------------------------------------------------- measures


def device_load(load, ep: int) -> np.ndarray:
    """[L, E] copies per slot -> [L, ep] copies per device."""
    load = np.asarray(load)
    return load.reshape(load.shape[0], ep, -1).sum(-1)


def imbalance(load, ep: int) -> np.ndarray:
    """[L] max / mean of the per-device load of each layer (1 = perfectly even)."""
    per_device = device_load(load, ep).astype(np.float64)
    mean = per_device.mean(-1)
    return np.where(mean > 0, per_device.max(-1) / np.maximum(mean, 1e-30), 1.0)


def colocation(pairs, ep: int) -> float:
    """Fraction of consecutive-layer routing pairs whose two experts sit on the same device."""
    pairs = np.asarray(pairs, np.float64)
    if pairs.shape[0] < 2 or pairs[1:].sum() == 0:
        raise ValueError("co-location needs routing pairs of at least two consecutive MoE layers")
    e = pairs.shape[-1]
    device = np.arange(e) // (e // ep)
    same = device[:, None] == device[None, :]
    return float(pairs[1:][:, same].sum() / pairs[1:].sum())


def permute_stats(load, pairs, perm):
    """The statistics of a run as they would read after `perm` is applied."""
    load, perm = np.asarray(load), np.asarray(perm)
    new_load = np.take_along_axis(load, perm, axis=1)
    new_pairs = None
    if pairs is not None:
        pairs = np.asarray(pairs)
        new_pairs = np.zeros_like(pairs)
        for l in range(1, pairs.shape[0]):
            new_pairs[l] = pairs[l][perm[l - 1]][:, perm[l]]
    return new_load, new_pairs


# ----------------------------------------------------------------------------- choosing


def _partition(weights: np.ndarray, ep: int) -> list[list[int]]:
    """Indices of `weights` in ep groups of len/ep each, heaviest group as light as found."""
    size = len(weights) // ep
    groups, totals = [[] for _ in range(ep)], np.zeros(ep)
    for e in np.argsort(-weights, kind="stable"):
        open_ = [g for g in range(ep) if len(groups[g]) < size]
        g = min(open_, key=lambda g: (totals[g], g))
        groups[g].append(int(e))
        totals[g] += weights[e]
    improved = True
    while improved:  # swap between the heaviest group and another while the heaviest gets lighter
        improved = False
        top = int(np.argmax(totals))
        best = (totals[top], None)
        for g in range(ep):
            if g == top:
                continue
            for a in groups[top]:
                for b in groups[g]:
                    delta = weights[a] - weights[b]
                    if delta <= 0:
                        continue
                    new_max = max(totals[top] - delta, totals[g] + delta)
                    if new_max < best[0] - 1e-9:
                        best = (new_max, (g, a, b))
        if best[1] is not None:
            g, a, b = best[1]
            groups[top][groups[top].index(a)] = b
            groups[g][groups[g].index(b)] = a
            totals[top] -= weights[a] - weights[b]
            totals[g] += weights[a] - weights[b]
            improved = True
    return groups


def balance(load, ep: int, pairs=None, colocate: bool = True) -> np.ndarray:
    """A placement perm[L, E] (see the module docstring) for the statistics `load` [L, E] and, when
    `colocate`, the co-routing counts `pairs` [L, E, E] (both in the current slot order)."""
    from scipy.optimize import linear_sum_assignment

    load = np.asarray(load, np.float64)
    n_layers, e = load.shape
    if e % ep:
        raise ValueError(f"{e} experts do not split over {ep} devices")
    size = e // ep
    perm = np.zeros((n_layers, e), np.int64)
    for l in range(n_layers):
        groups = _partition(load[l], ep)
        if colocate and pairs is not None and l > 0:
            # affinity[j, d]: copies routed to expert j of layer l whose previous expert is on device d
            prev_device = np.empty(e, np.int64)
            prev_device[perm[l - 1]] = np.arange(e) // size  # where each old slot of layer l-1 went
            affinity = np.zeros((e, ep))
            np.add.at(affinity.T, prev_device, np.asarray(pairs[l], np.float64))
            flow = np.stack([affinity[members].sum(0) for members in groups])  # [group, device]
            rows, cols = linear_sum_assignment(-flow)
            order = [None] * ep
            for g, d in zip(rows, cols):
                order[d] = groups[g]
            groups = _swap_for_locality(order, load[l], affinity)
        perm[l] = [s for group in groups for s in sorted(group)]
    return perm


def _swap_for_locality(groups, weights, affinity) -> list[list[int]]:
    """Greedy pairwise swaps of experts between devices (group g on device g) that raise the
    co-routed copies sum_j affinity[j, device(j)] while no device gets heavier than the heaviest now."""
    e, ep = affinity.shape
    device = np.empty(e, np.int64)
    for g, members in enumerate(groups):
        device[members] = g
    totals = np.array([weights[m].sum() for m in groups])
    bound = totals.max() + 1e-9
    while True:
        here = affinity[np.arange(e), device]
        # gain[a, b] of swapping a and b: a moves to b's device, b to a's
        gain = (
            affinity[np.arange(e)[:, None], device[None, :]]
            + affinity[np.arange(e)[None, :], device[:, None]]
            - here[:, None]
            - here[None, :]
        )
        moved = weights[None, :] - weights[:, None]  # load change of a's device when a and b swap
        feasible = (totals[device][:, None] + moved <= bound) & (totals[device][None, :] - moved <= bound)
        feasible &= device[:, None] != device[None, :]
        gain = np.where(feasible, gain, 0.0)
        a, b = np.unravel_index(np.argmax(gain), gain.shape)
        if gain[a, b] <= 1e-9:
            break
        totals[device[a]] += moved[a, b]
        totals[device[b]] -= moved[a, b]
        device[a], device[b] = device[b], device[a]
    return [list(np.flatnonzero(device == g)) for g in range(ep)]


# ----------------------------------------------------------------------------- applying


def _expert_dim(spec: ParamSpec) -> int | None:
    for name in EXPERT_AXES:
        if name in spec.axes:
            return spec.axes.index(name)
    return None


def permute_leaf(leaf, spec: ParamSpec, perm):
    """Move slot perm[l, s] of MoE layer l to slot s along the leaf's expert axis. The layer axes
    (`layers`, and `chunks` of an interleaved pipeline before it) lead, so perm [Lm, E] reshapes
    onto them."""
    dim = _expert_dim(spec)
    if dim is None:
        return leaf
    lead = spec.axes.index("layers") + 1
    index = jnp.asarray(perm).reshape(leaf.shape[:lead] + (perm.shape[-1],))
    index = index.reshape(index.shape[:lead] + (1,) * (dim - lead) + index.shape[-1:] + (1,) * (leaf.ndim - dim - 1))
    return jnp.take_along_axis(leaf, index, axis=dim)


def permute_params(params, specs, perm):
    """Every MoE leaf of a parameter-shaped tree (parameters, gradients, an Adam moment)."""
    if "moe" not in specs["layers"]:
        return params
    moe = jax.tree.map(
        lambda leaf, spec: permute_leaf(leaf, spec, perm),
        params["layers"]["moe"],
        specs["layers"]["moe"],
        is_leaf=lambda x: is_spec(x),
    )
    return {**params, "layers": {**params["layers"], "moe": moe}}


def n_moe_layers(specs) -> int:
    """Lm, the MoE layers of a parameter spec tree (0 for a dense model)."""
    if "moe" not in specs.get("layers", {}):  # a dense model (or a Flax module without jaxsys's layers)
        return 0
    router = specs["layers"]["moe"]["router"]
    return math.prod(router.shape[: router.axes.index("layers") + 1])


# ----------------------------------------------------------------------------- during training


class RoutingLog:
    """The routing statistics of a run, on the host: each step's fields of metrics.jsonl, and the
    totals since the last re-placement, which `rebalance` reads and `save` writes."""

    def __init__(self, n_layers: int, n_experts: int, ep: int):
        self.ep = ep
        self.load = np.zeros((n_layers, n_experts), np.int64)
        self.pairs = np.zeros((n_layers, n_experts, n_experts), np.int64)
        self.steps = 0

    def add(self, load, pairs) -> None:
        self.load += np.asarray(load, np.int64)
        self.pairs += np.asarray(pairs, np.int64)
        self.steps += 1

    def record(self, load, dropped) -> dict:
        """metrics.jsonl fields of one step: per MoE layer the share of each expert (slot) in the
        routed copies, the dropped fraction and the per-device imbalance (max / mean)."""
        load = np.asarray(load, np.float64)
        copies = np.maximum(load.sum(-1), 1)
        per_layer = imbalance(load, self.ep)
        return {
            "moe_dropped_fraction": float(np.sum(dropped) / copies.sum()),
            "moe_device_imbalance_max": float(per_layer.max()),
            "moe_device_imbalance": [round(float(x), 4) for x in per_layer],
            "moe_dropped_fraction_per_layer": [round(float(x), 5) for x in np.asarray(dropped) / copies],
            "moe_expert_load": [[round(float(x), 5) for x in row] for row in load / copies[:, None]],
        }

    def rebalance(self, colocate: bool) -> tuple[np.ndarray, dict]:
        """A placement from the totals since the last one, what it should do to them (imbalance and
        co-location, before and after), and a fresh window."""
        perm = balance(self.load, self.ep, self.pairs, colocate)
        load, pairs = permute_stats(self.load, self.pairs, perm)
        summary = {
            "moe_rebalanced_after_steps": self.steps,
            "moe_window_imbalance_before": round(float(imbalance(self.load, self.ep).max()), 4),
            "moe_window_imbalance_after": round(float(imbalance(load, self.ep).max()), 4),
        }
        # co-location is between consecutive MoE layers; under a pipeline with one MoE layer per
        # stage there are no pairs (choices are not sent between stages)
        if self.pairs[1:].any():
            summary.update(
                moe_window_colocation_before=round(colocation(self.pairs, self.ep), 4),
                moe_window_colocation_after=round(colocation(pairs, self.ep), 4),
            )
        self.load[:], self.pairs[:], self.steps = 0, 0, 0
        return perm, summary

    def save(self, path: str) -> None:
        np.savez(path, load=self.load, pairs=self.pairs, steps=self.steps, ep=self.ep)
