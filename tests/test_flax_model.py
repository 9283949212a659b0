"""Bring your own Flax model (config.model.kind='flax', docs/flax.md) and jaxsys's transformer as an
nnx.Module (models/flax_wrapper.py).

The Flax NNX GPT of examples/flax_gpt.py trains on every data/ZeRO/FSDP layout with the losses of
one device (the tolerances of tests/test_parity.py: the layouts sum the same fp32 terms in other
orders), resumes bitwise from its checkpoints, restores onto other meshes, and the analysis counts
its nnx.Params exactly. A model whose logical axis names the rules table does not know is refused
before anything compiles, with the known names in the message.
"""

import json
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys import config as config_lib
from jaxsys import data, train
from jaxsys.checkpoint import Checkpointer
from jaxsys.config import ConfigError
from jaxsys.models import flax_model
from tests.helpers import ROOT, config_file, crash_then_resume, program_for, run

# data parallelism with ZeRO-1, FSDP (ZeRO-3), and both with ZeRO-2 (plain data parallelism, ZeRO-0,
# is the layout of the checkpoint test)
LAYOUTS = {
    "data8_zero1": (dict(data=8), 1),
    "fsdp8": (dict(fsdp=8), 0),
    "data2_fsdp2_zero2": (dict(data=2, fsdp=2), 2),
}


def gpt_config(mesh=None, zero_stage=0, **kwargs):
    """configs/flax_gpt.py:test (D=64, L=2, T=32, B=8, untied output) on `mesh`."""
    c = config_file("flax_gpt", "test")
    for axis, size in (mesh or {}).items():
        c.mesh[axis] = size
    c.train.zero_stage = zero_stage
    for key, value in kwargs.items():
        c.model.flax_kwargs[key] = value
    return c


def _scaled(grads, reference):
    """Each leaf over its reference leaf's largest entry: one absolute tolerance then means
    `1e-5 of the leaf's largest entry`, as tests/test_parity.py allows."""
    return jax.tree.map(lambda g, r: np.asarray(g) / max(float(np.abs(r).max()), 1e-30), grads, reference)


_reference = {}


