"""Vocabulary parallelism (Yeung et al. 2024): per-stage parameter bytes and training FLOPs of a
p = 8 stage pipeline with the embedding and output layer on the first/last stage, replicated
(what jaxsys's SPMD program stores without VP), or split over all stages; with checks of the
formulas against the built program's shardings and against XLA's FLOP count.

    .venv/bin/python experiments/vocab_parallel/run.py [--quick] [--replot]

1. Analytic, per stage s = 0..p-1, for configs/llama_1b.py and configs/llama_8b.py (tensor = 1,
   pipe = 8) at V = 32768, 131072, 262144: parameter bytes under (a) Megatron's placement,
   (b) jaxsys without VP, (c) jaxsys with VP; training FLOPs per token without and with VP.
2. Measured, 8 simulated CPU devices: `train.build` on a pipe = 8 mesh for the two llama shapes and a
   small model, with and without `parallel.vocab_parallel`; per-device parameter bytes from
   `abstract_state()` shardings, against (b) and (c). For the small model the pipelined train step
   is also compiled: XLA's argument bytes per device == params + Adam state + batch, its
   temporaries, and its collectives (--quick skips these compiles).
3. Measured, one CPU device: XLA's FLOPs of forward + backward of one stage's layers, of the output
   layer + cross-entropy over V and over V/p columns, and of the embedding, against the formulas.
Writes results.json and vocab_parallel.png next to this file and prints the README tables.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments import common  # noqa: E402

VOCABS = (32768, 131072, 262144)
P_STAGES = 8  # p
BYTES = {"float32": 4, "bfloat16": 2}
# Cross-entropy per token and vocabulary entry, as XLA counts it (part 3 measures it): forward max,
# subtract, sum (3 flops) and exp (1 transcendental); backward exp * dloss (1 flop).
CE_OPS_PER_V = 5
PIPE = [
    "--config.mesh.fsdp=1",
    "--config.mesh.tensor=1",
    "--config.parallel.sequence_parallel=false",
    f"--config.mesh.pipe={P_STAGES}",
    f"--config.train.microbatches={P_STAGES}",
]
SMALL = [
    "--config.model.d_model=256",
    "--config.model.n_layers=8",
    "--config.model.n_heads=4",
    "--config.model.n_kv_heads=4",
    "--config.model.head_dim=64",
    "--config.model.d_ff=1024",
    "--config.data.seq_len=128",
    "--config.train.batch_size=8",
]
MODELS = {  # name: (config, overrides, sequences per FLOP-count piece)
    "llama_1b": ("configs/llama_1b.py", PIPE, 1),
    "llama_8b": ("configs/llama_8b.py", PIPE, 1),
    "small": ("configs/tiny.py", SMALL + PIPE, 8),
}
ANALYTIC_MODELS = ("llama_1b", "llama_8b")
VARIANTS = {
    "megatron": "(a) Megatron: first/last stage",
    "jaxsys": "(b) jaxsys, no VP: replicated",
    "vp": "(c) VP: split over p",
}


def load(model: str, V: int, vp: bool = False, extra: tuple[str, ...] = ()):
    from jaxsys.config import load_config

    path, overrides, _ = MODELS[model]
    return load_config(
        path,
        [*overrides, f"--config.model.vocab_size={V}", f"--config.parallel.vocab_parallel={str(vp).lower()}", *extra],
    )


# ----------------------------------------------------------------------------- formulas


def layer_matmul_params(m) -> int:
    D, N, K, H, F = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    return 2 * D * N * H + 2 * D * K * H + 3 * D * F  # wq, wo; wk, wv; gate, up, down


def layer_params(m) -> int:
    return layer_matmul_params(m) + 2 * m.d_model  # + attn_norm, mlp_norm


def stage_params(m, p: int, variant: str) -> list[int]:
    """Parameters stored by each of the p stages (L/p layers each)."""
    D, V = m.d_model, m.vocab_size
    layers = m.n_layers // p * layer_params(m)
    embed, unembed = V * D, (0 if m.tie_embeddings else D * V)
    if variant == "megatron":
        # The last stage holds the output layer and the final norm. With tied embeddings Megatron
        # keeps a copy of the embedding there (gradients all-reduced between the two).
        out = [layers] * p
        out[0] += embed
        out[-1] += (unembed or embed) + D
        return out
    if variant == "jaxsys":  # SPMD: every stage holds embed, unembed and final_norm
        return [layers + embed + unembed + D] * p
    if variant == "vp":  # the vocabulary dimension split over pipe; final_norm stays replicated
        return [layers + (embed + unembed) // p + D] * p
    raise ValueError(variant)


def layer_flops(m, T: int) -> float:
    """Training FLOPs per token of one layer (analysis/flops.py: 6 x matmul params + 12 T N H)."""
    return 6.0 * layer_matmul_params(m) + 12.0 * T * m.n_heads * m.head_dim


def output_flops(m, V: int | None = None) -> float:
    """Output layer (forward 2DV + backward 4DV) and cross-entropy per token, over V columns."""
    V = m.vocab_size if V is None else V
    return 6.0 * m.d_model * V + CE_OPS_PER_V * V


def stage_flops(m, T: int, p: int, vp: bool) -> list[float]:
    """Training FLOPs per token on each stage; the embedding lookup counts 0."""
    layers = m.n_layers // p * layer_flops(m, T)
    if vp:
        return [layers + output_flops(m) / p] * p
    return [layers] * (p - 1) + [layers + output_flops(m)]


def executed_stage_flops(m, T: int, p: int, vp: bool) -> list[float]:
    """What jaxsys's executor runs: each stage's backward recomputes its forward (8 x matmul params
    + 16 T N H per layer; model.remat ignored). Without VP that recomputation includes the output
    layer (8DV + CE forward twice, backward once: 9V); the VP output pass runs once (6DV + 5V)/p."""
    D, V, N, H = m.d_model, m.vocab_size, m.n_heads, m.head_dim
    layers = m.n_layers // p * (8.0 * layer_matmul_params(m) + 16.0 * T * N * H)
    if vp:
        return [layers + output_flops(m) / p] * p
    return [layers] * (p - 1) + [layers + 8.0 * D * V + 9.0 * V]


def ratio(xs) -> float:
    return max(xs) / min(xs)


@functools.cache
def analytic(model: str, V: int) -> dict:
    from jaxsys.analysis import flops as flops_lib

    c = load(model, V)
    m, T, p = c.model, c.data.seq_len, P_STAGES
    b = BYTES[m.param_dtype]
    nonvp, vp = stage_flops(m, T, p, False), stage_flops(m, T, p, True)
    # Consistency with the library's count: the stages sum to train_flops_per_token (+ the CE terms)
    assert math.isclose(sum(nonvp) - CE_OPS_PER_V * V, flops_lib.train_flops_per_token(m, T), rel_tol=1e-12)
    assert math.isclose(sum(vp), sum(nonvp), rel_tol=1e-12)
    out = dict(
        model=model,
        V=V,
        p=p,
        T=T,
        D=m.d_model,
        L=m.n_layers,
        tied=bool(m.tie_embeddings),
        param_bytes_each=b,
        layer_flops=layer_flops(m, T),
        output_flops=output_flops(m),
        bytes={v: [n * b for n in stage_params(m, p, v)] for v in VARIANTS},
        flops={"no_vp": nonvp, "vp": vp},
        executed_flops={"no_vp": executed_stage_flops(m, T, p, False), "vp": executed_stage_flops(m, T, p, True)},
    )
    out["bytes_ratio"] = {v: ratio(x) for v, x in out["bytes"].items()}
    out["flops_ratio"] = {v: ratio(x) for v, x in out["flops"].items()}
    out["executed_flops_ratio"] = {v: ratio(x) for v, x in out["executed_flops"].items()}
    return out


# ----------------------------------------------------------------------------- workers


def worker(n: int, jobs: list[dict]) -> None:
    common.worker_devices(n)
    for job in jobs:
        common.emit(measure_layout(job) if job["kind"] == "layout" else measure_flops(job))


def measure_layout(job: dict) -> dict:
    """Build the real pipelined program on pipe = 8 devices; bytes each device holds, per leaf."""
    import jax
    import jax.numpy as jnp

    from jaxsys import mesh as mesh_lib
    from jaxsys import train
    from jaxsys.analysis import collectives as collectives_lib

    config = load(job["model"], job["V"], job["vp"])
    program = train.build(config, mesh_lib.make_mesh(config))
    state = program.abstract_state()
    devices = list(program.mesh.devices.flat)

    def per_device(tree) -> list[int]:
        """Bytes of `tree` on each device, from the index each sharding gives it."""
        total = [0] * len(devices)
        for leaf in jax.tree.leaves(tree):
            index = leaf.sharding.devices_indices_map(leaf.shape)
            for i, d in enumerate(devices):
                shape = [len(range(*s.indices(dim))) for s, dim in zip(index[d], leaf.shape)]
                total[i] += math.prod(shape) * leaf.dtype.itemsize
        return total

    leaves = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        spec = leaf.sharding.spec
        leaves.append(
            dict(
                name="/".join(str(k.key) for k in path),
                shape=list(leaf.shape),
                local_shape=list(leaf.sharding.shard_shape(leaf.shape)),
                spec=str(spec),
                on_pipe=any(e == "pipe" or (isinstance(e, tuple) and "pipe" in e) for e in spec),
            )
        )
    out = dict(job, params_bytes=per_device(state.params), opt_bytes=per_device(state.opt_state), leaves=leaves)
    if job.get("compile"):
        t0 = time.time()
        B, T = config.train.batch_size, config.data.seq_len
        batch = jax.ShapeDtypeStruct((B, T + 1), jnp.int32, sharding=program.batch_sharding)
        lowered = program.train_step_fn().lower(state, batch)
        compiled = lowered.compile()
        mem = compiled.memory_analysis()
        out.update(
            compile_seconds=time.time() - t0,
            argument_bytes=mem.argument_size_in_bytes,
            temp_bytes=mem.temp_size_in_bytes,
            batch_bytes=per_device([batch])[0],
            step_bytes=4,
            collectives=[
                dict(kind=c.kind, axes=list(c.axes), shape=list(c.shape), dtype=c.dtype, bytes=c.operand_bytes)
                for c in collectives_lib.parse(lowered.as_text(), program.layout.mesh_sizes)
                if c.shape
            ],
        )  # non-scalar
    return out


def _cost(compiled) -> dict:
    from experiments.flops_mfu.run import hlo_dot_flops

    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list of dicts in older jax
    return dict(
        flops=float(cost["flops"]),
        transcendentals=float(cost.get("transcendentals", 0.0)),
        dot_flops=hlo_dot_flops(compiled.as_text())[0],
    )


def measure_flops(job: dict) -> dict:
    """XLA's count of forward + backward (jax.vjp) of each piece one stage runs, on one device.
    Abstract arguments: nothing is allocated, so the llama shapes compile too."""
    import jax
    import jax.numpy as jnp

    from jaxsys.models import params as params_lib
    from jaxsys.models import transformer
    from jaxsys.sharding import Layout

    # one device, no remat (the formulas count no recomputation), fp32 compute
    config = load(
        job["model"],
        job["V"],
        False,
        (
            "--config.mesh.pipe=1",
            "--config.train.microbatches=1",
            "--config.model.remat=none",
            "--config.model.compute_dtype=float32",
        ),
    )
    m, T, B, p = config.model, config.data.seq_len, job["B"], P_STAGES
    layout = Layout.from_config(config)
    f32, S = jnp.float32, jax.ShapeDtypeStruct
    params = params_lib.abstract_params(transformer.param_specs(m), f32)
    x, g_tokens = S((B, T, m.d_model), f32), S((B, T), f32)
    ids = S((B, T), jnp.int32)
    positions = jnp.arange(T)

    # (i) one stage's L/p layers; the output y is returned so that the forward stays live
    stage = jax.tree.map(lambda a: S((m.n_layers // p,) + a.shape[1:], a.dtype), params["layers"])

    def layers_train(w, x, dy):
        y, pull = jax.vjp(lambda w, x: transformer.layer_stack(w, x, positions, m, layout, unroll=True)[0], w, x)
        return y, pull(dy)

    # (ii) output layer + cross-entropy over `cols` vocabulary columns
    def output_params(cols):
        return {"embed": S((cols, m.d_model), f32)} if m.tie_embeddings else {"unembed": S((m.d_model, cols), f32)}

    def output_train(sh, h, targets, dloss):
        loss, pull = jax.vjp(lambda sh, h: transformer.output_loss(sh, h, targets, m, layout), sh, h)
        return loss, pull(dloss)

    # (iii) embedding lookup of `rows` rows and its gradient (a scatter-add)
    def embed_train(sh, ids, dx):
        x, pull = jax.vjp(lambda sh: transformer.embed(sh, ids, m, layout), sh)
        return x, pull(dx)

    pieces = {"layers": (layers_train, (stage, x, x))}
    for name, cols in (("output_V", m.vocab_size), ("output_V/p", m.vocab_size // p)):
        pieces[name] = (output_train, (output_params(cols), x, ids, g_tokens))
    for name, rows in (("embed_V", m.vocab_size), ("embed_V/p", m.vocab_size // p)):
        pieces[name] = (embed_train, ({"embed": S((rows, m.d_model), f32)}, ids, x))
    out = dict(job, T=T, tokens=B * T, pieces={})
    for name in job["pieces"]:
        fn, args = pieces[name]
        t0 = time.time()
        compiled = jax.jit(fn).lower(*args).compile()
        out["pieces"][name] = dict(_cost(compiled), seconds=time.time() - t0)
    return out


# ----------------------------------------------------------------------------- checks and tables


def check_layouts(layouts: list[dict]) -> list[str]:
    """Measured per-device parameter bytes == the (b) / (c) formula, on every device."""
    problems = []
    for r in layouts:
        a = analytic(r["model"], r["V"])
        want = a["bytes"]["vp" if r["vp"] else "jaxsys"]
        tag = f"{r['model']} V={r['V']} vp={r['vp']}"
        if sorted(set(r["params_bytes"])) != sorted(set(want)):
            problems.append(f"{tag}: measured {sorted(set(r['params_bytes']))} != formula {sorted(set(want))}")
        if "argument_bytes" in r:
            state = r["argument_bytes"] - r["batch_bytes"] - r["step_bytes"]
            if state != r["params_bytes"][0] + r["opt_bytes"][0]:
                problems.append(
                    f"{tag}: XLA argument bytes - batch - step = {state} != params + Adam "
                    f"{r['params_bytes'][0] + r['opt_bytes'][0]}"
                )
    return problems


def flops_rows(flops: list[dict]) -> list[dict]:
    """Each measured piece beside its formula, per token."""
    rows = []
    for r in flops:
        c = load(r["model"], r["V"])
        m, p, n = c.model, P_STAGES, r["tokens"]
        formula = {
            "layers": m.n_layers // p * layer_flops(m, r["T"]),
            "output_V": output_flops(m),
            "output_V/p": output_flops(m, m.vocab_size // p),
            "embed_V": 0.0,
            "embed_V/p": 0.0,
        }
        # the formula's matmul part: all of the layers' count (attention's QK^T and AV are matmuls
        # too), the output layer without the cross-entropy terms
        matmul = dict(
            formula, **{"output_V": 6.0 * m.d_model * m.vocab_size, "output_V/p": 6.0 * m.d_model * m.vocab_size / p}
        )
        for piece, cost in r["pieces"].items():
            cols = m.vocab_size // (p if piece.endswith("/p") else 1)
            row = dict(
                model=r["model"],
                V=r["V"],
                piece=piece,
                tokens=n,
                xla=cost["flops"] / n,
                xla_dots=cost["dot_flops"] / n,
                xla_transcendentals=cost["transcendentals"] / n,
                formula=formula[piece],
                formula_matmul=matmul[piece],
            )
            row["dots_over_matmul"] = row["xla_dots"] / row["formula_matmul"] if row["formula_matmul"] else None
            row["xla_plus_trans_over_formula"] = (
                (row["xla"] + row["xla_transcendentals"]) / row["formula"] if row["formula"] else None
            )
            if piece.startswith("output"):  # XLA's non-matmul ops per vocabulary entry per token
                row["ce_ops_per_v"] = (row["xla"] - row["xla_dots"] + row["xla_transcendentals"]) / cols
            if piece.startswith("embed"):
                row["xla_per_D"] = row["xla"] / m.d_model
            rows.append(row)
    return rows


def check_flops(rows: list[dict]) -> list[str]:
    problems = []
    for r in rows:
        if r["dots_over_matmul"] is not None and abs(r["dots_over_matmul"] - 1) > 1e-9:
            problems.append(
                f"{r['model']} V={r['V']} {r['piece']}: XLA matmul FLOPs / formula's "
                f"matmul part = {r['dots_over_matmul']:.6f}"
            )
    return problems


def _g(x: float) -> str:
    return f"{x / 1e9:.3f}"


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f}"


def _leaf_names(leaves: list[dict], on_pipe: bool) -> str:
    """`layers/*` for the layer leaves (all split over pipe), the other names as they are."""
    names = [l["name"] for l in leaves if l["on_pipe"] == on_pipe]
    layers = [n for n in names if n.startswith("layers/")]
    return ", ".join(
        ([f"layers/* ({len(layers)} leaves)"] if layers else []) + [n for n in names if not n.startswith("layers/")]
    )


def xla_ratios(rows: list[dict]) -> dict:
    """Max/min of per-stage FLOPs without VP from XLA's counts (flops + transcendentals): the last
    stage runs one stage's layers + the output layer over V, the others the layers only."""
    ops = lambda r: r["xla"] + r["xla_transcendentals"]
    layers = {r["model"]: ops(r) for r in rows if r["piece"] == "layers"}
    return {
        f"{r['model']} {r['V']}": (layers[r["model"]] + ops(r)) / layers[r["model"]]
        for r in rows
        if r["piece"] == "output_V"
    }


