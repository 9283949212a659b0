"""Context-parallel communication: ring, all-gather and TokenRing attention (softmax layers) against
LASP-2 (linear layers), bytes per device per step vs sequence length, and per ring step the
attention FLOPs of one block against the bytes of one K/V block on an H100 profile.

    .venv/bin/python experiments/ring_vs_lasp2/run.py            # measured at T = 1K, 2K, 4K (+ fp32, ring remat full at 1K)
    .venv/bin/python experiments/ring_vs_lasp2/run.py --quick    # measured at T = 1K only
    .venv/bin/python experiments/ring_vs_lasp2/run.py --replot   # re-check results.json against the current formula; tables, plots

Model: configs/llama_1b.py:cpu shapes (D=256, L=4, N=8 query heads, K=2 key/value heads, H=32,
F=768, V=256, tied), bf16 compute, remat none, global batch B=1 (one sequence of T tokens), P=8
on `seq`. Softmax model: context_parallel in {ring, allgather, tokenring} with zigzag load balance;
linear model: layer_pattern=linear (LASP-2), context_load_balance=false (one chunk state per
device, as in the paper; true doubles LASP-2's bytes).

Measured: the step with the layer scan written out (`report.lower_unrolled`), every collective parsed
by `collectives.parse` with the mesh sizes (collective_permute gets its axes from its pairs), ring
bytes per device by `cost_model.ring_bytes`. Formula: `cost_model.context_parallel_rows` for
T = 1K..32K (and up to 2M for ring and LASP-2); every measured point must equal it, count and bytes
(the ring's backward sends its dK/dV accumulators in fp32, which the formula prices as such).

Per ring step (analytic, llama_1b full shapes N=32, K=8, H=64, bf16, B=1): forward FLOPs of one
step's visible blocks 4 B N H (T/P)^2 / 2 (zigzag: half of the (T/P)^2 pairs are visible each step),
bytes of one K/V block 2 B (T/P) K H b_c, at the H100 profile's bf16 peak and NVLink bandwidth (the
inter-node bandwidth beyond 8 devices, as `cost_model.axis_bandwidth` assigns a `seq` axis).
Writes results.json, ring_vs_lasp2.png and ring_step_overlap.png next to this file.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments import common  # noqa: E402

CONFIG = "configs/llama_1b.py:cpu"
P = 8
BATCH = 1
T_FORMULA = [1024 * 2**i for i in range(6)]  # 1K .. 32K
T_LONG = [1024 * 2**i for i in range(6, 12)]  # 64K .. 2M, formula only
VARIANTS = {  # name -> overrides
    "ring": ["--config.model.context_parallel=ring", "--config.model.context_load_balance=true"],
    "allgather": ["--config.model.context_parallel=allgather", "--config.model.context_load_balance=true"],
    "tokenring": ["--config.model.context_parallel=tokenring", "--config.model.context_load_balance=true"],
    "lasp2": ["--config.model.layer_pattern=linear", "--config.model.context_load_balance=false"],
}
LABELS = {
    "ring": "ring (K/V round the ring)",
    "allgather": "all-gather K/V",
    "tokenring": "TokenRing (Q out, O/LSE back)",
    "lasp2": "LASP-2 (linear layers)",
}
MiB = 2**20


def overrides(variant, T, dtype, p=P, remat="none"):
    return VARIANTS[variant] + [
        f"--config.mesh.seq={p}",
        f"--config.data.seq_len={T}",
        f"--config.train.batch_size={BATCH}",
        f"--config.model.compute_dtype={dtype}",
        f"--config.model.remat={remat}",
    ]


# ----------------------------------------------------------------------------- worker

_PERMUTE_PAIRS = re.compile(r'"stablehlo\.collective_permute".*?source_target_pairs = dense<(\[\[.*?\]\])>')


def worker(n: int, jobs: list[dict]) -> None:
    common.worker_devices(n)
    import jax

    from jaxsys import train
    from jaxsys.analysis import collectives as collectives_lib
    from jaxsys.analysis import cost_model, report
    from jaxsys.config import MESH_AXES, load_config
    from jaxsys.mesh import make_mesh

    for j in jobs:
        t0 = time.time()
        config = load_config(CONFIG, overrides(j["variant"], j["T"], j["dtype"], n, j.get("remat", "none")))
        program = train.build(config, make_mesh(config, jax.devices()[:n]))
        sizes = {a: int(config.mesh[a]) for a in MESH_AXES}
        text = report.lower_unrolled(program).as_text()
        found = collectives_lib.parse(text, sizes)
        # the pairs of each collective_permute, in textual order (parse keeps only the axes)
        pairs = [json.loads(m.group(1)) for m in _PERMUTE_PAIRS.finditer(text)]
        permutes = [c for c in found if c.kind == "collective_permute"]
        assert len(pairs) == len(permutes), (len(pairs), len(permutes))
        ops = []
        k = 0
        for c in found:
            op = dict(
                kind=c.kind,
                axes=list(c.axes),
                shape=list(c.shape),
                dtype=c.dtype,
                operand_bytes=c.operand_bytes,
                bytes=cost_model.ring_bytes(c.kind, c.operand_bytes, math.prod(sizes[a] for a in c.axes)),
            )
            if c.kind == "collective_permute":
                src, dst = pairs[k][0]
                op["shift"] = (dst - src) % n
                k += 1
            ops.append(op)
        formula = [
            dict(technique=r.technique, kind=r.kind, count=r.count, bytes=r.bytes)
            for r in cost_model.context_parallel_rows(config)
        ]
        common.emit(dict(j, P=n, seconds=time.time() - t0, ops=ops, formula=formula))


# ----------------------------------------------------------------------------- formulas


def model_shapes():
    from jaxsys.config import load_config

    m = load_config(CONFIG, []).model
    return dict(N=m.n_heads, K=m.n_kv_heads, H=m.head_dim, L=m.n_layers, D=m.d_model)


def formula_rows(variant, T, dtype, p=P, remat="none"):
    """cost_model.context_parallel_rows for this point, as dicts."""
    from jaxsys.analysis import cost_model
    from jaxsys.config import load_config

    config = load_config(CONFIG, overrides(variant, T, dtype, p, remat))
    return [
        dict(technique=r.technique, kind=r.kind, count=r.count, bytes=r.bytes)
        for r in cost_model.context_parallel_rows(config)
    ]


def library_formula(variant, T, dtype, p=P, remat="none"):
    """cost_model.context_parallel_rows summed: bytes per device per step (attention only)."""
    return sum(r["bytes"] for r in formula_rows(variant, T, dtype, p, remat))


def grad_allreduce_bytes(p=P):
    """The CP gradient all-reduce over `seq` (fp32 parameters): 2 Psi 4 (P-1)/P, any T."""
    from jaxsys.analysis import cost_model
    from jaxsys.config import load_config
    from jaxsys.models import params as params_lib
    from jaxsys.models import transformer

    config = load_config(CONFIG, [])
    psi = params_lib.count(transformer.param_specs(config.model))
    return cost_model.ring_bytes("all_reduce", psi * 4, p), psi


# ----------------------------------------------------------------------------- analysis


def summarise(r):
    seq = [o for o in r["ops"] if o["axes"] == ["seq"] and o["shape"]]
    attention = [o for o in seq if o["kind"] in ("collective_permute", "all_gather", "reduce_scatter")]
    by = collections.defaultdict(lambda: [0, 0.0])
    for o in attention:
        by[f"{o['kind']} {o['dtype']}"][0] += 1
        by[f"{o['kind']} {o['dtype']}"][1] += o["bytes"]
    shifts = collections.defaultdict(float)
    for o in attention:
        if o["kind"] == "collective_permute":
            shifts[o["shift"]] += o["bytes"]
    formula = sum(f["bytes"] for f in r["formula"])
    return dict(
        attention_bytes=sum(o["bytes"] for o in attention),
        attention_ops=len(attention),
        formula_ops=sum(f["count"] for f in r["formula"]),
        formula_bytes=formula,
        by_kind_dtype={k: v for k, v in sorted(by.items())},
        permute_bytes_by_shift={str(k): v for k, v in sorted(shifts.items())},
        gather_shapes=sorted({f"{o['dtype']}{o['shape']}" for o in attention if o["kind"] == "all_gather"}),
        grad_allreduce_bytes=sum(o["bytes"] for o in seq if o["kind"] == "all_reduce"),
    )


def formula_tables():
    s = model_shapes()
    grad, psi = grad_allreduce_bytes()
    rows = []
    for T in T_FORMULA + T_LONG:
        row = dict(T=T)
        for v in VARIANTS:
            if T in T_LONG and v != "lasp2" and v != "ring":
                continue
            row[v] = library_formula(v, T, "bfloat16")
        rows.append(row)
    claim = dict(T=2048 * 1024, P=64)
    for v in VARIANTS:
        claim[v] = library_formula(v, claim["T"], "bfloat16", p=claim["P"])
    return dict(rows=rows, grad_allreduce_bytes=grad, params=psi, shapes=s, claim=claim)


# per ring step, analytic (llama_1b full shapes)
STEP_SHAPES = dict(N=32, K=8, H=64, B=1, b_c=2)


def step_costs(T, p, hw, shapes=STEP_SHAPES):
    """One ring step of one layer, forward and backward: FLOPs of the visible blocks, bytes sent."""
    from jaxsys.analysis import cost_model

    N, K, H, B, bc = (shapes[k] for k in ("N", "K", "H", "B", "b_c"))
    tl = T / p
    pairs = tl * tl / 2  # zigzag: every device sees half of the (T/P)^2 pairs each step
    fwd_flops = 4 * B * N * H * pairs  # QK^T and PV
    bwd_flops = 2.5 * fwd_flops  # recompute S, dV, dP, dQ, dK
    kv = 2 * B * tl * K * H * bc
    ring_fwd, ring_bwd = kv, kv + 2 * B * tl * K * H * 4  # + fp32 dK, dV
    tok_q, tok_o = B * tl * N * H * bc, B * tl * N * (H + 1) * 4  # q; fp32 o and lse
    bw = cost_model.axis_bandwidth({"seq": p}, hw)["seq"]
    peak = hw.peak("bfloat16")
    out = dict(
        T=T,
        P=p,
        tokens_per_device=tl,
        link_bytes_per_s=bw,
        fwd_flops=fwd_flops,
        bwd_flops=bwd_flops,
        ring_fwd_bytes=ring_fwd,
        ring_bwd_bytes=ring_bwd,
        tokenring_q_bytes=tok_q,
        tokenring_o_bytes=tok_o,
    )
    out["compute_fwd_s"], out["compute_bwd_s"] = fwd_flops / peak, bwd_flops / peak
    out["ring_fwd_s"], out["ring_bwd_s"] = ring_fwd / bw, ring_bwd / bw
    out["tokenring_egress_s"] = (tok_q + tok_o) / bw  # one switch port: all of it leaves this device
    out["tokenring_maxlink_s"] = max(tok_q, tok_o) / bw  # dedicated links: q and o on different links
    out["ring_fwd_hidden"] = out["compute_fwd_s"] >= out["ring_fwd_s"]
    out["ring_bwd_hidden"] = out["compute_bwd_s"] >= out["ring_bwd_s"]
    return out


def thresholds(hw, shapes=STEP_SHAPES):
    """Tokens per device T/P above which one step's compute covers its communication."""
    N, K, H, bc = (shapes[k] for k in ("N", "K", "H", "b_c"))
    out = {}
    for where, bw in (("NVLink", hw.intra_node_bytes_per_s), ("inter-node", hw.inter_node_bytes_per_s)):
        r = hw.peak("bfloat16") / bw
        # 2 N H (T/P)^2 / peak >= 2 (T/P) K H bc / bw  ->  T/P >= (K/N) bc peak/bw
        out[where] = dict(
            flop_per_byte=r,
            ring_fwd=(K / N) * bc * r,
            ring_bwd=(K / N) * 2 * (bc + 4) / 5 * r,  # 5 N H (T/P)^2 vs 2 (T/P) K H (bc + 4)
            ring_fwd_mha=bc * r,
            tokenring_egress=(bc + 4 * (H + 1) / H) / 2 * r,  # (N H bc + 4 N (H+1)) / (2 N H)
            tokenring_maxlink=max(bc, 4 * (H + 1) / H) / 2 * r,
        )
    return out


