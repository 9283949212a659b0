"""Checkpoints: exact resume, restore onto another mesh, clear errors for mismatched checkpoints."""

import json

import chex
import jax
import numpy as np
import pytest

from jaxsys import data, train
from jaxsys.checkpoint import Checkpointer, CheckpointError
from tests.helpers import crash_then_resume, program_for, small_config


def _losses(workdir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(workdir / "metrics.jsonl"))}


def _config(mesh, steps, every):
    c = small_config(mesh, n_kv_heads=4)  # K divides every tensor size used here
    c.train.steps, c.checkpoint.every_steps, c.train.log_every = steps, every, 1
    c.train.microbatches = mesh.get("pipe", 1)
    return c


def test_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path, monkeypatch):
    mesh = dict(data=2, fsdp=2, tensor=2)
    train.main(_config(mesh, 6, 3), str(tmp_path / "full"))

    # the run dies before its 5th step (step 3 was checkpointed); then the same command again
    records = crash_then_resume(monkeypatch, lambda: _config(mesh, 6, 3), str(tmp_path / "resumed"))
    assert [r["step"] for r in records] == [4, 5, 6]
    full, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(1, 7))  # steps 1-3 before the crash, 4-6 after
    for step in range(1, 7):
        assert resumed[step] == full[step], step  # bitwise on CPU


def test_restore_onto_other_meshes(tmp_path):
    saved_on = dict(data=2, fsdp=2, tensor=2)
    train.main(_config(saved_on, 2, 2), str(tmp_path))
    states, programs = {}, {}
    for name, mesh in {
        "saved": saved_on,
        "fsdp8": dict(fsdp=8),
        "tensor4_data2": dict(tensor=4, data=2),
        "pipe2_tensor2_data2": dict(pipe=2, tensor=2, data=2),
        "one_device": {},
    }.items():
        program = program_for(_config(mesh, 2, 2))
        state = Checkpointer(str(tmp_path), _config(mesh, 2, 2).checkpoint).restore(program.abstract_state())
        assert jax.tree.leaves(state.params)[0].sharding.mesh.shape == program.mesh.shape
        states[name], programs[name] = state, program
    reference = jax.tree.map(np.asarray, states["saved"])
    for name, state in states.items():
        chex.assert_trees_all_equal(state, reference, custom_message=name)
    # The next step from the restored state gives the same loss on every layout; the layouts sum
    # in different orders, so fp32 rounding (~1e-6 relative here) is all that may differ.
    next_losses = {name: _next_step_loss(programs[name], state) for name, state in states.items()}
    for name, loss in next_losses.items():
        np.testing.assert_allclose(loss, next_losses["saved"], rtol=1e-5, err_msg=name)


def test_load_reads_the_step_asked_for_onto_the_mesh_its_config_names(tmp_path, monkeypatch):
    """`checkpoint.load`: the saved config with overrides, its program on the mesh that config
    names, and the parameters of the step asked for (default: the latest). A missing workdir or
    step, a bad override or a mesh the devices do not fit is named before any program is built."""
    from jaxsys import checkpoint
    from jaxsys import program as program_lib
    from jaxsys.config import ConfigError

    saved_on = dict(data=2, fsdp=2, tensor=2)
    train.main(_config(saved_on, 2, 1), str(tmp_path))  # steps 1 and 2
    reader = Checkpointer(str(tmp_path), _config(saved_on, 2, 1).checkpoint, read_only=True)
    abstract = program_for(_config(saved_on, 2, 1)).abstract_state()
    want = {step: jax.tree.map(np.asarray, reader.restore(abstract, step).params) for step in (1, 2)}
    reader.close()
    assert not np.array_equal(want[1]["embed"], want[2]["embed"])

    program, params, config = checkpoint.load(str(tmp_path))
    assert (config.mesh.data, config.mesh.fsdp, config.mesh.tensor) == (2, 2, 2)
    assert jax.tree.leaves(params)[0].sharding.mesh.shape == program.mesh.shape
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, params), want[2])
    _, params, _ = checkpoint.load(str(tmp_path), step=1)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, params), want[1])
    program, params, config = checkpoint.load(
        str(tmp_path), ["--config.mesh.data=1", "--config.mesh.fsdp=1", "--config.mesh.tensor=4"], step=2
    )
    assert program.layout.mesh_sizes["tensor"] == 4 and program.mesh.devices.size == 4
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, params), want[2])
    program, params, config = checkpoint.load(str(tmp_path), checkpoint.ONE_DEVICE, devices=jax.devices()[:1])
    assert program.mesh.devices.size == 1 and config.mesh.tensor == 1
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, params), want[2])

    def no_build(*args, **kwargs):
        raise AssertionError("a program was built before the error")

    monkeypatch.setattr(program_lib, "build", no_build)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="has no complete step 7"):
        checkpoint.load(str(tmp_path), step=7)
    with pytest.raises(ConfigError, match="config.mesh.tensr"):
        checkpoint.load(str(tmp_path), ["--config.mesh.tensr=4"])
    with pytest.raises(ConfigError):  # 2 x 2 x 2 devices asked for, one given
        checkpoint.load(str(tmp_path), devices=jax.devices()[:1])