def reference_run():
    if "run" not in _reference:
        _reference["run"] = run(gpt_config())
    return _reference["run"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flax_gpt_layout_matches_single_device(name):
    mesh, zero_stage = LAYOUTS[name]
    ref_loss0, ref_grads, ref_losses, ref_state = reference_run()
    loss0, grads, losses, state = run(gpt_config(mesh, zero_stage))

    np.testing.assert_allclose(loss0, ref_loss0, rtol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0], "three optimizer steps should lower the loss"
    chex.assert_trees_all_equal_shapes(grads, ref_grads)
    chex.assert_trees_all_close(_scaled(grads, ref_grads), _scaled(ref_grads, ref_grads), rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(
        jax.tree.map(np.asarray, state.params), jax.tree.map(np.asarray, ref_state.params), rtol=1e-4, atol=1e-6
    )


def test_params_are_sharded_by_their_logical_names():
    program = program_for(gpt_config(dict(fsdp=8)))
    state = program.abstract_state()
    params = state.params
    # `embed` -> fsdp (the rules table); `mlp` -> tensor, which is 1 here: replicated
    assert params["blocks"]["0"]["up"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp")
    assert params["blocks"]["0"]["down"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert params["positions"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert params["blocks"]["0"]["up"]["bias"].sharding.spec == jax.sharding.PartitionSpec()
    chex.assert_shape(params["embed"]["embedding"], (256, 64))
    # the optimizer moments follow the parameters
    mu = state.opt_state[0].mu
    assert mu["blocks"]["1"]["attn"]["wq"].sharding.spec == jax.sharding.PartitionSpec("fsdp")


# ----------------------------------------------------------------------------- checkpoints


def _losses(workdir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(workdir / "metrics.jsonl"))}


def _ckpt_config(mesh, steps=6, every=3):
    c = gpt_config(mesh)
    c.train.steps, c.checkpoint.every_steps, c.train.log_every = steps, every, 1
    return c


@pytest.mark.slow  # three runs and four restores: ~25 s on 2 idle cores, ~60 s on a loaded machine
def test_flax_gpt_resumes_bitwise(tmp_path, monkeypatch):
    mesh = dict(data=2, fsdp=4)
    train.main(_ckpt_config(mesh), str(tmp_path / "full"))

    # the run dies before its 5th step (step 3 was checkpointed); then the same command again
    records = crash_then_resume(monkeypatch, lambda: _ckpt_config(mesh), str(tmp_path / "resumed"))
    assert [r["step"] for r in records] == [4, 5, 6]
    full, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(1, 7))
    for step in range(1, 7):
        assert resumed[step] == full[step], step  # bitwise on CPU

    # the checkpoint restores onto other meshes (resharding) with equal values
    states = {}
    for name, other in {"saved": mesh, "fsdp8": dict(fsdp=8), "data4": dict(data=4), "one_device": {}}.items():
        c = _ckpt_config(other)
        program = program_for(c)
        states[name] = Checkpointer(str(tmp_path / "full"), c.checkpoint).restore(program.abstract_state())
        assert jax.tree.leaves(states[name].params)[0].sharding.mesh.shape == program.mesh.shape
    reference = jax.tree.map(np.asarray, states["saved"])
    for name, state in states.items():
        chex.assert_trees_all_equal(jax.tree.map(np.asarray, state), reference)


# ----------------------------------------------------------------------------- analysis


def test_analysis_counts_the_nnx_params_exactly():
    from examples.flax_gpt import GPT  # examples/ is importable from the repository root
    from jaxsys.analysis import report

    c = gpt_config(dict(fsdp=8))
    with nnx.use_eager_sharding(False):
        model = GPT(**c.model.flax_kwargs.to_dict(), rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    r = report.analyze(c, "cpu", jax.devices()[:8], flops=False)
    assert r["params_count"] == n
    # bytes per device: the `embed`-named dimensions split over fsdp=8, the others replicated
    specs = flax_model.describe(c.model).specs
    leaves = jax.tree.leaves(specs, is_leaf=flax_model.is_spec)
    local = sum(int(np.prod(s.shape)) // (8 if "embed" in s.axes else 1) for s in leaves)
    assert r["memory"]["params_bytes"] == 4 * local
    assert r["memory"]["optimizer_bytes"] == 2 * 4 * local + 8  # AdamW's two moments, two int32 step counts
    assert r["model_flops_per_device"] == pytest.approx(6 * n * c.train.batch_size * c.data.seq_len / 8)


# ----------------------------------------------------------------------------- errors


class UnknownAxis(nnx.Module):
    """A model whose MLP names its hidden axis 'hidden', which jaxsys's rules table does not know."""

    def __init__(self, vocab_size=256, d_model=16, *, rngs):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Param(init(rngs.params(), (vocab_size, d_model)), out_sharding=("vocab", "embed"))
        self.w = nnx.Param(init(rngs.params(), (d_model, 32)), out_sharding=("embed", "hidden"))

    def __call__(self, tokens):
        x = self.embed[...][tokens]
        return (x @ self.w[...]) @ self.w[...].T @ self.embed[...].T


class HoldsDropout(nnx.Module):
    def __init__(self, *, rngs):
        self.embed = nnx.Embed(256, 8, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, tokens):
        return self.embed.attend(self.dropout(self.embed(tokens)))


def _custom(cls_name, **mesh):
    c = gpt_config(mesh)
    c.model.flax_module = f"{__name__}:{cls_name}"
    c.model.flax_kwargs = type(c.model.flax_kwargs)()
    return c


def test_unknown_axis_name_is_refused_with_the_known_names():
    c = _custom("UnknownAxis", fsdp=8)
    with pytest.raises(ConfigError) as e:
        program_for(c)  # before anything compiles
    message = str(e.value)
    assert "'hidden'" in message and "w " in message
    for name in c.sharding.params.keys():
        assert name in message, name


def test_flax_models_refuse_what_they_cannot_do():
    with pytest.raises(ConfigError, match="config.mesh.tensor=2 with config.model.kind='flax'"):
        config_lib.validate(gpt_config(dict(tensor=2)))
    c = gpt_config()
    c.train.optimizer = "zo"
    with pytest.raises(ConfigError, match="config.train.optimizer='zo'"):
        config_lib.validate(c)
    with pytest.raises(ConfigError, match="not an nnx.Param.*Dropout|not an nnx.Param"):
        program_for(_custom("HoldsDropout"))
    c = gpt_config()
    c.model.flax_module = "examples.flax_gpt:NoSuchClass"
    with pytest.raises(ConfigError, match="no 'NoSuchClass'"):
        program_for(c)
    c = gpt_config(d_model=60)  # 60 does not split over fsdp=8
    c.mesh.fsdp = 8
    with pytest.raises(ConfigError, match="not divisible by the 8 shards"):
        program_for(c)
    c = gpt_config(vocab_size=128)  # logits narrower than config.model.vocab_size
    with pytest.raises(ConfigError, match="not logits"):
        program_for(c)


def test_flax_kwargs_override_and_round_trip_through_config_json():
    c = config_lib.load_config(f"{ROOT}/configs/flax_gpt.py:test", ["--config.model.flax_kwargs.d_model=32"])
    assert c.model.flax_kwargs.d_model == 32
    again = config_lib.from_dict(json.loads(c.to_json_best_effort()))
    assert again.model.flax_kwargs.to_dict() == c.model.flax_kwargs.to_dict()
    assert again.model.kind == "flax" and again.model.flax_module == "examples.flax_gpt:GPT"
    with pytest.raises(ConfigError, match="set config.model.kind='flax'"):
        base = config_lib.base_config()
        base.model.flax_module = "examples.flax_gpt:GPT"
        config_lib.validate(base)


def test_normal_configs_do_not_import_flax():
    code = (
        "import sys, jax; from jaxsys import train; from jaxsys.analysis import report; "
        "from tests.helpers import program_for, small_config; "
        "p = program_for(small_config()); p.abstract_state(); "
        "assert not [m for m in sys.modules if m.split('.')[0] == 'flax'], 'flax imported'"
    )
    subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"}
    )


# ----------------------------------------------------------------------------- the nnx wrapper


def test_jaxsys_transformer_as_nnx_module_gives_the_functional_logits():
    from jaxsys.models import transformer
    from jaxsys.models.flax_wrapper import JaxsysTransformer, one_device_layout

    c = config_file("tiny", "test")
    program = program_for(c)  # one device
    params = program.init().params
    lm = JaxsysTransformer.from_params(c.model, params)
    corpus = data.load_corpus(c.data)
    tokens = data.global_batch(corpus, program.batch_sharding, c.seed, 0, c.train.batch_size, c.data.seq_len)
    logits = nnx.jit(lambda lm, t: lm(t))(lm, tokens[:, :-1])
    chex.assert_shape(logits, (c.train.batch_size, c.data.seq_len, c.model.vocab_size))
    functional = jax.jit(lambda p, t: transformer.logits(p, t, c.model, one_device_layout()))
    chex.assert_trees_all_close(logits, functional(params, tokens[:, :-1]), rtol=0, atol=0)  # the same program
    # the training program's loss is the cross-entropy of these logits
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1).mean()
    chex.assert_trees_all_close(ce, program.eval_loss_fn()(params, tokens), rtol=1e-6)
    chex.assert_trees_all_equal(lm.to_params(), params)

    # composed inside a user's Flax module, its parameters are nnx.Params with jaxsys's logical names
    class WithHead(nnx.Module):
        def __init__(self, rngs):
            self.lm = JaxsysTransformer(c.model, rngs=rngs)
            self.head = nnx.Linear(c.model.vocab_size, 2, rngs=rngs)

        def __call__(self, tokens):
            return self.head(self.lm(tokens)[:, -1])

    model = WithHead(nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    assert specs["lm"]["params"]["layers"]["wq"].out_sharding == ("layers", "embed", "heads", "head_dim")
    grads = nnx.jit(nnx.grad(lambda m, t: m(t).sum()))(model, tokens[:, :-1])
    chex.assert_trees_all_equal_shapes(
        nnx.to_pure_dict(grads["lm"]["params"]), jax.tree.map(np.asarray, model.lm.to_params())
    )