def step_tables(hw_name="h100"):
    from jaxsys.analysis import hardware

    hw = hardware.PROFILES[hw_name]
    rows = [step_costs(T, p, hw) for T in (8192, 32768, 131072, 1048576) for p in (2, 4, 8, 16, 32, 64)]
    return dict(
        hardware=hw.name,
        peak_bf16=hw.peak("bfloat16"),
        nvlink=hw.intra_node_bytes_per_s,
        inter_node=hw.inter_node_bytes_per_s,
        shapes=STEP_SHAPES,
        rows=rows,
        thresholds=thresholds(hw),
    )


# ----------------------------------------------------------------------------- output


def check(measured):
    """Measured vs `cost_model.context_parallel_rows` at every measured point (collective count and
    bytes must both be equal); returns (rows, problems)."""
    rows, problems = [], []
    for r in measured:
        s = r["summary"]
        same_ops = s["attention_ops"] == s["formula_ops"]
        same_bytes = math.isclose(s["attention_bytes"], s["formula_bytes"], rel_tol=1e-12)
        rows.append(
            dict(
                variant=r["variant"],
                T=r["T"],
                dtype=r["dtype"],
                remat=r.get("remat", "none"),
                ops=s["attention_ops"],
                formula_ops=s["formula_ops"],
                measured=s["attention_bytes"],
                formula=s["formula_bytes"],
                exact=same_ops and same_bytes,
                by_kind_dtype=s["by_kind_dtype"],
                by_shift=s["permute_bytes_by_shift"],
                grad=s["grad_allreduce_bytes"],
                gather_shapes=s["gather_shapes"],
                gathers=s["by_kind_dtype"].get("all_gather f32", [0])[0] if r["variant"] == "lasp2" else None,
            )
        )
        if not (same_ops and same_bytes):
            problems.append(
                f"{r['variant']} T={r['T']} {r['dtype']} remat {r.get('remat', 'none')}: measured "
                f"{s['attention_ops']} collectives, {s['attention_bytes']} B; formula "
                f"{s['formula_ops']}, {s['formula_bytes']} B"
            )
    return rows, problems


