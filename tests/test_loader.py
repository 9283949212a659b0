"""The loader: the same global batch for (seed, step) on 1 and 2 processes, each process building
only its rows; resume mid-epoch is bitwise and its state is in the checkpoint; the next batch is
built while the step runs; packed batches train end to end (pending the model's document masks)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxsys import data, train
from jaxsys.checkpoint import Checkpointer
from jaxsys.data import loader, shards
from jaxsys.mesh import make_mesh
from jaxsys.sharding import Layout
from tests.helpers import ROOT, free_port, program_for, small_config, subprocess_env

REPO = Path(ROOT)


def write_corpus(path: Path, n: int = 120, seed: int = 0) -> Path:
    """Documents with long-tailed lengths (a few longer than a row of T + 1 = 33)."""
    rng = np.random.default_rng(seed)
    words = ["def", "return", "x", "=", "(", ")", "for", "in", "range", "print", "\n", "  "]
    with open(path, "w") as f:
        for i in range(n):
            k = int(rng.lognormal(1.8, 0.9)) + 1
            f.write(json.dumps({"text": " ".join(rng.choice(words, k)), "n": i}) + "\n")
    return path


def doc_config(tmp_path, mesh=None, **data_keys):
    c = small_config(mesh or dict(data=2, fsdp=2, tensor=2), n_kv_heads=2)
    c.data.source, c.data.path = "jsonl", str(write_corpus(tmp_path / "docs.jsonl"))
    c.data.cache_dir, c.data.tokenize_workers, c.data.shard_docs = str(tmp_path / "cache"), 1, 50
    c.data.eval_fraction = 0.1
    for k, v in data_keys.items():
        c.data[k] = v
    return c


def _losses(workdir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(workdir / "metrics.jsonl"))}


@pytest.mark.slow
def test_the_global_batch_is_the_same_on_one_and_two_processes(tmp_path):
    """2 processes x 4 devices (data=2 x fsdp=2 x tensor=2: the processes are the two `data` rows)
    hold exactly the shards that 1 process x 8 devices holds, padded and packed, and each process
    assembled only its own rows (process 0 rows 0-3, process 1 rows 4-7)."""
    for packing in (False, True):
        c = doc_config(tmp_path, packing=packing)
        shards.build(c.data, progress=False)  # several processes never build the cache themselves
        keys = {k: c.data[k] for k in ("source", "path", "cache_dir", "shard_docs", "eval_fraction", "packing")}
        keys["seq_len"] = c.data.seq_len
        address = f"127.0.0.1:{free_port()}"
        procs = []
        for i in range(2):
            env = subprocess_env(
                4,
                JAX_COORDINATOR_ADDRESS=address,
                JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID=str(i),
                JAXSYS_TEST_CORPUS=json.dumps(keys),
            )
            out = tmp_path / f"p{i}-{packing}.npz"
            cmd = [sys.executable, str(REPO / "tests" / "loader_batches.py"), str(out)]
            procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True), out))
        for p, _ in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
        got = [dict(np.load(out)) for _, out in procs]

        # the program's batch sharding on one process's 8 devices (a packed program is refused
        # until the model takes segment ids; the batch does not need one)
        layout = Layout.from_config(c)
        sharding = NamedSharding(make_mesh(c, jax.devices()[:8]), layout.compute_spec(("batch", None)))
        corpus = loader.load_corpus(c.data)
        for step in (0, 1, 9):
            batch = data.global_batch(corpus, sharding, c.seed, step, 8, c.data.seq_len)
            for name, array in batch._asdict().items():
                full = np.asarray(array)
                for held in got:
                    for key, value in held.items():
                        if key.startswith(f"{name}/{step}/"):
                            start = int(key.rsplit("/", 1)[1])
                            np.testing.assert_array_equal(value, full[start : start + value.shape[0]], err_msg=key)
                covered = sorted(
                    int(k.rsplit("/", 1)[1]) for held in got for k in held if k.startswith(f"{name}/{step}/")
                )
                assert covered[0] == 0 and covered[-1] == 6, covered  # both halves came back
        for i, held in enumerate(got):
            assert {tuple(r[1:]) for r in held["assembled"]} == {tuple(range(4 * i, 4 * i + 4))}


def test_resume_mid_epoch_is_bitwise_and_the_loader_state_is_in_the_checkpoint(tmp_path, monkeypatch):
    c = doc_config(tmp_path)
    c.train.steps, c.checkpoint.every_steps = 6, 3
    full = train.main(c, str(tmp_path / "full"))
    corpus = loader.load_corpus(c.data)
    assert corpus.splits["train"].num_rows > 6 * c.train.batch_size  # the run stays inside one epoch
    assert all(r["loss_tokens"] > 0 for r in full)

    real = train.data_lib.global_batch

    class Interrupted(Exception):
        pass

    def until_step_4(corpus, sharding, seed, step, *args, **kw):
        if step == 4 and kw.get("split", args[-1] if len(args) > 2 else "train") == "train":
            raise Interrupted
        return real(corpus, sharding, seed, step, *args, **kw)

    monkeypatch.setattr(train.data_lib, "global_batch", until_step_4)
    with pytest.raises(Interrupted):
        train.main(c, str(tmp_path / "resumed"))
    monkeypatch.setattr(train.data_lib, "global_batch", real)
    reader = Checkpointer(str(tmp_path / "resumed"), c.checkpoint, read_only=True)
    saved = reader.data_state(3)
    reader.close()
    assert saved == {"grain": {"next_index": 3}, "seed": c.seed, "batch_size": 8, "seq_len": c.data.seq_len}
    records = train.main(c, str(tmp_path / "resumed"))
    assert [r["step"] for r in records] == [4, 5, 6]
    want, got = _losses(tmp_path / "full"), _losses(tmp_path / "resumed")
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert got[step] == want[step], step  # bitwise on CPU


def test_the_loader_builds_the_next_batch_while_the_step_runs():
    built, wanted = [], threading.Event()

    class Corpus:
        def global_batch(self, sharding, seed, step, batch_size, seq_len, split="train"):
            built.append((step, threading.current_thread() is threading.main_thread()))
            if step == 1:
                wanted.set()
            return step

    lo = loader.Loader(Corpus(), None, seed=0, batch_size=8, seq_len=32, steps=5, prefetch=2)
    assert next(lo) == 0
    assert wanted.wait(10), "batch 1 was not built ahead"
    assert next(lo) == 1 and lo.next_step == 2
    assert not any(main for _, main in built)  # built on the loader's thread
    state = lo.state()
    again = loader.Loader(Corpus(), None, seed=0, batch_size=8, seq_len=32, steps=5, prefetch=2)
    again.restore(state)
    assert list(again) == [2, 3, 4]


def _packed_and_padded_batches(lengths, seq_len=32, rows=8):
    """The same documents (ids 1..) as one packed row and as one document a row, each repeated to
    fill `rows` rows: (packed Batch, padded Batch) as numpy."""
    from jaxsys.data import packing

    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 256, n) for n in lengths]
    p = packing.pieces(np.array(lengths), seq_len)
    fetch = lambda d: (docs[d], None)
    packed = packing.assemble([np.arange(len(p))] * rows, p, fetch, seq_len)
    one_each = [np.array([i]) for i in range(len(p))]
    padded = packing.assemble((one_each * rows)[:rows], p, fetch, seq_len)
    return data.Batch(*packed), data.Batch(*padded)


def test_packed_batches_train_and_give_the_loss_of_the_same_documents_unpacked(tmp_path):
    c = doc_config(tmp_path, packing=True)
    c.train.steps = 3
    records = train.main(c, str(tmp_path / "packed"))
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["loss"] < records[0]["loss"]
    # parity: two documents packed in a row score as they do each alone in a padded row (the
    # rows alternate the two documents, so both batches hold each document 4 times)
    packed, padded = _packed_and_padded_batches([13, 19])
    params = None
    for mesh in (dict(data=1), dict(pipe=2, data=2)):  # on one device, and through a 1F1B pipeline
        layout = doc_config(tmp_path, mesh, packing=True)
        if "pipe" in mesh:
            layout.model.n_layers, layout.train.microbatches = 4, 2
        program = program_for(layout)
        params = program.init().params
        to = lambda b: jax.tree.map(lambda a: jax.device_put(jnp.asarray(a), program.batch_sharding), b)
        loss = program.eval_loss_fn()
        np.testing.assert_allclose(float(loss(params, to(packed))), float(loss(params, to(padded))), rtol=1e-5)
