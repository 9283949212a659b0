"""One process of tests/test_loader.py's multi-process check: the global batches of a corpus of
documents for a few steps, as this process holds them.

    JAXSYS_TEST_CORPUS=<json of config.data keys> python tests/loader_batches.py OUT.npz

Joins `jax.distributed` from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, builds
the data=2 x fsdp=2 x tensor=2 mesh, and saves every addressable shard of the tokens, segments and
weights of steps STEPS (keyed by array, step and the shard's first row), plus the rows this process
assembled (it must build only its own rows of the global batch).
"""

import json
import os
import sys

import jax
import numpy as np

STEPS = (0, 1, 9)


def main(out: str) -> None:
    from jaxsys import data
    from jaxsys.config import base_config
    from jaxsys.data import loader
    from jaxsys.mesh import make_mesh, maybe_initialize_distributed
    from jaxsys.sharding import Layout

    c = base_config()
    for k, v in json.loads(os.environ["JAXSYS_TEST_CORPUS"]).items():
        c.data[k] = v
    c.model.d_model, c.model.n_layers, c.model.n_heads, c.model.n_kv_heads = 32, 1, 2, 2
    c.model.head_dim, c.model.d_ff, c.model.vocab_size = 16, 32, 256
    c.train.batch_size = 8
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
    maybe_initialize_distributed(c.distributed)
    corpus = loader.load_corpus(c.data)
    assembled = []
    real_rows = loader.DocumentCorpus.rows

    def rows(self, seed, step, batch_size, split, rows):
        assembled.append([step, *rows])
        return real_rows(self, seed, step, batch_size, split, rows)

    loader.DocumentCorpus.rows = rows
    # the program's batch sharding (Program.batch_sharding), without building a program
    sharding = jax.sharding.NamedSharding(make_mesh(c), Layout.from_config(c).compute_spec(("batch", None)))
    saved = {}
    for step in STEPS:
        batch = data.global_batch(corpus, sharding, c.seed, step, c.train.batch_size, c.data.seq_len)
        for name, array in batch._asdict().items():
            for shard in array.addressable_shards:
                saved[f"{name}/{step}/{shard.index[0].start or 0}"] = np.asarray(shard.data)
    saved["assembled"] = np.asarray(assembled)
    np.savez(out, **saved)


if __name__ == "__main__":
    main(sys.argv[1])