def fmt_b(x):
    return f"{x / MiB:,.2f}"


def tables(res):
    out = []
    f = res["formula"]
    s = f["shapes"]
    out += [
        f"Attention communication per device per step (MiB sent, bf16, remat none), llama_1b:cpu shapes "
        f"(L={s['L']}, N={s['N']}, K={s['K']}, H={s['H']}), B={BATCH}, P={P}. Formula = "
        "cost_model.context_parallel_rows.",
        "",
    ]
    cell = lambda row, k: fmt_b(row[k]) if k in row else "–"
    out += common.markdown_table(
        ["T", "ring", "all-gather", "TokenRing", "LASP-2", "ring / LASP-2"],
        "rrrrrr",
        [
            [f"{row['T']:,}"]
            + [cell(row, k) for k in ("ring", "allgather", "tokenring", "lasp2")]
            + [f"{row['ring'] / row['lasp2']:.1f}"]
            for row in f["rows"]
        ],
    )
    c = f["claim"]
    out += [
        "",
        f"LASP-2's headline point, T = {c['T']:,} tokens on P = {c['P']} (same shapes, formula): ring "
        f"{fmt_b(c['ring'])}, all-gather {fmt_b(c['allgather'])}, TokenRing {fmt_b(c['tokenring'])}, "
        f"LASP-2 {fmt_b(c['lasp2'])} MiB per device per step (ring / LASP-2 = {c['ring'] / c['lasp2']:,.0f})",
    ]
    out += [
        "",
        f"Plus, for every variant and T, the CP gradient all-reduce over seq: "
        f"{fmt_b(f['grad_allreduce_bytes'])} MiB (Psi = {f['params']:,} fp32 parameters).",
        "",
    ]
    out += ["Measured (lowered, written-out step) vs formula:", ""]
    name = lambda c: c["variant"] + (f" (remat {c['remat']})" if c["remat"] != "none" else "")
    out += common.markdown_table(
        [
            "variant",
            "dtype",
            "T",
            "collectives measured / formula",
            "measured MiB",
            "formula MiB",
            "equal",
            "by kind and dtype (count, MiB)",
        ],
        "llrrrrll",
        [
            [
                name(c),
                c["dtype"],
                f"{c['T']:,}",
                f"{c['ops']} / {c['formula_ops']}",
                f"{c['measured'] / MiB:.4f}",
                f"{c['formula'] / MiB:.4f}",
                "yes" if c["exact"] else "NO",
                "; ".join(f"{k}: {v[0]}, {v[1] / MiB:.3f}" for k, v in c["by_kind_dtype"].items()),
            ]
            for c in res["checks"]
        ],
    )
    out += ["", "LASP-2's all-gathers per step (measured): count and operand shapes [c, B, N, H, H]:", ""]
    for c in res["checks"]:
        if c["variant"] == "lasp2":
            out.append(f"* {c['dtype']}, T = {c['T']:,}: {c['gathers']} all-gathers of {', '.join(c['gather_shapes'])}")
    out += ["", "Permute bytes by destination shift (dst - src mod P), measured, MiB:", ""]
    out += common.markdown_table(
        ["variant", "dtype", "T"] + [f"shift {k}" for k in range(1, P)],
        "llr" + "r" * (P - 1),
        [
            [name(c), c["dtype"], f"{c['T']:,}"] + [f"{c['by_shift'].get(str(k), 0) / MiB:.3f}" for k in range(1, P)]
            for c in res["checks"]
            if c["by_shift"]
        ],
    )
    st = res["steps"]
    th = st["thresholds"]
    out += [
        "",
        f"Per ring step, one layer, llama_1b full shapes (N={STEP_SHAPES['N']}, K={STEP_SHAPES['K']}, "
        f"H={STEP_SHAPES['H']}, bf16, B=1), {st['hardware']}: {st['peak_bf16'] / 1e12:.0f} TFLOP/s, "
        f"NVLink {st['nvlink'] / 1e9:.0f} GB/s (P <= 8), inter-node {st['inter_node'] / 1e9:.0f} GB/s (P > 8)",
        "",
    ]
    us = lambda seconds: f"{seconds * 1e6:,.1f}"
    out += common.markdown_table(
        [
            "T",
            "P",
            "T/P",
            "fwd block GFLOP",
            "K/V block MiB",
            "compute fwd us",
            "ring fwd comm us",
            "fwd hidden",
            "compute bwd us",
            "ring bwd comm us (K,V + fp32 dK,dV)",
            "bwd hidden",
            "TokenRing fwd egress us",
            "max-link us",
        ],
        "rrrrrrrlrrlrr",
        [
            [
                f"{r['T']:,}",
                r["P"],
                f"{r['tokens_per_device']:,.0f}",
                f"{r['fwd_flops'] / 1e9:,.2f}",
                f"{r['ring_fwd_bytes'] / MiB:,.3f}",
                us(r["compute_fwd_s"]),
                us(r["ring_fwd_s"]),
                "yes" if r["ring_fwd_hidden"] else "no",
                us(r["compute_bwd_s"]),
                us(r["ring_bwd_s"]),
                "yes" if r["ring_bwd_hidden"] else "no",
                us(r["tokenring_egress_s"]),
                us(r["tokenring_maxlink_s"]),
            ]
            for r in st["rows"]
        ],
    )
    out += ["", "Tokens per device T/P above which one step's attention compute covers its communication:", ""]
    out += common.markdown_table(
        [
            "link",
            "peak/bw (FLOP/B)",
            "ring fwd (GQA 4:1)",
            "ring bwd (fp32 dK/dV)",
            "ring fwd if MHA",
            "TokenRing egress",
            "TokenRing max link",
        ],
        "lrrrrrr",
        [
            [where]
            + [
                f"{t[k]:,.0f}"
                for k in (
                    "flop_per_byte",
                    "ring_fwd",
                    "ring_bwd",
                    "ring_fwd_mha",
                    "tokenring_egress",
                    "tokenring_maxlink",
                )
            ]
            for where, t in th.items()
        ],
    )
    return "\n".join(out)


