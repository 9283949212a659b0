"""MLA's latent KV cache (DeepSeek-V2, section 2.1.4 and Table 1): the cache bytes per token of
the latent against the expanded heads and against DeepSeek 67B's GQA cache (the paper's "93.3%
smaller"), what that buys a decode batch on one H100 (the decode roofline), and the served
model's tokens and logits through both caches.

    .venv/bin/python experiments/mla_cache/run.py [--replot]

1. Per token, all layers, elements and bf16 bytes, for DeepSeek-V2 (236B), V2-Lite and V3:
   the paper's MLA formula (C + R) L; jaxsys's latent cache as allocated (C + R padded to a power
   of two, `cache.base.head_dim`); the expanded cache (every head's keys and padded values,
   2 N H_c L) and the MHA it stands for (N (H + H_v) L). DeepSeek 67B's GQA: 2 x 8 x 128 x 95.
   The paper's 93.3% counts its deployed KV quantization (about 6 bits per element); the table
   gives the bf16 ratio and the 6-bit one.
2. The engine's caches measured: a tiny MLA model (C=64, R=16, N=8, H=48) served by the paged
   engine on 1 CPU device with mla.cache = latent and expanded: the allocated pool bytes per slot
   (summed array nbytes / slots) against `cache.base.token_bytes`, the greedy tokens of 4 prompts
   through both, and the largest logit difference of the step's rows.
3. `jaxsys.analysis.decode` for configs/deepseek_v2_lite.py on one H100 with bf16 weights:
   sequences of 4K / 32K tokens that fit beside the weights, and the roofline tokens/s at that
   batch (the paper's 5.76x generation throughput is measured on 8 H800s against 67B: not
   reproducible on a CPU; this is its memory argument on the roofline).
Writes results.json next to this file and prints the README's tables.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # measured on the CPU; the GPU plugin need not load
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments.common import load_results, markdown_table, parse_args, save_results  # noqa: E402

# attention shapes only (the cache does not see the rest): layers, heads, nope + rope head dim, values, C, R
MODELS = {
    "DeepSeek-V2": (60, 128, 192, 128, 512, 64),
    "DeepSeek-V2-Lite": (27, 16, 192, 128, 512, 64),
    "DeepSeek-V3": (61, 128, 192, 128, 512, 64),
}
GQA_67B = 2 * 8 * 128 * 95  # DeepSeek LLM 67B: 95 layers, 8 kv heads of 128
DEPLOYED_BITS = 6  # the paper: "compress each element in its KV cache into 6 bits on average"


def _model(layers, heads, head_dim, v_head_dim, latent, rope, cache):
    from jaxsys.config import base_config

    m = base_config().model
    m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.compute_dtype = layers, heads, heads, head_dim, "bfloat16"
    m.mla.kv_lora_rank, m.mla.rope_head_dim, m.mla.v_head_dim, m.mla.cache = latent, rope, v_head_dim, cache
    return m


def cache_table() -> list[dict]:
    from jaxsys.cache import base as cache_base

    rows = []
    for name, (L, N, H, Hv, C, R) in MODELS.items():
        latent, expanded = (cache_base.token_bytes(_model(L, N, H, Hv, C, R, kind)) for kind in ("latent", "expanded"))
        rows.append(
            {
                "model": name,
                "paper_latent_elements": (C + R) * L,
                "jaxsys_latent_elements": int(latent // 2),
                "jaxsys_expanded_elements": int(expanded // 2),
                "mha_elements": N * (H + Hv) * L,
                "latent_bytes": latent,
                "expanded_bytes": expanded,
            }
        )
    return rows


def served(quick: bool = False) -> dict:
    import jax
    import numpy as np

    from jaxsys.cache import base as cache_base
    from jaxsys.config import load_config
    from jaxsys.mesh import make_mesh
    from jaxsys.serve import engine
    from jaxsys.serve.sampling import Sampling
    from jaxsys.train import build

    prompts = [[1, 2, 3, 4, 5, 6, 7], [40, 41, 42], [9] * 12, [100, 7, 100, 7, 100]]
    out = {}
    for kind in ("latent", "expanded"):
        c = load_config(
            "configs/tiny.py:test",
            [
                "--config.model.n_kv_heads=8",
                "--config.model.head_dim=48",
                "--config.model.mla.kv_lora_rank=64",
                "--config.model.mla.rope_head_dim=16",
                "--config.model.mla.v_head_dim=32",
                f"--config.model.mla.cache={kind}",
                "--config.model.init_std=0.2",
            ],
        )
        program = build(c, make_mesh(c, jax.devices()[:1]))
        params = program.init(0).params
        eng = engine.Engine(program, params, num_pages=32, page_size=8, token_budget=64, chunk_size=32, max_seqs=4)
        pools = eng.cache.per_layer()
        slots = next(iter(pools.values())).shape[1] * 8
        tokens = engine.generate(eng, prompts, 8 if quick else 16, Sampling())
        out[kind] = {
            "pools": {name: list(a.shape) for name, a in pools.items()},
            "allocated_bytes_per_slot": sum(a.nbytes for a in pools.values()) / slots,
            "formula_bytes_per_slot": cache_base.token_bytes(program.config.model),
            "tokens": tokens,
            "logprobs": _logprobs(eng, prompts, tokens),
        }
        del eng
    diff = float(np.max(np.abs(np.asarray(out["latent"]["logprobs"]) - np.asarray(out["expanded"]["logprobs"]))))
    return {
        "caches": out,
        "tokens_equal": out["latent"]["tokens"] == out["expanded"]["tokens"],
        "max_logprob_diff": diff,
    }


def _logprobs(eng, prompts, tokens) -> list[float]:
    """The log-probability of each greedy token, re-scored by the engine's own prompt logprobs."""
    from jaxsys.serve.sampling import Sampling

    out = []
    for i, (prompt, new) in enumerate(zip(prompts, tokens)):
        req = eng.submit(("score", i), list(prompt) + list(new), 1, Sampling(prompt_logprobs=True))
        while not eng.idle:
            eng.step()
        out.extend(req.prompt_logprobs[len(prompt) :])
    return out


