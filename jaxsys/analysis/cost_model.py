"""The papers' closed forms, evaluated for a config, to put beside what the compiled program does.

Conventions: bytes are per device per training step. A collective's `bytes` is what one device
sends over the wire under the ring algorithm (Patarasuk & Yuan 2009; the scaling book's
"collectives" chapter), for a group of n devices and an operand of M bytes per device:

    all-reduce      2 M (n-1)/n        (reduce-scatter + all-gather)
    all-gather      M (n-1)            (M = the local shard; the result is n M)
    reduce-scatter  M (n-1)/n          (M = the full local input)
    all-to-all      M (n-1)/n
    permute         M

Formulas (Ψ = parameters held per device after tensor parallelism; b_p, b_c = bytes of the
parameter and compute dtypes):

    ZeRO (Rajbhandari et al. 2020), per device, N = data size (fsdp size for stage 3):
        stage 0: b_p Ψ + b_p Ψ + K Ψ          stage 1: b_p Ψ + b_p Ψ + K Ψ / N
        stage 2: b_p Ψ + b_p Ψ / N + K Ψ / N  stage 3: (b_p + b_p + K) Ψ / N
      with K = 2 b_p for Adam's two moments (the paper's mixed-precision K = 12 also counts an fp32
      master copy, which jaxsys does not keep: its parameters are the master copy).
    Data parallelism: all-reduce of the gradient, 2 Ψ b_p (N-1)/N. ZeRO-2: reduce-scatter + all-gather,
      the same bytes. ZeRO-1 as specified here (all-reduce, then all-gather of the updated slices):
      3 Ψ b_p (N-1)/N.
    FSDP: all-gather forward, all-gather again backward, reduce-scatter of the gradient:
      3 Ψ_layers b_c (N-1)/N (+ 2 Ψ_rest for the embedding and norms gathered once outside the scan).
    Megatron TP (Shoeybi et al. 2019): per layer 4 all-reduces of [B, T, D] (2 forward, 2 backward),
      each 2 B T D b_c (t-1)/t; with sequence parallelism (Korthikanti et al. 2022) 4 all-gathers and
      4 reduce-scatters of the same total bytes.
    Expert parallelism (GShard; docs/moe.md): see `expert_parallel_rows`.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxsys.analysis import flops as flops_lib
from jaxsys.analysis.hardware import Hardware
from jaxsys.models import transformer
from jaxsys.models.params import ParamSpec

TP_LOGICAL = ("heads", "kv_heads", "mlp", "vocab")


def axis_bandwidth(mesh_sizes: dict, hw: Hardware, dcn: dict | None = None) -> dict:
    """Bytes/s per device and direction for each mesh axis: an axis with a DCN factor > 1
    (`config.dcn`) crosses slices or hosts; otherwise the innermost axes whose product fits in a
    node (or TPU slice) use the intra-node links, the rest the inter-node network."""
    out, inner = {}, 1
    for axis in reversed(list(mesh_sizes)):
        inner *= mesh_sizes[axis]
        crosses = (dcn or {}).get(axis, 1) > 1 or inner > hw.devices_per_node
        out[axis] = hw.inter_node_bytes_per_s if crosses else hw.intra_node_bytes_per_s
    return out


# ----------------------------------------------------------------------------- collectives


def ring_bytes(kind: str, operand_bytes: float, n: int) -> float:
    """Bytes one device sends for one collective over n devices (ring algorithm)."""
    if n <= 1:
        return 0.0
    return {
        "all_reduce": 2 * operand_bytes * (n - 1) / n,
        "all_gather": operand_bytes * (n - 1),
        "reduce_scatter": operand_bytes * (n - 1) / n,
        "all_to_all": operand_bytes * (n - 1) / n,
        "collective_permute": operand_bytes,
    }[kind]


def _dtype_bytes(name: str) -> int:
    return {"float32": 4, "bfloat16": 2}[name]


def _specs(config) -> list[ParamSpec]:
    if config.model.kind == "flax":  # a Flax module's parameters (models/flax_model.py)
        from jaxsys.models import flax_model

        return jax.tree.leaves(flax_model.specs_for(config), is_leaf=lambda x: isinstance(x, ParamSpec))
    return jax.tree.leaves(transformer.param_specs(config.model), is_leaf=lambda x: isinstance(x, ParamSpec))


def _local_numel(config, spec: ParamSpec) -> float:
    """Elements of a leaf per device after tensor parallelism (a heads/kv_heads/mlp/vocab axis is
    split t ways) and expert parallelism (an experts axis is split over `expert`)."""
    numel = math.prod(spec.shape) / (config.mesh.tensor if any(a in TP_LOGICAL for a in spec.axes) else 1)
    return numel / (config.mesh.expert if "experts" in spec.axes else 1)


def params_per_device_after_tp(config) -> tuple[float, float, int, int]:
    """(Ψ_layers, Ψ_rest, leaves_layers, leaves_rest): elements per device after tensor and expert
    parallelism (`_local_numel`)."""
    layers = rest = 0.0
    n_layers = n_rest = 0
    for spec in _specs(config):
        numel = _local_numel(config, spec)
        if "layers" in spec.axes:
            layers, n_layers = layers + numel, n_layers + 1
        else:
            rest, n_rest = rest + numel, n_rest + 1
    return layers, rest, n_layers, n_rest


def local_batch(config) -> int:
    """B per device: the global batch over the batch axes (data, fsdp, expert)."""
    mesh = config.mesh
    return config.train.batch_size // (mesh.data * mesh.fsdp * mesh.expert)


def layer_leaf_executions(config) -> int:
    """Uses of a layer leaf per forward: the sum over the layer leaves of the layers each holds (L for
    the attention leaves, the dense-MLP and the MoE layers for theirs)."""
    return sum(spec.shape[0] for spec in _specs(config) if "layers" in spec.axes)


@dataclasses.dataclass(frozen=True)
class Row:
    technique: str
    kind: str
    axes: tuple[str, ...]
    count: int
    bytes: float  # ring bytes sent per device, all `count` collectives together


def predicted_collectives(config) -> tuple[list[Row], list[str]]:
    """Collectives per step by the papers' formulas for the layout of `config`, and the caveats
    where a formula is not exact for this layout (the rows are then an estimate)."""
    mesh, m = config.mesh, config.model
    d, f, t, e = mesh.data, mesh.fsdp, mesh.tensor, mesh.expert
    b_p, b_c = _dtype_bytes(m.param_dtype), _dtype_bytes(m.compute_dtype)
    psi_l, psi_r, n_l, n_r = params_per_device_after_tp(config)
    leaves = n_l + n_r
    B_local, T, D, L = local_batch(config), config.data.seq_len, m.d_model, m.n_layers
    sp = config.parallel.sequence_parallel and t > 1
    stage = config.train.zero_stage
    cp = mesh.seq
    T = T // cp  # tokens per device along the sequence
    rows, caveats = [], []
    if sum(a > 1 for a in (d, f, e, t, cp)) > 1:
        caveats.append(
            "combined layouts: gradient sums over several axes run as one collective over "
            "those axes; the per-axis rows below are an estimate"
        )
    if m.remat != "none" and t > 1:
        caveats.append(
            f"remat={m.remat}: the backward recomputes tensor-parallel forward collectives, "
            "which the Megatron count (no recomputation) leaves out"
        )

    if cp > 1:  # every device saw T/cp of the tokens: gradients are summed over `seq` as over `data`
        rows.append(
            Row(
                "CP gradient all-reduce",
                "all_reduce",
                ("seq",),
                leaves,
                ring_bytes("all_reduce", (psi_l + psi_r) / f * b_p, cp),
            )
        )
        rows += context_parallel_rows(config)
    if d > 1:  # data parallelism / ZeRO over `data`; FSDP leaves are already 1/f
        grad_bytes = (psi_l + psi_r) / f * b_p
        if stage == 2:
            rows.append(
                Row(
                    "ZeRO-2 gradient reduce-scatter",
                    "reduce_scatter",
                    ("data",),
                    leaves,
                    ring_bytes("reduce_scatter", grad_bytes, d),
                )
            )
        else:
            rows.append(
                Row("DP gradient all-reduce", "all_reduce", ("data",), leaves, ring_bytes("all_reduce", grad_bytes, d))
            )
        if stage >= 1:
            rows.append(
                Row(
                    f"ZeRO-{stage} parameter all-gather",
                    "all_gather",
                    ("data",),
                    leaves,
                    ring_bytes("all_gather", grad_bytes / d, d),
                )
            )
    if e > 1:  # the expert axis splits the batch: leaves not split over experts sum their gradient
        shared = [s for s in _specs(config) if "experts" not in s.axes]
        rows.append(
            Row(
                "EP axis as DP: gradient all-reduce (leaves not split over experts)",
                "all_reduce",
                ("expert",),
                len(shared),
                ring_bytes("all_reduce", sum(_local_numel(config, s) for s in shared) / f * b_p, e),
            )
        )
    if f > 1:
        gather_bytes = (2 * psi_l + psi_r) * b_c / f  # local shards in, twice for the layers
        uses = layer_leaf_executions(config)
        rows.append(
            Row(
                "FSDP weight all-gather (forward + backward re-gather)",
                "all_gather",
                ("fsdp",),
                2 * uses + n_r,
                ring_bytes("all_gather", gather_bytes, f),
            )
        )
        rows.append(
            Row(
                "FSDP gradient reduce-scatter",
                "reduce_scatter",
                ("fsdp",),
                uses + n_r,
                ring_bytes("reduce_scatter", (psi_l + psi_r) * b_c, f),
            )
        )
        if config.parallel.get("fsdp_prefetch", False):
            # the scan's last iteration gathers one layer it does not use, and (the delayed
            # reduce-scatter) reduce-scatters its zero gradient: one layer's pair per layer stack run
            # (per micro-batch under a pipeline); docs/comm_overlap.md
            runs = config.train.microbatches if mesh.pipe > 1 else 1
            layer = psi_l / m.n_layers
            n_l = params_per_device_after_tp(config)[2]
            rows.append(
                Row(
                    "FSDP prefetch: the last iteration's unused layer gather",
                    "all_gather",
                    ("fsdp",),
                    runs * n_l,
                    runs * ring_bytes("all_gather", layer * b_c / f, f),
                )
            )
            rows.append(
                Row(
                    "FSDP prefetch: its zero-gradient reduce-scatter",
                    "reduce_scatter",
                    ("fsdp",),
                    runs * n_l,
                    runs * ring_bytes("reduce_scatter", layer * b_c, f),
                )
            )
    rows += expert_parallel_rows(config)
    if t > 1:
        act = B_local * T * D * b_c
        n_act = 4 * L + 2  # 4 per layer + embedding (forward) + final projection (backward)
        if sp:
            rows.append(
                Row(
                    "Megatron SP all-gather",
                    "all_gather",
                    ("tensor",),
                    n_act,
                    n_act * ring_bytes("all_gather", act / t, t),
                )
            )
            rows.append(
                Row(
                    "Megatron SP reduce-scatter",
                    "reduce_scatter",
                    ("tensor",),
                    n_act,
                    n_act * ring_bytes("reduce_scatter", act, t),
                )
            )
            replicated = [s for s in _specs(config) if not any(a in TP_LOGICAL for a in s.axes)]
            rows.append(
                Row(
                    "SP replicated-weight (norms, routers) gradient all-reduce",
                    "all_reduce",
                    ("tensor",),
                    len(replicated),
                    ring_bytes("all_reduce", sum(math.prod(s.shape) for s in replicated) / f * b_p, t),
                )
            )
        else:
            rows.append(
                Row(
                    "Megatron TP activation all-reduce",
                    "all_reduce",
                    ("tensor",),
                    n_act,
                    n_act * ring_bytes("all_reduce", act, t),
                )
            )
        rows.append(
            Row(
                "vocab-parallel cross-entropy (max, sum, target)",
                "all_reduce",
                ("tensor",),
                3,
                3 * ring_bytes("all_reduce", B_local * T * 4, t),
            )
        )
        rows += moe_tensor_rows(config)
    if config.train.optimizer == "zo":
        return zeroth_order_rows(config, rows, caveats)
    galore = galore_rows(config)
    if any(r.kind == "all_gather" for r in galore):
        caveats.append(
            f"GaLore's refresh all-gathers run one step in train.galore.update_every="
            f"{config.train.galore.update_every}; the program holds them once, and so do these rows"
        )
    return rows + galore + muon_rows(config), caveats


def zeroth_order_rows(config, rows: list[Row], caveats: list[str]) -> tuple[list[Row], list[str]]:
    """The first-order rows of `predicted_collectives` turned into a zeroth-order step's
    (train.optimizer='zo', jaxsys/optim/zo.py): two forwards, no backward. No gradient is synchronised
    (every replica draws the same z; the only cross-replica sums are the forwards' scalar losses),
    so the gradient rows go; the FSDP weights are gathered once per use in each forward; the
    vocabulary-parallel loss's three all-reduces run in each forward. Megatron's activation
    all-reduces keep their count: a backward mirrors its forward's (2L + 1 each), and so does a
    second forward. Context- and expert-parallel rows count a forward and a backward, which two
    forwards match only roughly (a caveat says so)."""
    mesh, m = config.mesh, config.model
    psi_l, psi_r, _, n_r = params_per_device_after_tp(config)
    f, b_c = mesh.fsdp, _dtype_bytes(m.compute_dtype)
    out = []
    for r in rows:
        if "gradient" in r.technique or r.technique.startswith("ZeRO-"):
            continue
        if r.technique.startswith("FSDP weight all-gather"):
            r = Row(
                "FSDP weight all-gather (each of the two forwards)",
                "all_gather",
                ("fsdp",),
                2 * (layer_leaf_executions(config) + n_r),
                ring_bytes("all_gather", 2 * (psi_l + psi_r) * b_c / f, f),
            )
        elif r.technique.startswith("vocab-parallel cross-entropy"):
            r = dataclasses.replace(r, count=2 * r.count, bytes=2 * r.bytes)
        out.append(r)
    # no backward: nothing recomputed, and no gradient sums over combined axes
    caveats = [c for c in caveats if not c.startswith(("remat=", "combined layouts"))]
    if mesh.seq > 1 or mesh.expert > 1:
        caveats.append(
            "train.optimizer='zo': the context- and expert-parallel rows count a forward and a "
            "backward; the step runs two forwards"
        )
    return out, caveats


def _moe(config) -> tuple[int, int, int]:
    """(Lm, E, k): MoE layers, experts and experts per token (Lm = 0 for a dense model)."""
    m = config.model
    return transformer.layer_counts(m)["moe"], m.moe.experts, m.moe.top_k


def expert_parallel_rows(config) -> list[Row]:
    """Expert parallelism's communication per step and device over the Lm MoE layers (models/moe.py,
    parallel/expert.py), ep = mesh.expert, B and T this device's batch rows and positions,
    M = B T k the token copies it routes:

      capacity  the dispatch and combine all-to-alls of the [B, E, C, D] slot buffers (C = ceil(cf k T
                / E)), forward and transposed backward: 4 per layer of B E C D b_c bytes each
      dropless  (padded) the same 4 of the [ep, M, D] send buffers (every slice padded to M rows, ep x
                what a ragged all-to-all sends), and per layer forward 4 int32 all-to-alls of sizes
                and offsets (the [ep, E/ep] counts and three [ep] offset vectors)
      routing   per layer an all-reduce over the token axes of the [E] loads and [E, E] co-routing
                counts (and a scalar one of the dropped copies, with the metrics); with ep > 1 an
                all-gather over `expert` of the [ep] copies each device sends each other (the
                traffic matrix), summed over the other token axes
    A remat policy other than `none` recomputes the forward's all-to-alls (data and int32) and the
    load all-reduce in the backward."""
    from jaxsys.models import moe

    mesh, m = config.mesh, config.model
    lm, experts, k = _moe(config)
    if not lm:
        return []
    ep, again = mesh.expert, 1 if m.remat != "none" else 0
    b = local_batch(config)
    tokens = config.data.seq_len // mesh.seq  # after Megatron SP's all-gather, the full local T
    b_c, d = _dtype_bytes(m.compute_dtype), m.d_model
    rows = []
    if ep > 1:
        if m.moe.capacity_factor > 0:
            buffer = b * experts * moe.capacity(tokens, m.moe) * d * b_c
            rows.append(
                Row(
                    "EP capacity dispatch + combine all-to-all (GShard)",
                    "all_to_all",
                    ("expert",),
                    lm * (4 + 2 * again),
                    lm * (4 + 2 * again) * ring_bytes("all_to_all", buffer, ep),
                )
            )
        else:
            buffer = ep * b * tokens * k * d * b_c
            rows.append(
                Row(
                    "EP dropless dispatch + combine all-to-all (padded to M rows per slice)",
                    "all_to_all",
                    ("expert",),
                    lm * (4 + 2 * again),
                    lm * (4 + 2 * again) * ring_bytes("all_to_all", buffer, ep),
                )
            )
            sizes = (ep * (experts // ep) + 3 * ep) * 4
            rows.append(
                Row(
                    "EP dropless sizes and offsets all-to-all (int32)",
                    "all_to_all",
                    ("expert",),
                    lm * 4 * (1 + again),
                    lm * (1 + again) * ring_bytes("all_to_all", sizes, ep),
                )
            )
    token_axes = tuple(a for a in ("data", "fsdp", "expert", "seq") if mesh[a] > 1)
    if ep > 1:
        rows.append(
            Row(
                "MoE traffic matrix all-gather",
                "all_gather",
                ("expert",),
                lm,
                lm * ring_bytes("all_gather", ep * 4, ep),
            )
        )
        others = tuple(a for a in token_axes if a != "expert")
        if others:
            rows.append(
                Row(
                    "MoE traffic matrix all-reduce",
                    "all_reduce",
                    others,
                    lm,
                    lm * ring_bytes("all_reduce", ep * ep * 4, math.prod(mesh[a] for a in others)),
                )
            )
    if token_axes:
        n = math.prod(mesh[a] for a in token_axes)
        rows.append(
            Row(
                "MoE routing statistics all-reduce (loads, co-routing)",
                "all_reduce",
                token_axes,
                lm * (2 + again),
                lm * ring_bytes("all_reduce", (experts + experts * experts + again * experts) * 4, n),
            )
        )
    return rows


def moe_tensor_rows(config) -> list[Row]:
    """What MoE layers add to Megatron TP over `tensor` (t > 1): the router runs before the
    tensor-parallel region, so its gates enter it like h. Without SP: the gates' Megatron `f`, an
    all-reduce of [B, T, k] fp32 backward. With SP: an all-gather of the gates [B, T/t, k] fp32 and of
    the chosen experts (int32) forward, a reduce-scatter of the gates' gradient backward; and the
    per-position balance and z losses summed over the ranks (2 scalar all-reduces, with the metrics)."""
    mesh = config.mesh
    lm, _, k = _moe(config)
    t = mesh.tensor
    if not lm or t == 1:
        return []
    b = local_batch(config)
    gates = b * (config.data.seq_len // mesh.seq) * k * 4  # [B, T, k] fp32 (int32 experts alike)
    if not (config.parallel.sequence_parallel and t > 1):
        return [
            Row(
                "MoE gates Megatron f (backward all-reduce)",
                "all_reduce",
                ("tensor",),
                lm,
                lm * ring_bytes("all_reduce", gates, t),
            )
        ]
    return [
        Row(
            "MoE gates and experts all-gather over T (SP)",
            "all_gather",
            ("tensor",),
            2 * lm,
            2 * lm * ring_bytes("all_gather", gates / t, t),
        ),
        Row(
            "MoE gates gradient reduce-scatter over T (SP)",
            "reduce_scatter",
            ("tensor",),
            lm,
            lm * ring_bytes("reduce_scatter", gates, t),
        ),
    ]


def context_parallel_rows(config) -> list[Row]:
    """Attention's communication over `seq` per step (forward + backward), per device, for
    P = mesh.seq; K, N are this device's key/value and query heads (after tensor parallelism).

      ring       forward: P-1 hops of K and V; backward: P-1 hops of K, V, dK, dV and one more of
                 dK, dV (home): 4(P-1) S_kv + (2(P-1) + 2) S_kv32 per layer, S_kv = B (T/P) K H
                 bytes of the compute dtype, S_kv32 the same in fp32 (the accumulators)
      allgather  2 all-gathers of [B, T/P, K, H] and 2 reduce-scatters of [B, T, K, H]: 4 (P-1) S_kv
      tokenring  per hop, queries forward and the fp32 partial output and LSE back, and their
                 transposes backward: 2 (P-1) (S_q + S_o + S_lse)
      LASP-2     one all-gather of the c [B, N, H, H] fp32 chunk states per linear layer forward and
                 its reduce-scatter backward: 2 (P-1) c B N H^2 4 bytes, independent of T
    A remat policy other than `none` recomputes the forward's share in the backward. With
    adaptive CP's tiers (config.data.adaptive_cp_local, adaptive_cp_groups) T/P is the full ring
    region's tokens, and each group tier (g, L_g) adds the ring's terms with g for P and L_g for T/P."""
    from jaxsys.models import attention

    mesh, m = config.mesh, config.model
    p, t = mesh.seq, mesh.tensor
    b = local_batch(config)
    tl, h, bc = config.data.seq_len // p, m.head_dim, _dtype_bytes(m.compute_dtype)
    rings = [(p, tl)]  # (devices, tokens a device) of each ring: the tiers' (docs/bytescale.md)
    if config.data.get("adaptive_cp") and p > 1:
        from jaxsys.parallel import context
        from jaxsys.sharding import adaptive_groups

        groups = adaptive_groups(config)
        local = float(config.data.get("adaptive_cp_local", 0.0))
        sizes = context.region_sizes(config.data.seq_len, p, bool(m.context_load_balance), local, groups)
        tl = sizes[-1]  # the local regions' tokens never travel
        rings = [(int(g), n) for (g, _), n in zip(groups, sizes[1:-1])] + [(p, tl)]
    n, k = m.n_heads // t, m.n_kv_heads // t
    types = attention.layer_types(m)
    softmax, linear = types.count("softmax"), types.count("linear")
    forward_again = 1 if m.remat != "none" else 0
    rows = []
    if softmax:
        s_kv = b * tl * k * h * bc
        if m.context_parallel == "ring":
            count = size = 0
            for g, n in rings:  # one ring per tier, within groups of g
                s_kv_g, s_grad = b * n * k * h * bc, b * n * k * h * 4  # dK, dV accumulate (and travel) in fp32
                fwd = 2 * (g - 1)
                bwd_bytes = 2 * (g - 1) * s_kv_g + (2 * (g - 1) + 2) * s_grad
                count += softmax * (fwd * (1 + forward_again) + 4 * (g - 1) + 2)
                size += softmax * (fwd * (1 + forward_again) * s_kv_g + bwd_bytes)
            rows.append(Row("ring attention K/V (+dK/dV) permutes", "collective_permute", ("seq",), count, size))
        elif m.context_parallel == "allgather":
            rows.append(
                Row(
                    "all-gather CP: K, V all-gather",
                    "all_gather",
                    ("seq",),
                    2 * softmax * (1 + forward_again),
                    2 * softmax * (1 + forward_again) * (p - 1) * s_kv,
                )
            )
            rows.append(
                Row(
                    "all-gather CP: dK, dV reduce-scatter",
                    "reduce_scatter",
                    ("seq",),
                    2 * softmax,
                    2 * softmax * (p - 1) * s_kv,
                )
            )
        else:
            per_hop = b * tl * n * h * bc + b * tl * n * h * 4 + b * n * tl * 4  # q; o, lse in fp32
            hops = (p - 1) * (2 + forward_again)
            rows.append(
                Row(
                    "TokenRing: queries forward, partial outputs back",
                    "collective_permute",
                    ("seq",),
                    3 * hops * softmax,
                    hops * softmax * per_hop,
                )
            )
    if linear:
        c = 2 if m.context_load_balance else 1
        states = c * b * n * h * h * 4
        rows.append(
            Row(
                "LASP-2 chunk-state all-gather",
                "all_gather",
                ("seq",),
                linear * (1 + forward_again),
                linear * (1 + forward_again) * ring_bytes("all_gather", states, p),
            )
        )
        rows.append(
            Row(
                "LASP-2 chunk-state reduce-scatter (backward)",
                "reduce_scatter",
                ("seq",),
                linear,
                linear * ring_bytes("reduce_scatter", p * states, p),
            )
        )
    return rows


def metric_collectives(config) -> int:
    """Scalar all-reduces of the step: the loss terms over the batch axes (cross-entropy, and with
    MoE layers their balance and z losses), the gradient norm; per MoE layer the dropped copies over
    the token axes (capacity path) and, under Megatron SP, the balance and z-loss sums over `tensor`."""
    mesh = config.mesh
    lm = _moe(config)[0]
    batch = mesh.data * mesh.fsdp * mesh.expert * mesh.seq > 1
    count = (3 if lm else 1) * int(batch) + int(math.prod(mesh[a] for a in mesh) > 1)
    if lm and batch and config.model.moe.capacity_factor > 0:
        count += lm
    if lm and config.parallel.sequence_parallel and mesh.tensor > 1:
        count += 2 * lm
    return count


# ----------------------------------------------------------------------------- memory


def zero_memory(config) -> dict:
    """Per-device bytes of parameters, gradients and optimizer state by the ZeRO formula
    (stage from config.train.zero_stage over `data`; `fsdp` shards all three as stage 3). With
    config.train.optimizer='galore' the optimizer state is GaLore's (`galore_optimizer_bytes`), with
    'muon' Muon's (`muon_optimizer_bytes`)."""
    b_p = _dtype_bytes(config.model.param_dtype)
    psi_l, psi_r, _, _ = params_per_device_after_tp(config)
    psi = (psi_l + psi_r) / config.mesh.fsdp
    n, stage = config.mesh.data, config.train.zero_stage
    k = 2 * b_p  # Adam: mu and nu in the parameter dtype
    optimizer = k * psi / (n if stage >= 1 else 1)
    if config.train.optimizer == "galore":
        optimizer = galore_optimizer_bytes(config)
    if config.train.optimizer == "muon":
        optimizer = muon_optimizer_bytes(config)
    if config.train.optimizer == "zo":  # two forwards: no gradients, no optimizer state
        return {"params": b_p * psi, "grads": 0.0, "optimizer": 0.0}
    return {"params": b_p * psi, "grads": b_p * psi / (n if stage >= 2 else 1), "optimizer": optimizer}