def tables(summary: dict) -> str:
    an, layouts, frows = summary["analytic"], summary["layouts"], summary["flops_rows"]
    out = [f"### Max/min over the p = {P_STAGES} stages (analytic; FLOPs also from XLA's count of the pieces)", ""]
    rows = []
    for a in an:
        xla = summary["xla_ratio"].get(f"{a['model']} {a['V']}")
        rows.append(
            [
                a["model"],
                a["V"],
                f"{a['output_flops'] / a['layer_flops']:.2f}",
                f"{a['bytes_ratio']['megatron']:.3f}",
                f"{a['bytes_ratio']['jaxsys']:.3f}",
                f"{a['bytes_ratio']['vp']:.3f}",
                f"{a['flops_ratio']['no_vp']:.3f}",
                "—" if xla is None else f"{xla:.3f}",
                f"{a['flops_ratio']['vp']:.3f}",
                _gib(max(a["bytes"]["megatron"])),
                _gib(max(a["bytes"]["jaxsys"])),
                _gib(max(a["bytes"]["vp"])),
            ]
        )
    out += common.markdown_table(
        [
            "model",
            "V",
            "output layer / one layer (FLOPs)",
            "bytes (a) Megatron",
            "bytes (b) jaxsys no VP",
            "bytes (c) VP",
            "FLOPs no VP",
            "FLOPs no VP, XLA pieces",
            "FLOPs VP",
            "max stage GiB (a)",
            "(b)",
            "(c)",
        ],
        "l" + "r" * 11,
        rows,
    )
    out.append("")
    for a in an:
        if a["model"] != "llama_8b" or a["V"] != 262144:
            continue
        out += [f"### Per stage: {a['model']}, V = {a['V']}, T = {a['T']}, fp32 parameters", ""]
        out += common.markdown_table(
            ["stage", "params GiB (a) Megatron", "(b) jaxsys no VP", "(c) VP", "GFLOP/token no VP", "VP"],
            "rrrrrr",
            [
                [
                    s,
                    _gib(a["bytes"]["megatron"][s]),
                    _gib(a["bytes"]["jaxsys"][s]),
                    _gib(a["bytes"]["vp"][s]),
                    _g(a["flops"]["no_vp"][s]),
                    _g(a["flops"]["vp"][s]),
                ]
                for s in range(a["p"])
            ],
        )
        out.append("")
    out += [
        "FLOPs max/min as jaxsys's executor runs them (each stage's forward recomputed in its "
        "backward, the non-VP output layer included): no VP "
        + ", ".join(f"{a['model']} {a['V']}: {a['executed_flops_ratio']['no_vp']:.3f}" for a in an)
        + "; VP 1.000 throughout.",
        "",
    ]
    out += ["### Measured: per-device parameter bytes of the built program (pipe = 8, 8 CPU devices)", ""]
    rows = []
    for r in layouts:
        want = analytic(r["model"], r["V"])["bytes"]["vp" if r["vp"] else "jaxsys"][0]
        got = sorted(set(r["params_bytes"]))
        split, repl = _leaf_names(r["leaves"], True), _leaf_names(r["leaves"], False)
        rows.append(
            [
                r["model"],
                r["V"],
                "yes" if r["vp"] else "no",
                " / ".join(f"{g / 2**20:.3f}" for g in got),
                f"{want / 2**20:.3f}",
                "yes" if got == [want] else "NO",
                f"{r['opt_bytes'][0] / 2**20:.3f}",
                split,
                repl,
            ]
        )
    out += common.markdown_table(
        [
            "model",
            "V",
            "VP",
            "params MiB/device (all 8 devices)",
            "formula",
            "equal",
            "Adam MiB/device",
            "split over pipe",
            "replicated",
        ],
        "lrlrrlrll",
        rows,
    )
    out.append("")
    compiled = [r for r in layouts if "argument_bytes" in r]
    if compiled:
        out += ["### Measured: XLA's buffer assignment of the compiled pipelined train step (small model)", ""]
        rows = []
        for r in compiled:
            want = r["params_bytes"][0] + r["opt_bytes"][0] + r["batch_bytes"] + r["step_bytes"]
            rows.append(
                [
                    r["V"],
                    "yes" if r["vp"] else "no",
                    f"{r['argument_bytes'] / 2**20:.3f}",
                    f"{want / 2**20:.3f}",
                    "yes" if want == r["argument_bytes"] else "NO",
                    f"{r['temp_bytes'] / 2**20:.2f}",
                    f"{r['compile_seconds']:.0f}",
                ]
            )
        out += common.markdown_table(
            [
                "V",
                "VP",
                "argument MiB/device",
                "params + Adam + batch + step",
                "equal",
                "temporaries MiB/device",
                "compile s",
            ],
            "rlrrlrr",
            rows,
        )
        out.append("")
        out += [
            "### Measured: non-scalar collectives of the lowered step (small model, each op once; "
            "jaxsys.analysis.collectives)",
            "",
        ]
        out += common.markdown_table(
            ["V", "VP", "collectives (kind[mesh axes]: operand, MiB)"],
            "rll",
            [
                [
                    r["V"],
                    "yes" if r["vp"] else "no",
                    "; ".join(
                        f"{c['kind']}[{','.join(c['axes'])}]: {c['dtype']}{c['shape']} ({c['bytes'] / 2**20:.3f})"
                        for c in r["collectives"]
                    ),
                ]
                for r in compiled
            ],
        )
        out.append("")
    out += ["### Measured: XLA's FLOPs per token of each piece (forward + backward, one CPU device)", ""]
    fmt = lambda x: "—" if x is None else f"{x:.6f}"
    rows = []
    for r in frows:
        ce = f"{r['ce_ops_per_v']:.3f}" if "ce_ops_per_v" in r else "—"
        if r["piece"].startswith("embed"):
            ce = f"({r['xla_per_D']:.2f} D)"
        rows.append(
            [
                r["model"],
                r["V"],
                r["piece"],
                f"{r['xla']:.4g}",
                f"{r['xla_dots']:.4g}",
                f"{r['xla_transcendentals']:.4g}",
                f"{r['formula']:.4g}",
                fmt(r["dots_over_matmul"]),
                fmt(r["xla_plus_trans_over_formula"]),
                ce,
            ]
        )
    out += common.markdown_table(
        [
            "model",
            "V",
            "piece",
            "XLA flops",
            "XLA matmul flops",
            "XLA transcendentals",
            "formula",
            "matmul / formula's matmul part",
            "(flops + transc.) / formula",
            "CE ops per V",
        ],
        "lrlrrrrrrr",
        rows,
    )
    out.append("")
    return "\n".join(out)


