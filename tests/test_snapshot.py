"""In-memory snapshots (jaxsys/checkpoint/snapshot.py) in one process with 8 devices: a sharded
TrainState round-trips bitwise, a lost process's area is replaced by its peer's replica, an
incomplete snapshot is never the newest, and the saved pieces restore onto a smaller mesh.
The multi-process kill / restart is tests/test_fault_tolerance.py."""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import pytest

from jaxsys.checkpoint import snapshot
from jaxsys.config import ConfigError, validate
from tests.helpers import program_for, small_config

MESH = dict(data=2, fsdp=2, tensor=2)


@pytest.fixture(scope="module")
def trained():
    """A 2x2x2 program and its state after one step (Adam moments non-zero, params sharded over
    fsdp and tensor, replicated over data: replica_id matters)."""
    config = small_config(MESH, n_kv_heads=2)
    program = program_for(config)
    state = program.init()
    from jaxsys import data

    corpus = data.load_corpus(config.data)
    batch = data.global_batch(corpus, program.batch_sharding, 0, 0, config.train.batch_size, config.data.seq_len)
    state, _ = program.train_step_fn()(state, batch)
    return config, program, jax.block_until_ready(state)


def _assert_bitwise(got, want):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, path
        assert g.tobytes() == w.tobytes(), f"{jax.tree_util.keystr(path)} differs"


def _snap_cfg(config, directory, every=2):
    c = config.train.snapshot
    c.every, c.dir = every, str(directory)
    return c


def test_roundtrip_is_bitwise_and_keeps_the_last_complete(trained, tmp_path):
    config, program, state = trained
    snap = snapshot.Snapshotter(_snap_cfg(config, tmp_path), str(tmp_path / "w"))
    for step in (2, 4, 6):
        snap.save(step, state, {"grain": {"next_index": step}})
    # keep = 2: steps 4 and 6 stay, in the area and as markers
    assert snapshot.complete_steps(str(tmp_path)) == [6, 4]
    assert sorted(os.listdir(tmp_path / "p0")) == ["4", "6"]
    # each element saved once: the bytes of the unique pieces are the state's global bytes
    n_bytes = sum(a.nbytes for a in jax.tree.leaves(state))
    assert n_bytes < snap.nbytes < n_bytes + 64 * 1024  # plus the header
    restored, meta, files = snapshot.restore(str(tmp_path), 6, program.abstract_state())
    assert meta["step"] == 6 and meta["data"] == {"grain": {"next_index": 6}} and files == ["p0/6/own.bin"]
    _assert_bitwise(restored, state)
    assert jax.tree.map(lambda a: a.sharding, restored) == jax.tree.map(lambda a: a.sharding, state)
    assert snapshot.fingerprint(restored) == snapshot.fingerprint(state)
    # a snapshot interrupted mid-write (no marker, a .tmp directory) is never the newest
    shutil.copytree(tmp_path / "p0" / "6", tmp_path / "p0" / "8")
    os.makedirs(tmp_path / "p0" / "10.tmp")
    assert snapshot.complete_steps(str(tmp_path))[0] == 6


def test_a_lost_area_is_recovered_from_the_peer_replica(trained, tmp_path):
    """Two areas as two processes leave them (each: its own pieces + its ring predecessor's);
    with p1's area deleted, p0's replica of p1 completes the state; with that gone too, the error
    names what is missing."""
    config, program, state = trained
    parts = snapshot.pieces(state)
    halves = parts[0::2], parts[1::2]
    meta = {"step": 3, "process": 0, "processes": 2, "data": None}
    for p in (0, 1):
        area = tmp_path / f"p{p}" / "3"
        area.mkdir(parents=True)
        snapshot.pack(halves[p], meta).tofile(area / "own.bin")
        snapshot.pack(halves[1 - p], meta).tofile(area / f"replica_of_p{1 - p}.bin")
    (tmp_path / "complete_3").write_text("{}")
    shutil.rmtree(tmp_path / "p1")
    restored, _, files = snapshot.restore(str(tmp_path), 3, program.abstract_state())
    assert files == ["p0/3/own.bin", "p0/3/replica_of_p1.bin"]
    _assert_bitwise(restored, state)
    os.remove(tmp_path / "p0" / "3" / "replica_of_p1.bin")
    with pytest.raises(snapshot.SnapshotError, match="are in no visible area"):
        snapshot.restore(str(tmp_path), 3, program.abstract_state())


def test_restore_onto_a_smaller_mesh_equals_the_original(trained, tmp_path):
    config, _, state = trained
    snapshot.Snapshotter(_snap_cfg(config, tmp_path), str(tmp_path / "w")).save(2, state, None)
    for mesh in (dict(fsdp=4), dict(tensor=2), dict()):  # 4, 2 and 1 device(s): other shards, other owners
        small = program_for(small_config(mesh, n_kv_heads=2))
        restored, _, _ = snapshot.restore(str(tmp_path), 2, small.abstract_state())
        assert len(jax.tree.leaves(restored)[1].sharding.device_set) == max(1, int(np.prod(list(mesh.values()))))
        _assert_bitwise(restored, state)


def test_bad_snapshot_config_is_named():
    for key, value in (("every", -1), ("keep", 0), ("peer_timeout_s", -1.0)):
        c = small_config()
        c.train.snapshot[key] = value
        with pytest.raises(ConfigError, match=f"config.train.snapshot.{key}"):
            validate(c)


def test_a_collective_failing_on_read_back_lets_the_watchdog_name_the_lost_peer():
    """A dead peer can surface first as the snapshot ring's read-back error, a ValueError with XLA's
    status (seen in experiments/fault_tolerance: the survivor exited 1 instead of PeerLost 75);
    train.main then waits for the watchdog as for a JaxRuntimeError. Other errors exit at once."""
    from jaxsys import train

    lost = "UNKNOWN: Gloo collective permute failed: [pair.cc:538] Read error: Connection reset by peer"
    assert train._runtime_failure(ValueError(lost))
    assert not train._runtime_failure(ValueError("config.train.snapshot.every=-1: use k >= 1"))
    assert not train._runtime_failure(KeyError("UNKNOWN: not a runtime error type"))