def _galore_plans(config, which: str = "galore"):
    """GaLore's (or Muon's: `which`) LeafPlans (flat) for the layout of `config`, from the train
    step's gradient specs (`zero.grad_spec`, as `program.build` makes them), and the mesh sizes."""
    from jaxsys.optim import galore, muon
    from jaxsys.parallel import zero
    from jaxsys.sharding import Layout

    layout, t = Layout.from_config(config), config.train
    specs = transformer.param_specs(config.model, chunks=t.virtual_stages if config.mesh.pipe > 1 else 1)
    grad_pspecs = jax.tree.map(
        lambda s: zero.grad_spec(layout, s, t.zero_stage), specs, is_leaf=lambda x: isinstance(x, ParamSpec)
    )
    planner = galore.plan if which == "galore" else muon.plan
    plans = planner(t[which], specs, grad_pspecs, layout.mesh_sizes)
    return jax.tree.leaves(plans, is_leaf=lambda x: isinstance(x, galore.LeafPlan)), dict(layout.mesh_sizes)


class _Tally:
    """Collectives counted by (technique, kind, axes): `add` one of `operand_bytes` over `axes`
    (its ring bytes by `ring_bytes`), `rows` the totals."""

    def __init__(self, sizes: dict):
        self.sizes, self.found = sizes, {}

    def add(self, technique: str, kind: str, axes, operand_bytes: float) -> None:
        key = (technique, kind, tuple(axes))
        count, sent = self.found.get(key, (0, 0.0))
        n = math.prod(self.sizes[a] for a in axes)
        self.found[key] = (count + 1, sent + ring_bytes(kind, operand_bytes, n))

    def rows(self) -> list[Row]:
        return [Row(t, k, a, c, sent) for (t, k, a), (c, sent) in self.found.items()]


