"""Shared helpers for the tests: small configs and one-call runs on a chosen layout."""

from __future__ import annotations

import importlib.util
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxsys import data, train
from jaxsys.mesh import make_mesh
from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# `python -m jaxsys.train` flags of the multi-process tests: tiny on data=2 x fsdp=2 x tensor=2 (8 devices
# in 2 processes; tiny's n_heads=8 and n_kv_heads=2 both divide tensor=2)
TINY_8_DEVICES = [
    "--config",
    "configs/tiny.py:test",
    "--config.mesh.data=2",
    "--config.mesh.fsdp=2",
    "--config.mesh.tensor=2",
    "--config.model.n_kv_heads=2",
]


def config_file(name: str, arg: str | None = None):
    spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


# Gemma 3's pieces on the tiny model (config.model keys), for the tests that run them together
GEMMA3_PIECES = dict(
    qk_norm=True,
    embed_scale=True,
    mlp_activation="gelu_tanh",
    post_norms=True,
    query_pre_attn_scalar=16.0,
    rope_local_theta=1e4,
    rope_theta=1e6,
)
# Gemma 2's: the same without q/k norms or a local RoPE base, with soft-capped attention scores and
# logits (caps small enough to matter for a model initialised with init_std=0.2)
GEMMA2_PIECES = dict(
    embed_scale=True,
    mlp_activation="gelu_tanh",
    post_norms=True,
    query_pre_attn_scalar=16.0,
    attn_logit_softcap=1.5,
    final_logit_softcap=2.0,
    init_std=0.2,
)


def small_config(mesh=None, **model):
    """The tiny test model (D=64, L=2, N=8, T=32, B=8) with the given mesh and model overrides."""
    c = config_file("tiny", "test")
    for key, value in model.items():
        c.model[key] = value
    for axis, size in (mesh or {}).items():
        c.mesh[axis] = size
    return c


def program_for(config):
    n = int(np.prod([config.mesh[a] for a in config.mesh]))
    return train.build(config, make_mesh(config, jax.devices()[:n]))


def generate_contiguous(program, params, prompts, n: int, max_len: int = 64, drafter=None, k: int = 0, **sampling):
    """`n` new tokens per prompt from the serving engine with a contiguous cache (a row of max_len
    slots per sequence, layers.attention over it): the reference the paged and quantized caches
    are compared with. Whole prompts prefill in one step; `sampling` (temperature, seed, ...) is
    every request's."""
    from jaxsys.serve import engine
    from jaxsys.serve.sampling import Sampling

    layout = program.layout
    shards = layout.size(layout.compute_axes("batch"))
    eng = engine.Engine(
        program,
        params,
        token_budget=max(64, max_len),
        chunk_size=max_len,
        max_seqs=-(-len(prompts) // shards),
        cache="contiguous",
        max_len=max_len,
        drafter=drafter,
        k=k,
    )
    return engine.generate(eng, prompts, n, Sampling(**sampling))


def reference_logprob_rows(program, params, ids) -> np.ndarray:
    """log p(. | ids[:i + 1]) [len(ids) - 1, V]: the training forward on one device, log_softmax in
    fp32 (the reference for served logprobs)."""
    from jaxsys.models import transformer

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    host = jax.device_put(jax.tree.map(np.asarray, params), one)
    logits = transformer.logits(host, jnp.asarray([ids[:-1]], jnp.int32), program.config.model, program.layout)
    return np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))


def pipeline_config(mesh=None, schedule="1f1b", microbatches=4, virtual_stages=1, vocab_parallel=False, **model):
    """`small_config` with 8 layers and a pipeline schedule."""
    c = small_config(mesh, **{"n_layers": 8, **model})
    c.train.microbatches, c.train.pipeline_schedule = microbatches, schedule
    c.train.virtual_stages, c.parallel.vocab_parallel = virtual_stages, vocab_parallel
    return c


def unchunked(params):
    """Layer leaves [v, L/v, ...] of an interleaved pipeline back to [L, ...]."""
    layers = jax.tree.map(lambda a: np.asarray(a).reshape(-1, *a.shape[2:]), params["layers"])
    return {**params, "layers": layers}