def plot(summary: dict, path: str, model: str = "llama_8b") -> None:
    import numpy as np

    plt = common.pyplot()

    rows = [a for a in summary["analytic"] if a["model"] == model]
    fig, axes = plt.subplots(2, len(rows), figsize=(5.2 * len(rows), 8), squeeze=False, sharey="row")
    stages = np.arange(P_STAGES)
    for col, a in enumerate(rows):
        top, bottom = axes[0][col], axes[1][col]
        w = 0.38
        for k, (key, label, color) in enumerate(
            (("no_vp", "no VP (output on last stage)", "tab:red"), ("vp", "VP (output split over p)", "tab:blue"))
        ):
            top.bar(
                stages + (k - 0.5) * w,
                np.array(a["flops"][key]) / 1e9,
                w,
                color=color,
                label=f"{label}: max/min {a['flops_ratio'][key]:.2f}",
            )
        top.set_title(f"{model}, V = {a['V']:,}: training GFLOP per token")
        w = 0.27
        for k, (key, color) in enumerate((("megatron", "tab:gray"), ("jaxsys", "tab:orange"), ("vp", "tab:blue"))):
            bottom.bar(
                stages + (k - 1) * w,
                np.array(a["bytes"][key]) / 2**30,
                w,
                color=color,
                label=f"{VARIANTS[key]}: max/min {a['bytes_ratio'][key]:.2f}",
            )
        bottom.set_title(f"{model}, V = {a['V']:,}: parameter GiB per stage (fp32)")
        for ax in (top, bottom):
            ax.set_xticks(stages)
            ax.set_xlabel("pipeline stage")
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=8, loc="upper left")
    for row in axes:  # room for the legends above the bars (the rows share their y axis)
        row[0].set_ylim(0, row[0].get_ylim()[1] * 1.3)
    axes[0][0].set_ylabel("GFLOP / token")
    axes[1][0].set_ylabel("GiB")
    common.save_figure(fig, path)


