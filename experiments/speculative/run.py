"""Speculative decoding: accepted tokens per target forward vs k, greedy and sampled, with a small
trained draft and with the target as its own draft; roofline speed-up.

    python experiments/speculative/run.py --target W --draft W_draft    # ~2 min on 2 CPU cores

The target and the draft are jaxsys workdirs of the same vocabulary (here configs/tiny.py, 0.82M
parameters, and a 4x narrower 2-layer model, 0.12M, both trained 300 steps on the embedded corpus).
8 prompts of 32 held-out bytes each, 48 new tokens, k = 1, 2, 4, 8. tokens per target forward =
generated tokens / target forwards (prefill included). Roofline speed-up on a memory-bound
device, per round: (n + 1) tokens for one target forward + k draft forwards, each costing its
weight bytes: (accepted + 1) / (1 + k x draft_bytes / target_bytes) relative to plain decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    args = parser.parse_args(argv)
    import jax
    import numpy as np
    from jaxsys import data as data_lib
    from jaxsys import generate as gen
    from jaxsys.serve import decode, speculative
    target, tparams, tconfig = gen.load_program(args.target)
    draft, dparams, _ = gen.load_program(args.draft)
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))
    ratio = nbytes(dparams) / nbytes(tparams)
    corpus = data_lib.load_corpus(tconfig.data)
    held = corpus.split("eval")
    prompts = [held[i * 4000:i * 4000 + 32].astype(int).tolist() for i in range(8)]
    rows = []
    for draft_name, (d_prog, d_params, r) in {"small draft": (draft, dparams, ratio),
                                               "self (target)": (target, tparams, 1.0)}.items():
        for temperature in (0.0, 1.0):
            for k in (1, 2, 4, 8):
                t_dec, d_dec = decode.Decoder(target, 1, 96), decode.Decoder(d_prog, 1, 96)
                total = {"tokens": 0, "forwards": 0, "accepted": 0, "drafted": 0}
                for i, prompt in enumerate(prompts):
                    out, stats = speculative.generate(t_dec, tparams, d_dec, d_params, prompt, 48, k=k,
                                                      temperature=temperature, seed=i)
                    total["tokens"] += len(out)
                    total["forwards"] += stats["target_forwards"]
                    total["accepted"] += stats["accepted"]
                    total["drafted"] += stats["drafted"]
                acc = total["accepted"] / total["drafted"]
                per_round = total["accepted"] / max(total["forwards"] - len(prompts), 1)
                row = {"draft": draft_name, "temperature": temperature, "k": k,
                       "tokens_per_target_forward": total["tokens"] / total["forwards"], "acceptance": acc,
                       "roofline_speedup": (per_round + 1) / (1 + k * r), "draft_bytes_ratio": r}
                rows.append(row)
                print(f"{draft_name:>14} T={temperature} k={k}: {row['tokens_per_target_forward']:.2f} tokens/forward, "
                      f"acceptance {acc:.1%}, roofline x{row['roofline_speedup']:.2f}", flush=True)
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