def _next_step_loss(program, state) -> float:
    c = program.config
    batch = data.global_batch(
        data.load_corpus(c.data), program.batch_sharding, c.seed, int(state.step), c.train.batch_size, c.data.seq_len
    )
    _, metrics = program.train_step_fn()(state, batch)
    return float(metrics["loss"])


def test_checkpoint_of_another_model_names_the_tensor(tmp_path):
    train.main(_config(dict(data=8), 1, 1), str(tmp_path))
    other = _config(dict(data=8), 2, 1)
    other.model.d_ff = 256
    with pytest.raises(
        CheckpointError,
        match=r"tensor params/layers/w_down has shape \(2, 128, 64\) but the config expects \(2, 256, 64\)",
    ):
        train.main(other, str(tmp_path))


def test_truncated_checkpoint_is_reported_and_kept(tmp_path):
    train.main(_config(dict(data=8), 1, 1), str(tmp_path))
    step_dir = tmp_path / "checkpoints" / "1" / "state"
    for path in step_dir.rglob("*"):
        if path.is_file() and path.stat().st_size > 1000:  # cut the largest array files in half
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match="could not be read.*nothing was deleted"):
        train.main(_config(dict(data=8), 2, 1), str(tmp_path))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_inspect_lists_steps_shapes_and_saved_shardings(tmp_path, capsys):
    from jaxsys import checkpoint
    from jaxsys.checkpoint.__main__ import main

    train.main(_config(dict(data=2, fsdp=2, tensor=2), 2, 1), str(tmp_path))
    info = checkpoint.inspect(str(tmp_path))
    assert info["steps"] == [1, 2] and info["latest"] == 2
    embed = next(t for t in info["tensors"] if t["name"] == "params/embed")
    assert embed["shape"] == [256, 64] and embed["dtype"] == "float32"
    assert embed["partition_spec"] == ["tensor", "fsdp"]
    assert embed["mesh"]["data"] == 2 and embed["mesh"]["tensor"] == 2
    assert main(["inspect", str(tmp_path)]) == 0
    assert "params/layers/w_down" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "nope")]) == 2


def test_saves_are_due_by_steps_by_minutes_and_at_the_end(tmp_path, monkeypatch):
    from jaxsys import checkpoint

    now = [1000.0]
    monkeypatch.setattr(checkpoint.time, "monotonic", lambda: now[0])
    cfg = small_config().checkpoint
    cfg.every_steps, cfg.every_minutes = 10, 0.5
    ckpt = Checkpointer(str(tmp_path), cfg)
    assert not ckpt.due(3, final=False)
    assert ckpt.due(10, final=False)  # by steps
    assert ckpt.due(3, final=True)  # the last step is always saved
    now[0] += 29.0
    assert not ckpt.due(4, final=False)
    now[0] += 1.0
    assert ckpt.due(4, final=False)  # 30 s = 0.5 minutes since the checkpointer started
    cfg.every_steps = 0
    ckpt = Checkpointer(str(tmp_path), cfg)
    assert not ckpt.due(10, final=False)  # every_steps=0: by time only
    ckpt.close()