def decode_table() -> list[dict]:
    from jaxsys.analysis import hardware
    from jaxsys.analysis.decode import DecodeStep, decode_report
    from jaxsys.config import load_config

    rows = []
    for kind in ("latent", "expanded"):
        c = load_config(
            "configs/deepseek_v2_lite.py",
            ["--config.mesh.fsdp=1", "--config.model.param_dtype=bfloat16", f"--config.model.mla.cache={kind}"],
        )
        hw = hardware.profile("h100")
        r = decode_report(c, hw, contexts=(4096, 32768), batches=(1,))
        step = DecodeStep.for_config(c, hw)
        for S in (4096, 32768):
            b = r["max_batch_per_device"][S]
            rows.append(
                {
                    "cache": kind,
                    "context": S,
                    "kv_bytes_per_token": r["kv_bytes_per_token"],
                    "fits": b,
                    "tokens_per_s": b / step.seconds(b, b * S) if b else 0.0,
                }
            )
    return rows


def report(results: dict) -> None:
    mib = lambda b: f"{b / 1024:.1f} KiB"
    print("## Cache per token, all layers (elements; bf16 bytes)\n")
    rows = []
    for r in results["cache"]:
        rows.append(
            [
                r["model"],
                f"{r['mha_elements']:,}",
                f"{r['jaxsys_expanded_elements']:,} ({mib(r['expanded_bytes'])})",
                f"{r['paper_latent_elements']:,}",
                f"{r['jaxsys_latent_elements']:,} ({mib(r['latent_bytes'])})",
                f"{r['jaxsys_expanded_elements'] / r['jaxsys_latent_elements']:.0f}x",
            ]
            + (  # the paper's comparison is DeepSeek-V2 against DeepSeek 67B
                [
                    f"{1 - r['paper_latent_elements'] / GQA_67B:.1%}",
                    f"{1 - r['paper_latent_elements'] * DEPLOYED_BITS / 16 / GQA_67B:.1%}",
                    f"{1 - r['jaxsys_latent_elements'] / GQA_67B:.1%}",
                ]
                if r["model"] == "DeepSeek-V2"
                else ["", "", ""]
            )
        )
    header = [
        "model",
        "MHA N (H + H_v) L",
        "jaxsys expanded",
        "paper's latent (C + R) L",
        "jaxsys latent",
        "expanded / latent",
        "vs 67B, bf16",
        "vs 67B, 6-bit",
        "vs 67B, jaxsys",
    ]
    print("\n".join(markdown_table(header, "lrrrrrrrr", rows)))
    s = results["served"]
    print("\n## The engine's caches, measured (tiny MLA model, 1 CPU device)\n")
    rows = [
        [
            kind,
            str(c["pools"]),
            f"{c['allocated_bytes_per_slot']:,.0f}",
            f"{c['formula_bytes_per_slot']:,.0f}",
        ]
        for kind, c in s["caches"].items()
    ]
    print("\n".join(markdown_table(["cache", "pools", "bytes / slot allocated", "token_bytes"], "llrr", rows)))
    print(f"\ngreedy tokens equal: {s['tokens_equal']}; largest logprob difference {s['max_logprob_diff']:.2e}")
    print("\n## DeepSeek-V2-Lite on one H100, bf16 weights (decode roofline)\n")
    rows = [
        [r["cache"], r["context"], mib(r["kv_bytes_per_token"]), r["fits"], f"{r['tokens_per_s']:,.0f}"]
        for r in results["decode"]
    ]
    print("\n".join(markdown_table(["cache", "context", "KV / token", "sequences fit", "tokens/s"], "lrrrr", rows)))


def main() -> None:
    args = parse_args(__doc__, None, "fewer decode steps")
    if args.replot:
        report(load_results(HERE))
        return
    results = {"cache": cache_table(), "served": served(args.quick), "decode": decode_table()}
    save_results(HERE, results)
    report(results)


if __name__ == "__main__":
    main()