def loss_and_grads(config):
    """Loss and reduced gradients (numpy, layers as [L, ...]) at the initial parameters on batch 0."""
    program = program_for(config)
    corpus = data.load_corpus(config.data)
    batch = data.global_batch(
        corpus, program.batch_sharding, config.seed, 0, config.train.batch_size, config.data.seq_len
    )
    loss, grads = program.loss_and_grads_fn()(program.init().params, batch)
    grads = jax.tree.map(np.asarray, grads)
    return float(loss), unchunked(grads) if config.train.virtual_stages > 1 else grads


def run(config, steps: int = 3):
    """Step-0 loss and gradients (as numpy), and the losses of `steps` optimizer steps."""
    program = program_for(config)
    corpus = data.load_corpus(config.data)
    batch = lambda s: data.global_batch(
        corpus, program.batch_sharding, config.seed, s, config.train.batch_size, config.data.seq_len
    )
    state = program.init()
    loss0, grads = program.loss_and_grads_fn()(state.params, batch(0))
    grads = jax.tree.map(np.asarray, grads)
    step = program.train_step_fn()
    losses = []
    for s in range(steps):
        state, metrics = step(state, batch(s))
        losses.append(float(metrics["loss"]))
    return float(loss0), grads, np.array(losses), state


def assert_same_run(want, got, what: str, atol: float = 1e-6) -> None:
    """Two `run` results of one model on two layouts: losses within 1e-6 relative and final
    parameters within `atol` absolute (the caller states why its optimizer keeps them there)."""
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6, err_msg=what)
    chex.assert_trees_all_close(got[3].params, want[3].params, rtol=0, atol=atol, custom_message=what)


def assert_trees_close_leafwise(got, want, rtol: float, atol):
    """`chex.assert_trees_all_close(got, want, rtol=rtol)` with an absolute tolerance per leaf, `atol(w)` of the wanted
    leaf `w`: entries built by cancellation carry the rounding of their leaf's large terms, so the bound scales with
    the leaf (tests/test_parity.py). chex takes one atol for the whole tree; its comparator still checks that the
    structures match and names the path of the leaf that differs."""

    def failure(g, w) -> str:
        w = np.asarray(w)
        try:
            np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=atol(w))
        except AssertionError as e:
            return str(e)
        return ""

    chex.assert_trees_all_equal_comparator(lambda g, w: not failure(g, w), failure, got, want)


_DIST_ENV = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(devices: int, **extra: str) -> dict[str, str]:
    """The environment of a `python -m jaxsys...` subprocess with `devices` simulated CPU devices
    (no distributed settings inherited) and the repository on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["XLA_FLAGS"] = xla_flags(devices)  # replaces conftest's 8
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


class Interrupted(Exception):
    """A training run killed on purpose (a stand-in for a crash)."""


def crash_then_resume(monkeypatch, make_config, workdir: str, crash_step: int = 4) -> list[dict]:
    """Train `make_config()` in `workdir` with the train split's batch of step `crash_step` raising
    Interrupted (the run dies there, after the checkpoints before it), then run the same command
    again; returns the second run's records."""
    real_batch = train.data_lib.global_batch

    def batch_until_crash(corpus, sharding, seed, step, *args, **kw):
        if step == crash_step and kw.get("split", args[-1] if len(args) > 2 else "train") == "train":
            raise Interrupted
        return real_batch(corpus, sharding, seed, step, *args, **kw)

    monkeypatch.setattr(train.data_lib, "global_batch", batch_until_crash)
    try:
        train.main(make_config(), workdir)
        raise AssertionError(f"the run in {workdir} did not reach step {crash_step + 1}")
    except Interrupted:
        pass
    finally:
        monkeypatch.setattr(train.data_lib, "global_batch", real_batch)
    return train.main(make_config(), workdir)  # the same command again


def collectives_added(base_config, config) -> dict:
    """{(kind, axes): (count, ring bytes)} of the collectives in `config`'s unrolled train step
    beyond `base_config`'s (an optimizer's, say, against AdamW's on the same layout)."""
    from jaxsys.analysis import collectives, report

    def by_kind(c):
        program = program_for(c)
        sizes = dict(program.layout.mesh_sizes)
        text = report.lower_unrolled(program).as_text()
        return report.by_kind_axes(report.measured_collectives(collectives.parse(text, sizes), sizes))

    base, with_it = by_kind(base_config), by_kind(config)
    return {
        k: (v[0] - base.get(k, [0, 0])[0], v[1] - base.get(k, [0, 0])[1])
        for k, v in with_it.items()
        if tuple(v) != tuple(base.get(k, [0, 0]))
    }