def _local_shape(pl, sizes) -> list[int]:
    """A leaf's block on one device: each dimension divided by the sizes of its gradient's axes."""
    return [d // math.prod(sizes[a] for a in axes) for d, axes in zip(pl.shape, pl.spec)]


def muon_optimizer_bytes(config) -> float:
    """Muon's optimizer-state bytes per device (docs/muon.md): the momentum of the leaves it
    orthogonalizes and Adam's two moments of the rest, each sharded like the train step's
    gradient (ZeRO's `data` slicing, fsdp, tensor, pipe, expert)."""
    plans, sizes = _galore_plans(config, "muon")
    moments = lambda pl: 1 if pl.side == "full" else 2
    return float(
        _dtype_bytes(config.model.param_dtype) * sum(moments(pl) * math.prod(_local_shape(pl, sizes)) for pl in plans)
    )


def muon_rows(config) -> list[Row]:
    """Muon's collectives per step (docs/muon.md), from each orthogonalized leaf's local momentum
    block (b matrices of m_l x n_l, B bytes) and the G = g_row g_col devices over its row and
    column axes. When b divides by G: an all-to-all of B over the row axes and one over the column
    axes, and the two back (parallel/muon.py); otherwise all-gathers over the row axes and then
    each split column dimension's axes (galore.whole_matrices), B, then g_row B, ... per device."""
    if config.train.optimizer != "muon":
        return []
    plans, sizes = _galore_plans(config, "muon")
    b_p = _dtype_bytes(config.model.param_dtype)
    size = lambda axes: math.prod(sizes[a] for a in axes)
    tally = _Tally(sizes)
    add = tally.add

    for pl in plans:
        if pl.side != "full":
            continue
        local = _local_shape(pl, sizes)
        b = math.prod(local[d] for d in pl.batch_dims)
        held = b * local[pl.row_dim] * math.prod(local[d] for d in pl.col_dims) * b_p
        group = size(pl.row_axes) * size(pl.col_axes)
        if group > 1 and b % group == 0:
            for axes in (pl.row_axes, pl.col_axes):
                if axes:
                    for _ in range(2):  # there and back
                        add("Muon all-to-all of whole matrices (every step)", "all_to_all", axes, held)
            continue
        for axes in [pl.row_axes] + [pl.spec[d] for d in pl.col_dims]:
            if axes:
                add("Muon all-gather of the momentum for Newton-Schulz (every step)", "all_gather", axes, held)
                held *= size(axes)
    return tally.rows()


def galore_optimizer_bytes(config) -> float:
    """GaLore's optimizer-state bytes per device (Zhao et al. 2024; docs/galore.md): per projected
    m x n matrix m r + 2 r n (m <= n) or n r + 2 m r, 2 m n for the weights it leaves to Adam
    (`galore.state_bytes`), each dimension split over the mesh axes the train step's gradient
    specs give it (so ZeRO's `data` slicing, fsdp, tensor and pipe are counted)."""
    from jaxsys.optim import galore

    plans, sizes = _galore_plans(config)
    return float(galore.state_bytes(plans, _dtype_bytes(config.model.param_dtype), sizes))


def galore_rows(config) -> list[Row]:
    """GaLore's collectives per step (docs/galore.md), from each projected leaf's local gradient
    block [b, m_l, n_l] (b the local batch of matrices, m_l / n_l its rows and columns on this
    device). Every step: R, b r n_l (left) or b m_l r (right) elements, is summed over the g devices
    that split the contracted side (rows for left, columns for right): a reduce-scatter along r,
    then an all-gather of Adam's normalised N (1/g of R) for the projection back, when r divides by
    g (the moments are split along r); an all-reduce of R otherwise. Every K-th step (the refresh):
    all-gathers of G, over the row axes and then over each split column dimension's axes, so that
    the device holds b whole m x n matrices for the SVD: b m_l n_l (g_row g_col - 1) elements
    received. The program holds the refresh once (in a lax.cond), so it is counted once here, as
    the analysis counts it."""
    if config.train.optimizer != "galore":
        return []
    plans, sizes = _galore_plans(config)
    b_p = _dtype_bytes(config.model.param_dtype)
    size = lambda axes: math.prod(sizes[a] for a in axes)
    tally = _Tally(sizes)
    add = tally.add

    for pl in plans:
        if not pl.projected:
            continue
        local = _local_shape(pl, sizes)
        b = math.prod(local[d] for d in pl.batch_dims)
        m_l, n_l = local[pl.row_dim], math.prod(local[d] for d in pl.col_dims)
        r_bytes = (b * pl.rank * n_l if pl.side == "left" else b * m_l * pl.rank) * b_p  # R before the sum
        if pl.rank_axes:  # the moments are split along r: reduce-scatter R, all-gather N back
            add("GaLore projection reduce-scatter (every step)", "reduce_scatter", pl.rank_axes, r_bytes)
            add(
                "GaLore normalised update all-gather (every step)",
                "all_gather",
                pl.rank_axes,
                r_bytes / size(pl.rank_axes),
            )
        elif pl.sum_axes:
            add("GaLore projection all-reduce (every step)", "all_reduce", pl.sum_axes, r_bytes)
        held = b * m_l * n_l * b_p
        for axes in [pl.row_axes] + [pl.spec[d] for d in pl.col_dims]:
            if axes:
                add("GaLore refresh all-gather of G for the SVD (1 step in K)", "all_gather", axes, held)
                held *= size(axes)
    return tally.rows()


def offload_memory(config) -> dict:
    """Per-device bytes of the model states in device and in host memory under config.offload
    (`zero_memory` split by where each lives). The optimizer fraction is of the bytes; the leaves
    actually chosen (`offload.choose`) reach at least that share."""
    z, o = zero_memory(config), config.offload
    f = float(o.optimizer_fraction) if o.optimizer else 0.0
    device = {"params": 0.0 if o.params else z["params"], "grads": z["grads"], "optimizer": z["optimizer"] * (1 - f)}
    host = {"params": z["params"] if o.params else 0.0, "grads": 0.0, "optimizer": z["optimizer"] * f}
    return {"device": device, "host": host, "device_total": sum(device.values()), "host_total": sum(host.values())}


def offloaded_activation_bytes(config) -> float:
    """Per-device bytes of the activations config.offload.activations sends to the host, per step:
    each named value of every layer ([B, T, D] layer input, [B, T, N, H] attention output,
    [B, T, F] SwiGLU hidden; heads and F split over tensor, T over seq)."""
    from jaxsys.config import offloaded_activations

    m, mesh = config.model, config.mesh
    tokens = local_batch(config) * config.data.seq_len / mesh.seq
    width = {
        "layer_input": m.d_model,
        "attention_output": m.n_heads * m.head_dim / mesh.tensor,
        "mlp_hidden": m.d_ff / mesh.tensor,
    }
    return sum(tokens * width[n] for n in offloaded_activations(config)) * m.n_layers * _dtype_bytes(m.compute_dtype)


ADAM_BYTES_PER_PARAM = 28  # a host Adam step reads p, g, m, v and writes p, m, v (fp32)


def offload_traffic(config, hw: "Hardware") -> dict:
    """Per-device bytes over the host link per step, and the seconds they and a host update take
    (the roofline of offloading). Optimizer, device update: the offloaded state in and out.
    Optimizer, host update: the gradients of those leaves down, their parameters up, and the update
    at host memory bandwidth (ADAM_BYTES_PER_PARAM per parameter, the host shared by its devices).
    Parameters: in for the forward and again for the backward (weights are never saved), the
    gradients out, and the updated parameters in and out around a device update. Activations: out
    after the forward, in for the backward."""
    z, o = zero_memory(config), config.offload
    b_p = _dtype_bytes(config.model.param_dtype)
    f = float(o.optimizer_fraction) if o.optimizer else 0.0
    host_update = o.optimizer and o.optimizer_update == "host"
    link = {"optimizer": 0.0, "params": 0.0, "activations": 2 * offloaded_activation_bytes(config)}
    host_update_s = 0.0
    if o.optimizer and not host_update:
        link["optimizer"] = 2 * z["optimizer"] * f
    if host_update:
        link["optimizer"] = (z["grads"] + z["params"]) * f
        host_update_s = (
            ADAM_BYTES_PER_PARAM * z["optimizer"] / (2 * b_p) * f / (hw.host_memory_bytes_per_s / hw.host_sharers)
        )
    if o.params and config.train.optimizer == "zo":  # in for each forward, in and out for the update
        link["params"] = 4 * z["params"]
    elif o.params:
        link["params"] = 2 * z["params"] + z["grads"] + (0.0 if host_update and f == 1.0 else 2 * z["params"])
    total = sum(link.values())
    return {
        "link_bytes": link,
        "link_bytes_total": total,
        "link_s": total / hw.host_link_bytes_per_s,
        "host_update_s": host_update_s,
    }


def paper_zero_offload_memory(psi: float, k: int = 12) -> dict:
    """ZeRO-Offload's split (Ren et al. 2021, section 4), mixed precision: the device keeps the fp16
    parameters (2Ψ); the fp16 gradients go to the host bucket by bucket during the backward (2Ψ),
    beside the fp32 optimizer state (KΨ: master weights, momentum, variance). 2Ψ is what puts 13B
    on one 32 GB V100. (Counting the gradients on the device too, 4Ψ, is the bound while a bucket
    is in flight at its largest, not the paper's split.)"""
    return {"device": 2 * psi, "host": (2 + k) * psi}


def paper_zero_memory(psi: float, n: int, stage: int, k: int = 12) -> float:
    """The ZeRO paper's per-device model-state bytes, mixed precision: (2 + 2 + K) Ψ split by stage."""
    return {0: (2 + 2 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n, 3: (2 + 2 + k) * psi / n}[
        stage
    ]


# ----------------------------------------------------------------------------- time


def roofline(config, hw: Hardware, flops_per_device: float, bytes_accessed: float, collective_bytes: dict) -> dict:
    """Step time and MFU by the roofline: compute at peak, memory at HBM bandwidth, and each mesh
    axis's collectives at its link bandwidth; `serial` adds communication, `overlapped` hides it."""
    peak = hw.peak(config.model.compute_dtype)
    bandwidth = axis_bandwidth({a: config.mesh[a] for a in config.mesh}, hw, dict(config.dcn))
    compute_s = flops_per_device / peak
    memory_s = bytes_accessed / hw.hbm_bytes_per_s
    comm_s = sum(b / min(bandwidth[a] for a in axes) for axes, b in collective_bytes.items() if axes)
    serial = max(compute_s, memory_s) + comm_s
    overlapped = max(compute_s, memory_s, comm_s)
    tokens = config.train.batch_size * config.data.seq_len
    devices = math.prod(config.mesh[a] for a in config.mesh)
    model_flops = flops_lib.train_flops_per_token(config.model, config.data.seq_len) * tokens
    mfu = lambda s: model_flops / (s * hw.job_peak(config.model.compute_dtype, devices)) if s > 0 else 0.0
    return {
        "compute_s": compute_s,
        "memory_s": memory_s,
        "comm_s": comm_s,
        "step_s_serial": serial,
        "step_s_overlapped": overlapped,
        "mfu_serial": mfu(serial),
        "mfu_overlapped": mfu(overlapped),
    }


# ----------------------------------------------------------------------------- a whole step, before compiling


def activation_bytes(config) -> float:
    """Per-device bytes of the activations a training step keeps for its backward, at its peak: an
    estimate after Korthikanti et al. 2022 (section 4), restated for this model (SwiGLU MLP of
    width F, GQA, no dropout). Per layer and token, with t = tensor, s = 1/t under sequence
    parallelism (else 1), in the compute dtype:

        kept by every policy   D                                   the layer's input (the scan carry)
        remat=none             4 D s + (2 N H + 2 K H + 3 F) / t   norms' ins/outs, q k v o, gate up act
                               + 8 T N / t bytes                   fp32 scores and probabilities, only
                                                                   for the materialising reference attention
        remat=dots             (N H + 2 K H + 2 F) / t + 2 D       the matmul outputs (+ scores as above)
        remat=full             one layer's `none` set, recomputed in the backward, on top

    Tokens per device are B T / (batch shards x seq), over m micro-batches. With a pipeline
    (jaxsys/parallel/pipeline.py) a stage keeps only the input of each micro-batch in flight (min(p, m)
    under 1F1B, m under GPipe) and recomputes its L / p layers for the backward, one micro-batch at a
    time. The output layer's fp32 logits and their gradient (2 x 4 V / t bytes per token) come on top."""
    m, mesh, t = config.model, config.mesh, config.mesh.tensor
    b_c = _dtype_bytes(m.compute_dtype)
    D, N, K, H, F, V, L = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size, m.n_layers
    T = config.data.seq_len
    s = 1.0 / t if (config.parallel.sequence_parallel and t > 1) else 1.0
    scores = 8.0 * (T / mesh.seq) * N / t if m.attention_impl == "reference" else 0.0
    full_set = b_c * (4 * D * s + (2 * N * H + 2 * K * H + 3 * F) / t) + scores
    per_token_layer = (
        b_c * D * s
        + {
            "none": full_set,
            "dots": b_c * ((N * H + 2 * K * H + 2 * F) / t + 2 * D * s) + scores,
            "full": 0.0,
        }[m.remat]
    )
    tokens = local_batch(config) * T / mesh.seq
    p, micro = mesh.pipe, max(1, config.train.microbatches)
    layers = L / p
    total = per_token_layer * layers * tokens / micro  # one micro-batch's backward
    if p > 1:  # the executor stashes each in-flight micro-batch's stage input and recomputes the stage
        in_flight = micro if config.train.pipeline_schedule == "gpipe" else min(p, micro)
        total += b_c * D * s * tokens / micro * in_flight
    if m.remat == "full":  # the layer being recomputed, one micro-batch
        total += full_set * tokens / micro
    logits = 2 * 4.0 * V / t * tokens / micro
    return total + logits


def predicted_memory(config) -> dict:
    """Per-device bytes of a training step by the formulas: parameters, gradients and optimizer
    state (`zero_memory`, the layers' share over the pipeline stages), FSDP's gathered layer (two layers' weights in the compute dtype, the
    one in use and the next), the activations (`activation_bytes`) and the token batch."""
    state = zero_memory(config)
    psi_l, psi_r, _, _ = params_per_device_after_tp(config)
    p = config.mesh.pipe  # a stage holds L / p layers (zero_memory counts them all)
    state = {k: v * (psi_l / p + psi_r) / (psi_l + psi_r) for k, v in state.items()}
    if config.offload.optimizer:
        state["optimizer"] *= 1.0 - float(config.offload.optimizer_fraction)
    m = config.model
    gathered = 2 * psi_l / m.n_layers * _dtype_bytes(m.compute_dtype) if config.mesh.fsdp > 1 else 0.0
    out = {
        **state,
        "fsdp_gathered": gathered,
        "activations": activation_bytes(config),
        # tokens [B, T+1] int32; a corpus of documents adds segments [B, T+1] and weights [B, T]
        "batch": 4.0 * local_batch(config) * (config.data.seq_len + 1) * (3 if _documents(config) else 1),
    }
    out["total"] = sum(out.values())
    return out


def _documents(config) -> bool:
    from jaxsys.config import DOCUMENT_SOURCES

    return config.data.source in DOCUMENT_SOURCES


RING_HOPS = {  # steps of the ring algorithm a collective over n devices takes, each paying a hop's latency
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "collective_permute": lambda n: 1,
}


def collective_latency(config, hw: Hardware, rows: list[Row]) -> float:
    """The alpha of the alpha-beta model, per device per step: every collective of `rows` (a Row
    holds `count` of them) costs hw.collective_latency_s + hops x the hop latency of its axes
    (inter-node if any of them leaves the node, `axis_bandwidth`), hops by the ring algorithm
    (`RING_HOPS`). A group of one device costs nothing."""
    sizes = {a: config.mesh[a] for a in config.mesh}
    bandwidth = axis_bandwidth(sizes, hw, dict(config.dcn))
    total = 0.0
    for r in rows:
        n = math.prod(sizes[a] for a in r.axes)
        if n <= 1 or r.count <= 0:
            continue
        crosses = any(bandwidth[a] < hw.intra_node_bytes_per_s for a in r.axes)
        hop = hw.inter_hop_latency_s if crosses else hw.hop_latency_s
        total += r.count * (hw.collective_latency_s + RING_HOPS[r.kind](n) * hop)
    return total


KERNELS_PER_LAYER_FORWARD = 14  # 2 norms, q/k/v, 3 attention (scores, softmax, values), o, gate/up, act, down
KERNELS_PER_LEAF_UPDATE = 2  # the optimizer's fused update of a parameter leaf, and its moments


def kernel_count(config) -> float:
    """Kernels one device launches per step (for hw.op_overhead_s): KERNELS_PER_LAYER_FORWARD per
    layer forward, twice that for its backward, once more under remat=full; every micro-batch
    runs its stage's L / p layers; the optimizer updates every leaf. An estimate of the order of
    magnitude: fusion decides the real count."""
    m, mesh = config.model, config.mesh
    micro = max(1, config.train.microbatches)
    passes = 3 + (1 if m.remat == "full" else 0)
    layers = m.n_layers / mesh.pipe * micro
    return KERNELS_PER_LAYER_FORWARD * passes * layers + KERNELS_PER_LEAF_UPDATE * len(_specs(config))


def pipeline_rows(config) -> list[Row]:
    """The sends between pipeline stages (jaxsys/parallel/pipeline.py), per device per step: each
    micro-batch's activations to the next stage in the forward, their gradient back in the
    backward, [B/m, T/seq, D] (/t under sequence parallelism) in the compute dtype, once per
    chunk (v per micro-batch when interleaved)."""
    mesh, m, t = config.mesh, config.model, config.mesh.tensor
    if mesh.pipe <= 1:
        return []
    micro, v = max(1, config.train.microbatches), max(1, config.train.virtual_stages)
    chunks = micro * (v if config.train.pipeline_schedule == "interleaved_1f1b" else 1)
    sp = config.parallel.sequence_parallel and t > 1
    act = local_batch(config) / micro * config.data.seq_len / mesh.seq * m.d_model / (t if sp else 1)
    act *= _dtype_bytes(m.compute_dtype)
    return [
        Row(
            "pipeline stage sends (activations forward, gradients backward)",
            "collective_permute",
            ("pipe",),
            2 * chunks,
            2 * chunks * ring_bytes("collective_permute", act, mesh.pipe),
        )
    ]


def _overlap_options(config) -> dict:
    par = config.parallel
    return {
        "collective_matmul": bool(par.get("collective_matmul", False)),
        "fsdp_prefetch": bool(par.get("fsdp_prefetch", False)),
        "pipeline_overlap": bool(par.get("pipeline_overlap", False)),
    }


def hidden_communication(config, hw: Hardware, rows: list[Row], flops_per_s: float) -> dict:
    """Seconds of link time per step each overlap option of `config` hides behind compute
    (docs/planner.md gives the model); zero for an option that is off, and for all on hardware
    whose collectives run in line (hw.overlaps False: XLA:CPU), and for an option whose collective
    the hardware's compiler does not run asynchronously (`hw.async_collectives`: collective matmul
    and pipeline overlap need collective-permutes, FSDP prefetch all-gathers).

    collective_matmul (docs/comm_overlap.md): each SP all-gather / reduce-scatter beside a
      matmul of local width w becomes t-1 permutes, each beside a chunk's matmul; a step hides
      min(permute, matmul) = min(c, c x r), r = 2 w W / (F b). Per layer q/k/v (w = (N + 2K) H / t),
      gate/up (2 F / t, dense layers), o (N H / t) and down (F / t, dense layers), each forward and
      backward, and the output layer (V / t); the embedding's pair and MoE layers keep plain
      collectives.
    fsdp_prefetch: layer i+1's forward all-gather runs beside layer i's forward: (L/p - 1) x
      min(one layer's gather, one layer's forward compute). The backward re-gathers in line.
    pipeline_overlap: each stage send runs beside the next micro-batch's compute on the stage:
      (sends - 2) x min(one send, one chunk's compute), the first and last exposed."""
    options = _overlap_options(config)
    hidden = {k: 0.0 for k in options}
    if not hw.overlaps:
        return hidden
    m, mesh = config.model, config.mesh
    sizes = {a: mesh[a] for a in mesh}
    bandwidth = axis_bandwidth(sizes, hw, dict(config.dcn))
    b_c = _dtype_bytes(m.compute_dtype)
    devices = math.prod(sizes.values())
    tokens = config.train.batch_size * config.data.seq_len
    t = mesh.tensor
    can = set(hw.async_collectives)
    if options["collective_matmul"] and t > 1 and "collective_permute" in can:
        W = bandwidth["tensor"]
        act = local_batch(config) * config.data.seq_len / mesh.seq * m.d_model * b_c  # [B, T, D] per device
        op_s = ring_bytes("reduce_scatter", act, t) / W  # one SP all-gather or reduce-scatter
        N, K, H, F = m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
        counts = {k: n / mesh.pipe for k, n in transformer.layer_counts(m).items()}  # this stage's layers
        widths = [((N + 2 * K) * H / t, counts["all"]), (N * H / t, counts["all"])]
        widths += [(2 * F / t, counts["dense"]), (F / t, counts["dense"]), (m.vocab_size / t, 1 / mesh.pipe)]
        ratio = lambda w: 2 * w * W / (flops_per_s * b_c)
        cm = sum(2 * n * op_s * min(1.0, ratio(w)) for w, n in widths)
        sp = sum(r.bytes for r in rows if r.technique.startswith("Megatron SP")) / W
        hidden["collective_matmul"] = min(cm, sp)
    if options["fsdp_prefetch"] and mesh.fsdp > 1 and "all_gather" in can:
        psi_l, _, _, _ = params_per_device_after_tp(config)
        layers = m.n_layers / mesh.pipe
        gather_s = ring_bytes("all_gather", psi_l / m.n_layers * b_c / mesh.fsdp, mesh.fsdp) / bandwidth["fsdp"]
        forward_s = flops_lib.forward_flops_per_token(m, config.data.seq_len) * tokens / devices / flops_per_s
        layer_s = forward_s * mesh.pipe / m.n_layers  # one layer of the stage, the whole local batch
        hidden["fsdp_prefetch"] = max(0.0, layers - 1) * min(gather_s, layer_s)
    if options["pipeline_overlap"] and mesh.pipe > 1 and "collective_permute" in can:
        (send,) = pipeline_rows(config)
        one_s = send.bytes / send.count / bandwidth["pipe"]
        chunk_s = flops_lib.step_flops_per_token(config) * tokens / devices / flops_per_s / send.count
        hidden["pipeline_overlap"] = max(0, send.count - 2) * min(one_s, chunk_s)
    return hidden


def predicted_step(config, hw: Hardware) -> dict:
    """Step time and MFU of `config` on `hw` before compiling anything (docs/planner.md):

        step = max(compute, HBM) x bubble + exposed communication + kernels x op overhead
        exposed = link time + latency - hidden

    compute: FLOPs by the formula (a second forward under remat=full) at hw.achieved_flops_per_s
    (else the peak); HBM: weights read three times, gradients and optimizer state read and written
    once, activations written and read once; bubble: (m + p - 1) / m for 1F1B and GPipe, (m v + p -
    1) / (m v) interleaved. Link time: the collectives of `predicted_collectives` and the pipeline
    sends (`pipeline_rows`) at each axis's bandwidth; latency: the alpha-beta model's
    (`collective_latency`); hidden: what the config's overlap options hide
    (`hidden_communication`). With no option on, all communication is exposed."""
    m, mesh = config.model, config.mesh
    devices = math.prod(mesh[a] for a in mesh)
    tokens = config.train.batch_size * config.data.seq_len
    flops = flops_lib.step_flops_per_token(config) * tokens / devices
    if m.remat == "full":
        flops += flops_lib.forward_flops_per_token(m, config.data.seq_len) * tokens / devices
    mem = predicted_memory(config)
    weights = mem["params"] * _dtype_bytes(m.compute_dtype) / _dtype_bytes(m.param_dtype)
    traffic = 3 * weights + 2 * (mem["grads"] + mem["optimizer"]) + 2 * mem["activations"]
    rows, _ = predicted_collectives(config)
    rows = rows + pipeline_rows(config)
    per_axes: dict = {}
    for r in rows:
        per_axes[r.axes] = per_axes.get(r.axes, 0.0) + r.bytes
    roof = roofline(config, hw, flops, traffic, per_axes)
    rate = hw.achieved_flops_per_s or hw.peak(m.compute_dtype)
    compute_s = flops / rate
    p, micro, v = mesh.pipe, max(1, config.train.microbatches), max(1, config.train.virtual_stages)
    bubble = 1.0
    if p > 1:
        chunks = micro * (v if config.train.pipeline_schedule == "interleaved_1f1b" else 1)
        bubble = (chunks + p - 1) / chunks
    compute = max(compute_s, roof["memory_s"]) * bubble
    latency = collective_latency(config, hw, rows)
    hidden = hidden_communication(config, hw, rows, rate)
    if sum(hidden.values()) > compute_s:  # a transfer hides only behind compute that exists
        hidden = {k: h * compute_s / sum(hidden.values()) for k, h in hidden.items()}
    comm = roof["comm_s"] + latency
    exposed = comm - sum(hidden.values())
    overhead = kernel_count(config) * hw.op_overhead_s
    step = compute + exposed + overhead
    model_flops = flops_lib.step_flops_per_token(config) * tokens
    return {
        "step_s": step,
        "compute_s": compute_s * bubble,
        "memory_s": roof["memory_s"],
        "comm_s": comm,  # link time + latency, as if all exposed
        "link_s": roof["comm_s"],
        "latency_s": latency,
        "comm_exposed_s": exposed,
        "comm_hidden_s": hidden,  # per overlap option
        "overhead_s": overhead,
        "overlap": [k for k, on in _overlap_options(config).items() if on],
        "bubble": bubble,
        "mfu": model_flops / (step * hw.job_peak(m.compute_dtype, devices)) if step > 0 else 0.0,
    }