def plot(res, here):
    plt = common.pyplot()
    colors = {"ring": "tab:red", "allgather": "tab:blue", "tokenring": "tab:purple", "lasp2": "tab:green"}
    fig, ax = plt.subplots(figsize=(7.5, 5))
    rows = res["formula"]["rows"]
    for v in VARIANTS:
        pts = [(r["T"], r[v]) for r in rows if v in r]
        ax.plot([t for t, _ in pts], [b / MiB for _, b in pts], "-", color=colors[v], label=LABELS[v])
        meas = [
            (c["T"], c["measured"])
            for c in res["checks"]
            if c["variant"] == v and c["dtype"] == "bfloat16" and c["remat"] == "none"
        ]
        ax.plot([t for t, _ in meas], [b / MiB for _, b in meas], "o", mfc="none", ms=9, mew=1.6, color=colors[v])
    ax.axhline(
        res["formula"]["grad_allreduce_bytes"] / MiB,
        color="gray",
        ls="--",
        lw=1,
        label="CP gradient all-reduce (any T)",
    )
    ax.plot([], [], "k-", label="cost_model.context_parallel_rows")
    ax.plot([], [], "ko", mfc="none", label="measured (lowered step)")
    common.style_axes(
        ax,
        "sequence length T (tokens)",
        "attention bytes sent per device per step (MiB)",
        f"context parallelism over P = {P}, llama_1b:cpu shapes, bf16, B = {BATCH}",
        xlog=2,
        ylog=2,
    )
    common.save_figure(fig, os.path.join(here, "ring_vs_lasp2.png"))

    st = res["steps"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, T in zip(axes, (32768, 131072)):
        rs = [r for r in st["rows"] if r["T"] == T]
        Ps = [r["P"] for r in rs]
        ax.plot(
            Ps,
            [r["compute_fwd_s"] * 1e6 for r in rs],
            "o-",
            color="k",
            label="attention compute, fwd (block FLOPs / peak)",
        )
        ax.plot(Ps, [r["compute_bwd_s"] * 1e6 for r in rs], "o--", color="k", label="attention compute, bwd")
        ax.plot(Ps, [r["ring_fwd_s"] * 1e6 for r in rs], "s-", color="tab:red", label="ring K/V block, fwd")
        ax.plot(Ps, [r["ring_bwd_s"] * 1e6 for r in rs], "s--", color="tab:red", label="ring K,V + fp32 dK,dV, bwd")
        ax.plot(
            Ps,
            [r["tokenring_egress_s"] * 1e6 for r in rs],
            "^-",
            color="tab:purple",
            label="TokenRing Q + O/LSE egress",
        )
        ax.plot(
            Ps, [r["tokenring_maxlink_s"] * 1e6 for r in rs], "^:", color="tab:purple", label="TokenRing busiest link"
        )
        ax.axvline(8.5, color="gray", lw=0.8)
        ax.text(8.7, max(r["compute_fwd_s"] for r in rs) * 1e6, "NVLink | IB", fontsize=8, color="gray", va="top")
        common.style_axes(
            ax,
            "devices P on seq",
            "time per ring step per layer (us)",
            f"T = {T // 1024}K, llama_1b shapes, H100 profile",
            xlog=2,
            ylog=10,
            legend=7,
        )
        ax.set_xticks(Ps, [str(p) for p in Ps])
    common.save_figure(fig, os.path.join(here, "ring_step_overlap.png"))


def finish(measured, extra):
    for r in measured:
        r.pop("summary", None)
        # the formula of the library as it is now (so --replot re-checks old measurements against it)
        r["formula"] = formula_rows(r["variant"], r["T"], r["dtype"], r["P"], r.get("remat", "none"))
    summaries = [summarise(r) for r in measured]
    for r, s in zip(measured, summaries):
        r["summary"] = s
    checks, problems = check(measured)
    res = dict(extra, formula=formula_tables(), steps=step_tables(), checks=checks, problems=problems)
    common.save_results(HERE, res)
    plot(res, HERE)
    print(tables(res))
    print(
        "checks:",
        f"all {len(checks)} measured points equal cost_model.context_parallel_rows (count and bytes)"
        if not problems
        else "PROBLEMS\n" + "\n".join(problems),
    )


def main() -> int:
    args = common.parse_args(
        __doc__, worker, quick="measured at T = 1K only", replot="tables and plots from results.json"
    )
    if args.replot:
        old = common.load_results(HERE)
        finish(old["measured_raw"], {k: old[k] for k in ("quick", "seconds", "measured_raw")})
        return 0
    t0 = time.time()
    Ts = [1024] if args.quick else [1024, 2048, 4096]
    jobs = [dict(variant=v, T=T, dtype="bfloat16") for T in Ts for v in VARIANTS]
    jobs += [dict(variant=v, T=1024, dtype="float32") for v in VARIANTS]  # the library formula's dtype
    if not args.quick:
        jobs += [dict(variant="ring", T=1024, dtype="bfloat16", remat="full")]
    measured = common.run_worker(__file__, P, jobs, what="P")
    print(f"{len(jobs)} lowerings in {time.time() - t0:.0f} s", flush=True)
    finish(measured, dict(quick=args.quick, seconds=time.time() - t0, measured_raw=measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
