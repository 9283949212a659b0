"""Packed vs padded batches of a long-tailed length distribution: padding tokens per step and
tokens/s (experiments/packing/README.md).

    python experiments/packing/run.py [--quick]

A JSON-lines corpus of 4,000 documents with lognormal lengths (median ~110 bytes, sigma 1.2: a
long tail well past a row) is tokenized as bytes into shards (`jaxsys.data.shards`), then cut into rows
of T + 1 = 257 tokens one document a row (`packing=False`) and packed (best-fit decreasing,
`packing=True`). For each, over the same 20 steps of B = 16 rows (the Grain index sampler of
`loader.DocumentCorpus`): the padding tokens per step (segment id 0) and the targets with loss
weight 1. Throughput: configs/tiny.py's model (T = 256) trains on each kind of batch on this
machine's CPU; tokens/s counts the weighted targets (the tokens that train) per second of step.
The packed batches go through the padded program (the model's document masks, which
config.data.packing needs, are pending): the step has the same shapes and FLOPs, so its time is a
packed step's less whatever the masks cost; the losses are not comparable until the masks land.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import numpy as np  # noqa: E402

from experiments.common import save_results  # noqa: E402


def corpus_file(path: str, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    words = "the of and to in is that for it as with was on be by this are from at or an".split()
    with open(path, "w") as f:
        for _ in range(n):
            size = int(rng.lognormal(np.log(110), 1.2)) + 2
            text = " ".join(rng.choice(words, size // 3 + 1))[:size]
            f.write(json.dumps({"text": text}) + "\n")


def main() -> None:
    quick = "--quick" in sys.argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from jaxsys import data
    from jaxsys.data import loader
    from jaxsys.mesh import make_mesh
    from jaxsys.program import build
    from tests.helpers import config_file

    work = tempfile.mkdtemp(prefix="packing-")
    path = os.path.join(work, "docs.jsonl")
    corpus_file(path, 1000 if quick else 4000)
    B, steps, timed = 16, 20, 3 if quick else 10
    results = {"batch_size": B, "steps": steps, "device": str(jax.devices()[0].device_kind), "runs": {}}
    for packed in (False, True):
        c = config_file("tiny")
        c.data.source, c.data.path, c.data.cache_dir = "jsonl", path, os.path.join(work, "cache")
        c.data.seq_len, c.data.eval_fraction, c.train.batch_size = 256, 0.0, B
        c.data.packing = packed
        corpus = loader.load_corpus(c.data)
        T = c.data.seq_len
        split = corpus.splits["train"]
        pad, weighted = [], []
        batches = []
        for step in range(steps):
            tokens, segments, weights = corpus.rows(c.seed, step, B, "train", range(B))
            pad.append(int((segments == 0).sum()))
            weighted.append(int(weights.sum()))
            batches.append(data.Batch(tokens, segments, weights))
        # time the step: the padded program (packing's document masks are pending)
        c.data.packing = False
        program = build(c, make_mesh(c, jax.devices()[:1]))
        place = lambda b: jax.tree.map(lambda a: jax.device_put(a, program.batch_sharding), b)
        step_fn = program.train_step_fn()
        state = program.init()
        state, m = step_fn(state, place(batches[0]))  # compile
        jax.block_until_ready(m)
        start = time.perf_counter()
        for i in range(timed):
            state, m = step_fn(state, place(batches[1 + i % (steps - 1)]))
        jax.block_until_ready(m)
        seconds = (time.perf_counter() - start) / timed
        mean_weighted = float(np.mean([weighted[1 + i % (steps - 1)] for i in range(timed)]))
        name = "packed" if packed else "padded"
        results["runs"][name] = {
            "rows": split.num_rows,
            "pieces": len(split.pieces),
            "padding_tokens_per_step": float(np.mean(pad)),
            "padding_fraction": float(np.mean(pad)) / (B * (T + 1)),
            "weighted_targets_per_step": float(np.mean(weighted)),
            "step_seconds": seconds,
            "trained_tokens_per_s": mean_weighted / seconds,
            "positions_per_s": B * T / seconds,
        }
        print(name, json.dumps(results["runs"][name]), flush=True)
    lengths = corpus.store.doc_len
    results["documents"] = {
        "count": int(lengths.shape[0]),
        "median": float(np.median(lengths)),
        "p90": float(np.percentile(lengths, 90)),
        "p99": float(np.percentile(lengths, 99)),
        "max": int(lengths.max()),
        "longer_than_row": float((lengths > 257).mean()),
    }
    r = results["runs"]
    results["padding_ratio"] = r["packed"]["padding_tokens_per_step"] / r["padded"]["padding_tokens_per_step"]
    results["speedup_trained_tokens_per_s"] = r["packed"]["trained_tokens_per_s"] / r["padded"]["trained_tokens_per_s"]
    print(save_results(HERE, results))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