# ----------------------------------------------------------------------------- main


def finish(summary: dict) -> None:
    summary["analytic"] = [analytic(model, V) for model in ANALYTIC_MODELS for V in VOCABS]
    summary["flops_rows"] = flops_rows(summary["flops"])
    summary["xla_ratio"] = xla_ratios(summary["flops_rows"])
    summary["problems"] = check_layouts(summary["layouts"]) + check_flops(summary["flops_rows"])
    common.save_results(HERE, summary)
    plot(summary, os.path.join(HERE, "vocab_parallel.png"))
    print(tables(summary))
    print(
        "checks:",
        "measured bytes == formula on every device; XLA matmul FLOPs == formula"
        if not summary["problems"]
        else "\n".join(summary["problems"]),
    )


def main() -> int:
    args = common.parse_args(
        __doc__,
        worker,
        quick="do not compile the pipelined train steps",
        replot="recompute tables and plot from results.json, no measurement",
    )
    if args.replot:
        old = common.load_results(HERE)
        finish({k: old[k] for k in ("quick", "seconds", "layouts", "flops")})
        return 0

    t_start = time.time()
    layout_jobs = [
        dict(kind="layout", model=model, V=V, vp=vp, compile=model == "small" and not args.quick)
        for model in ("small",) + ANALYTIC_MODELS
        for V in VOCABS
        for vp in (False, True)
    ]
    layouts = common.run_worker(__file__, P_STAGES, layout_jobs, what="devices")
    print(f"layouts: {len(layouts)} programs built in {time.time() - t_start:.0f} s", flush=True)
    t0 = time.time()
    # the layer stack and the embedding do not depend on V: count them at the first V only
    every_v, once = ["output_V", "output_V/p"], ["layers", "embed_V", "embed_V/p"]
    flop_jobs = [
        dict(kind="flops", model=model, V=V, B=MODELS[model][2], pieces=(once if V == VOCABS[0] else []) + every_v)
        for model in ("small",) + ANALYTIC_MODELS
        for V in VOCABS
    ]
    flops = common.run_worker(__file__, 1, flop_jobs, what="devices")
    print(f"flops: {sum(len(j['pieces']) for j in flop_jobs)} pieces compiled in {time.time() - t0:.0f} s", flush=True)
    finish(dict(quick=args.quick, seconds=time.time() - t_start, layouts=layouts, flops=flops))
    print(f"total {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
