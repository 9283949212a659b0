"""KIVI (Liu et al. 2024): keys quantized per channel, values per token, a full-precision residual
window; attention error, held-out perplexity, KV bytes per token and the batch that fits.

    python -m jaxsys.train --config configs/tiny.py --workdir /tmp/tiny        # ~3 min, 300 steps
    python experiments/kivi/run.py --workdir /tmp/tiny                          # ~3 min on 2 idle cores

Model: configs/tiny.py trained 300 steps (0.82M parameters, 4 layers, 8 query heads, 2 kv heads
of H = 16) on the embedded corpus (python stdlib sources, bytes). Evaluation: 16 held-out
sequences of 128 tokens (2,032 predicted tokens), the same for every row.

Quantization is *fake* quantization inside the model's attention during the evaluation forward
(the forward over a contiguous KV cache seen through jaxsys.cache.kivi.FakeQuant): keys and values are
quantized and dequantized exactly as the engine's quantized cache stores them (asymmetric,
min/max per group; per channel = statistics over a group of G = 16 tokens, one per channel and
kv head; per token = over the head dim), and the query at position p sees a token quantized iff
its group is full and not among the last R / G full groups (R = the residual window in tokens;
the engine's semantics with page_size = G and kv_residual = R / G pages). tests/test_kv_quant.py
checks that the engine's logits equal this forward. Every position is scored, so the first G + R
positions (nothing quantized yet) dilute the perplexity change; with T = 128 a window of 64
tokens keeps half of the context in full precision.

(a) attention-output relative error ||o_q - o|| / ||o|| per layer (averaged over the 4 layers and
all positions), with the keys, values and queries of the full-precision forward (captured per
layer), so each row's error is that of its quantization alone. (b) perplexity with the
quantized attention in every layer (errors compound). (c) KV bytes per token (keys and values,
all layers) at configs/llama_8b.py's shape (32 layers, 8 kv heads of 128, bf16 cache, bf16
scales and zeros amortised over their page) per config.serve.kv_quant. (d) the batch of 8K-token
sequences whose KV cache fits a 64 GiB pool at that shape (one device, tensor = 1), counting each
running sequence's full-precision pages (the open page and the residual window). (e) the
engine itself with config.serve.kv_quant on the trained model: 8 held-out 64-byte prompts, 32
greedy tokens each, compared position by position with the full-precision cache's tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))

GROUP = 16
RESIDUALS = (0, 16, 32, 64)  # tokens
COMBOS = {
    "K/channel V/token (KIVI)": ("channel", "token"),
    "K/token V/token": ("token", "token"),
    "K/channel V/channel": ("channel", "channel"),
    "K/token V/channel": ("token", "channel"),
}
LLAMA_8B = dict(layers=32, kv_heads=8, head_dim=128)
POOL_GIB, CONTEXT = 64, 8192


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True, help="a trained configs/tiny.py run")
    parser.add_argument("--sequences", type=int, default=16)
    args = parser.parse_args(argv)
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxsys import data as data_lib
    from jaxsys.cache import ContiguousCache, FakeQuant, kivi
    from jaxsys.checkpoint import load
    from jaxsys.kernels.paged_attention import quant
    from jaxsys.models import transformer
    from jaxsys.serve.runner import check_servable

    t0 = time.time()
    program, params, config = load(args.workdir, check=check_servable)
    m = config.model
    held = data_lib.load_corpus(config.data).split("eval")
    T = config.data.seq_len
    stride = len(held) // args.sequences
    seqs = np.stack([held[i * stride : i * stride + T + 1] for i in range(args.sequences)]).astype(np.int32)
    inputs, targets = seqs[:, :-1], seqs[:, 1:]

    def attention(k_spec, v_spec, residual):
        """Causal attention over a whole sequence with its keys and values fake-quantized."""
        fake = FakeQuant(residual, k_spec, v_spec, GROUP)
        return lambda q, k, v: kivi.fake_quant_attention(
            q, k, v, jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2]), fake
        )

    def forward(p, x, fake, cache_type=ContiguousCache):
        """The model over x[B, T] with a contiguous cache of T slots (seen through `fake`)."""
        zeros = jnp.zeros((m.n_layers, *x.shape, m.n_kv_heads, m.head_dim), jnp.dtype(m.compute_dtype))
        positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
        cache = cache_type(zeros, zeros, None, fake)
        return transformer.forward(p, x, positions, m, program.layout, program.specs, cache)[0]

    # (a) the full-precision forward's q, k, v of every layer
    captured = []
    record = lambda q, k, v: captured.append((np.asarray(q), np.asarray(k), np.asarray(v)))

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Capture(ContiguousCache):
        """A contiguous cache that records every layer's q, k, v (after RoPE)."""

        def attend(self, q, k, v, positions, window=None, softcap=None):
            jax.debug.callback(record, q, k, v, ordered=True)
            return super().attend(q, k, v, positions, window, softcap)

    jax.block_until_ready(jax.jit(lambda p, x: forward(p, x, None, Capture))(params, inputs))
    assert len(captured) == m.n_layers, len(captured)

    # KIVI's reason for per-channel keys: a few key channels are large for every token. Per layer
    # and kv head, the largest channel's mean |x| over the tokens relative to the median channel's.
    def outliers(x):
        mag = np.abs(x).mean(axis=(0, 1))  # [K, H]
        return float(np.mean(mag.max(-1) / np.median(mag, -1)))

    channel_ratio = {
        "K": float(np.mean([outliers(k) for _, k, _ in captured])),
        "V": float(np.mean([outliers(v) for _, _, v in captured])),
    }
    print(f"largest / median channel mean |x|: keys {channel_ratio['K']:.2f}, values {channel_ratio['V']:.2f}")

    err_fns = {}

    def attn_error(k_spec, v_spec, residual_tokens):
        key = (k_spec, v_spec)
        if key not in err_fns:

            def err(q, k, v, residual):
                o = attention(None, None, 0)(q, k, v)
                return jnp.linalg.norm(attention(k_spec, v_spec, residual)(q, k, v) - o) / jnp.linalg.norm(o)

            err_fns[key] = jax.jit(err)
        return float(
            np.mean([float(err_fns[key](q, k, v, jnp.int32(residual_tokens // GROUP))) for q, k, v in captured])
        )

    # (b) perplexity, one compile per (key spec, value spec); the residual is traced
    ppl_fns = {}

    def perplexity(k_spec, v_spec, residual_tokens):
        key = (k_spec, v_spec)
        if key not in ppl_fns:

            def loss(p, x, y, residual):
                logits = forward(p, x, FakeQuant(residual, k_spec, v_spec, GROUP)).astype(jnp.float32)
                logp = jax.nn.log_softmax(logits, axis=-1)
                return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))

            ppl_fns[key] = jax.jit(loss)
        return math.exp(float(ppl_fns[key](params, inputs, targets, jnp.int32(residual_tokens // GROUP))))

    rows = []

    def row(table, name, bits, k_spec, v_spec, residual):
        r = {
            "table": table,
            "config": name,
            "bits": bits,
            "residual": residual,
            "attn_rel_err": attn_error(k_spec, v_spec, residual),
            "ppl": perplexity(k_spec, v_spec, residual),
        }
        rows.append(r)
        print(
            f"{table:>9} {name:>26} {bits}b R={residual:>2}: attention error {r['attn_rel_err']:.4f}, "
            f"ppl {r['ppl']:.4f}  ({time.time() - t0:.0f}s)",
            flush=True,
        )

    fp = perplexity(None, None, 0)
    print(f"full precision: ppl {fp:.4f}", flush=True)
    for bits in (4, 2):  # one tensor quantized at a time: which axis suits keys, which values
        for tensor in ("K", "V"):
            for axis in ("channel", "token"):
                spec = (bits, axis)
                row(
                    "axes",
                    f"{tensor} only, per {axis}",
                    bits,
                    spec if tensor == "K" else None,
                    spec if tensor == "V" else None,
                    0,
                )
    for bits in (4, 2):
        for name, (ka, va) in COMBOS.items():
            for residual in RESIDUALS:
                row("combined", name, bits, (bits, ka), (bits, va), residual)
    for mode in quant.MODES:  # the engine's formats
        bits, ka, va = quant.MODES[mode]
        for residual in (0, GROUP):
            row("engine", mode, bits, (bits, ka), (bits, va), residual)

    # (e) the engine itself (config.serve.kv_quant) on the trained model: greedy continuations of
    # held-out prompts, compared with the full-precision cache's
    from jaxsys.serve import engine as engine_lib

    prompts = [held[(2 * i + 1) * stride // 2 : (2 * i + 1) * stride // 2 + 64].astype(int).tolist() for i in range(8)]
    generated, agreement = {}, []
    for mode in ("none", *quant.MODES):
        for residual in (0,) if mode == "none" else (0, 1):
            eng = engine_lib.Engine(
                program,
                params,
                num_pages=64,
                page_size=GROUP,
                token_budget=64,
                chunk_size=32,
                max_seqs=8,
                kv_quant=mode,
                kv_residual=residual,
            )
            for i, prompt in enumerate(prompts):
                eng.submit(i, prompt, 32)
            out = {r.id: r.generated for r in eng.run()}
            generated[(mode, residual)] = out
            ref = generated[("none", 0)]
            same = [sum(a == b for a, b in zip(out[i], ref[i])) / len(ref[i]) for i in out]
            first = [next((j for j, (a, b) in enumerate(zip(out[i], ref[i])) if a != b), len(ref[i])) for i in out]
            agreement.append(
                {
                    "mode": mode,
                    "residual_pages": residual,
                    "same_position": float(np.mean(same)),
                    "tokens_before_divergence": float(np.mean(first)),
                }
            )
            print(
                f"engine {mode:>5} kv_residual {residual}: {np.mean(same):.1%} of greedy tokens as the full-precision "
                f"cache's, {np.mean(first):.1f} of 32 before the first divergence ({time.time() - t0:.0f}s)",
                flush=True,
            )

    # (c), (d) bytes per token and the batch that fits
    budget = POOL_GIB * 2**30
    fp_token = quant.bytes_per_token("none", 16, **LLAMA_8B)
    sizes = []
    for mode in ("none", *quant.MODES):
        for page_size in (16, 32, 64):
            per_token = quant.bytes_per_token(mode, page_size, **LLAMA_8B)
            for residual_pages in (0,) if mode == "none" else (0, 2):
                # a running sequence's full-precision pages besides its quantized ones: the open page
                # and the residual window (the engine holds residual + 1 of them between steps)
                fp_window = 0 if mode == "none" else (residual_pages + 1) * page_size * fp_token
                per_seq = CONTEXT * per_token + fp_window
                sizes.append(
                    {
                        "mode": mode,
                        "page_size": page_size,
                        "residual_pages": residual_pages,
                        "bytes_per_token": per_token,
                        "vs_bf16": per_token / fp_token,
                        "batch_at_8k_in_64GiB": int(budget // per_seq),
                    }
                )
    for s in sizes:
        print(
            f"{s['mode']:>6} page {s['page_size']:>2} residual {s['residual_pages']}: {s['bytes_per_token']:.0f} B/token "
            f"({s['vs_bf16']:.3f}x), batch {s['batch_at_8k_in_64GiB']}",
            flush=True,
        )

    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(
            {
                "fp_ppl": fp,
                "channel_ratio": channel_ratio,
                "engine_greedy": agreement,
                "rows": rows,
                "sizes": sizes,
                "seconds": time.time() - t0,
            },
            f,
            indent=1,
        )
    plot(fp, rows, sizes)
    print(f"done in {time.time() - t0:.0f}s")
    return 0


def plot(fp: float, rows: list, sizes: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = dict(zip(COMBOS, ("C0", "C1", "C2", "C3")))
    for metric, ax, label in (
        ("ppl", axes[0], "held-out perplexity"),
        ("attn_rel_err", axes[1], "attention output relative error"),
    ):
        for name in COMBOS:
            for bits, style in ((2, "-"), (4, "--")):
                pts = [r for r in rows if r["table"] == "combined" and r["config"] == name and r["bits"] == bits]
                ax.plot(
                    [r["residual"] for r in pts],
                    [r[metric] for r in pts],
                    style,
                    marker="o",
                    color=colors[name],
                    label=f"{name}, {bits} bits",
                )
        if metric == "ppl":
            ax.axhline(fp, color="k", lw=0.8, label="full precision")
        ax.set_xlabel("residual window R (tokens; group G = 16)")
        ax.set_ylabel(label)
        ax.set_yscale("linear" if metric == "ppl" else "log")
        ax.set_xticks(RESIDUALS)
    axes[0].legend(fontsize=7)
    pick = [s for s in sizes if s["page_size"] == 16 and s["residual_pages"] == 0]
    bars = axes[2].bar([s["mode"] for s in pick], [s["batch_at_8k_in_64GiB"] for s in pick], color="C0")
    for b, s in zip(bars, pick):
        axes[2].text(
            b.get_x() + b.get_width() / 2,
            b.get_height(),
            f"{s['batch_at_8k_in_64GiB']}\n{s['bytes_per_token'] / 1024:.0f} KiB/tok",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    axes[2].set_ylabel("8K-token sequences in a 64 GiB KV pool")
    axes[2].set_title("llama_8b shape, page 16, bf16 scales")
    axes[2].set_ylim(0, max(s["batch_at_8k_in_64GiB"] for s in pick) * 1.25)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "kivi.png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
