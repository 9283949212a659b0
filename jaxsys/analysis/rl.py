"""RL weight sync: the bytes of the trainer -> generator transfer by formula (docs/rl.md).

After each update the new weights go from the trainer's layout to the generator's. When the two
sub-meshes are disjoint every byte a generator device holds comes from another device, so

    bytes = sum over parameters p of  bytes(p) x n_gen / shards_gen(p)

where shards_gen(p) is the number of distinct pieces p is cut into on the generator (the product
of the mesh axes its PartitionSpec names) and n_gen / shards_gen(p) the copies the generator's
replication makes of each piece. `serve.engine.reshard` (what `Engine.set_params` runs) counts the
bytes it moves; the tests require the two to be equal. Formulas only: nothing is compiled.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from jaxsys.cache import base as cache_base
from jaxsys.config import MESH_AXES, validate


def _spec_axes(pspec) -> list:
    out = []
    for entry in pspec:
        if entry is None:
            continue
        out += list(entry) if isinstance(entry, tuple) else [entry]
    return out


def sync_bytes(config, dtype=None) -> int:
    """Bytes the generator's devices receive from a disjoint trainer: `config` is the generator's
    (its mesh and rules; parameters in config.model.param_dtype unless `dtype`)."""
    from jaxsys.models import transformer
    from jaxsys.models.params import is_spec
    from jaxsys.sharding import Layout

    layout = Layout.from_config(config)
    sizes = {a: config.mesh[a] for a in MESH_AXES}
    n = math.prod(sizes.values())
    item = np.dtype(dtype or config.model.param_dtype).itemsize
    total = 0
    for spec in jax.tree.leaves(transformer.param_specs(config.model), is_leaf=is_spec):
        shards = math.prod(sizes[a] for a in _spec_axes(layout.param_spec(spec.axes)))
        total += math.prod(spec.shape) * item * n // shards
    return total


def all_gather_bytes(config, dtype=None) -> int:
    """The naive sync: every generator device receives the full weights (gather, then slice)."""
    from jaxsys.models import transformer
    from jaxsys.models.params import is_spec

    item = np.dtype(dtype or config.model.param_dtype).itemsize
    n = math.prod(config.mesh[a] for a in MESH_AXES)
    specs = jax.tree.leaves(transformer.param_specs(config.model), is_leaf=is_spec)
    return n * sum(math.prod(s.shape) for s in specs) * item


# ----------------------------------------------------------------------------- the RL iteration model


def _quiet(*args, **kwargs) -> None:
    return None


def rollout_config(config, sequences: int, prompt: int, completion: int):
    """`config` with the training batch of one RL update: `sequences` rows of prompt + completion."""
    c = config.copy_and_resolve_references()
    c.train.batch_size = sequences
    c.data.seq_len = prompt + completion
    return c


def generator_layouts(config, devices: int) -> list:
    """Servable layouts of `devices` for generation: tensor t x data devices/t (t a power of two)."""
    from jaxsys.serve import disagg
    from jaxsys.serve.runner import check_servable

    out = []
    t = 1
    while t <= devices:
        if devices % t == 0:
            c = config.copy_and_resolve_references()
            for axis in MESH_AXES:
                c.mesh[axis] = 1
            c.mesh.tensor, c.mesh.data = t, devices // t
            c.parallel.sequence_parallel = False
            c.parallel.collective_matmul = False
            c.train.batch_size = c.mesh.data  # generation does not split a training batch
            try:
                validate(c, num_devices=devices)
                check_servable(c)
                disagg._model_divides(c, f"tensor={t}")
                out.append(c)
            except Exception:  # noqa: BLE001 - a layout this model refuses is skipped
                pass
        t *= 2
    return out


def generation_seconds(gen_config, hw, sequences: int, prompt: int, completion: int) -> dict | None:
    """Modelled time to roll out `sequences` samples (prefill, then `completion` decode steps) on
    `gen_config`'s layout (analysis/serving.step_seconds, the engine step's roofline); None when
    the weights and the KV cache of a batch shard's sequences do not fit the HBM."""
    from jaxsys.analysis.decode import weight_bytes_per_device
    from jaxsys.analysis.serving import step_seconds

    m = gen_config.model
    d, t = gen_config.mesh.data, gen_config.mesh.tensor
    per_shard = -(-sequences // d)
    kv_token = cache_base.token_bytes(m, t)
    weights = (
        weight_bytes_per_device(gen_config) * np.dtype(m.compute_dtype).itemsize / np.dtype(m.param_dtype).itemsize
    )
    memory = weights + per_shard * (prompt + completion) * kv_token
    if memory > hw.hbm_bytes:
        return None
    prefill = step_seconds(gen_config, hw, [(per_shard * prompt, per_shard * prompt * (prompt + 1) // 2)])
    decode = completion * step_seconds(gen_config, hw, [(per_shard, per_shard * (prompt + completion // 2))])
    return {"seconds": prefill + decode, "prefill_s": prefill, "decode_s": decode, "memory": memory}


def best_generator(config, devices: int, hw, sequences: int, prompt: int, completion: int):
    best = None
    for c in generator_layouts(config, devices):
        g = generation_seconds(c, hw, sequences, prompt, completion)
        if g is not None and (best is None or g["seconds"] < best[1]["seconds"]):
            best = (c, g)
    return best


def trainer_plan(config, devices: int, hw):
    """The planner's best trainer layout of `devices` for the update's batch (analysis/planner.plan,
    formulas only) that the GRPO trainer runs (no pipe, no seq axis), with its predicted step; None
    when nothing fits."""
    from jaxsys.analysis import planner
    from jaxsys.config import ConfigError

    try:
        result = planner.plan(config, devices, hw, top=0, log=_quiet)
    except ConfigError:
        return None
    # the GRPO trainer runs without pipeline and context parallelism (rl/program.py)
    runnable = [c for c in result["ranked"] if c.overrides["mesh.pipe"] == 1 and c.overrides["mesh.seq"] == 1]
    return runnable[0] if runnable else None


def _layout_name(config) -> str:
    return " x ".join(f"{a}={config.mesh[a]}" for a in MESH_AXES if config.mesh[a] > 1) or "1 device"


def _mesh_text(config) -> str:
    """The mesh as config.rl.*_mesh takes it ("data=2,tensor=2")."""
    return ",".join(f"{a}={config.mesh[a]}" for a in MESH_AXES if config.mesh[a] > 1) or "data=1"


def iteration_times(config, devices: int, hw, prompts: int, group: int, prompt: int, completion: int, splits=None):
    """Predicted seconds of one RL iteration (rollouts of prompts x group samples, one update) for
    colocated, disaggregated and asynchronous placements, each with its layouts and device split
    chosen by the cost model:

        colocated       gen(N) + train(N) + swap + reshard         (all N devices take turns)
        disaggregated   gen(N_g) + train(N_t) + sync               (N_t + N_g = N, one after the other)
        async (k >= 1)  max(gen(N_g), train(N_t) + sync)           (both sides busy, weights k old)

    train = the planner's predicted step for the trainer's best layout, plus one forward for the
    reference's log-probabilities (a third of the step's FLOPs); gen = the engine's roofline over
    prefill and decode steps (`generation_seconds`); sync = the bytes a generator device receives
    (`sync_bytes` / N_g) over the inter-node link; swap = the optimizer state to host memory and
    back over the host link; reshard (colocated) = each device's missing share
    (sync_bytes(N) - all parameters) / N over the inter-node link."""
    from jaxsys.analysis import cost_model

    sequences = prompts * group
    base = rollout_config(config, sequences, prompt, completion)
    dtype = base.model.compute_dtype
    splits = splits or [n for n in range(devices // 8, devices, devices // 8)] if devices >= 8 else [devices // 2]
    trainers: dict = {}

    def train(n):
        if n not in trainers:
            w = trainer_plan(base, n, hw)
            trainers[n] = None if w is None else (w, w.step["step_s"] * (1 + 1 / 3))
        return trainers[n]

    def sync_s(gen_config, n_gen):
        per_device = sync_bytes(gen_config, dtype) / n_gen
        return per_device / hw.inter_node_bytes_per_s + hw.collective_latency_s

    out: dict = {"sequences": sequences, "prompt": prompt, "completion": completion, "devices": devices}
    # colocated
    t_all, g_all = train(devices), best_generator(base, devices, hw, sequences, prompt, completion)
    if t_all is not None and g_all is not None:
        winner, t_s = t_all
        opt = cost_model.predicted_memory(winner.config)["optimizer"]
        swap = 2 * opt / hw.host_link_bytes_per_s
        params = (
            sum(math.prod(s.shape) for s in jax.tree.leaves(_specs(base.model), is_leaf=_is_spec))
            * np.dtype(dtype).itemsize
        )
        reshard = max(0.0, (sync_bytes(g_all[0], dtype) - params) / devices) / hw.inter_node_bytes_per_s
        out["colocated"] = dict(
            seconds=g_all[1]["seconds"] + t_s + swap + reshard,
            gen_s=g_all[1]["seconds"],
            train_s=t_s,
            swap_s=swap,
            sync_s=reshard,
            trainer=winner.name,
            generator=_layout_name(g_all[0]),
            split=f"{devices} shared",
            trainer_overrides=dict(winner.overrides),
            generator_mesh=_mesh_text(g_all[0]),
        )
    best_sync = best_async = None
    for n_t in splits:
        n_g = devices - n_t
        t, g = train(n_t), best_generator(base, n_g, hw, sequences, prompt, completion)
        if t is None or g is None:
            continue
        winner, t_s = t
        s = sync_s(g[0], n_g)
        row = dict(
            gen_s=g[1]["seconds"],
            train_s=t_s,
            sync_s=s,
            trainer=winner.name,
            generator=_layout_name(g[0]),
            split=f"{n_t} + {n_g}",
            sync_bytes=sync_bytes(g[0], dtype),
            trainer_overrides=dict(winner.overrides),
            generator_mesh=_mesh_text(g[0]),
        )
        sync_row = dict(row, seconds=g[1]["seconds"] + t_s + s)
        async_row = dict(row, seconds=max(g[1]["seconds"], t_s + s))
        if best_sync is None or sync_row["seconds"] < best_sync["seconds"]:
            best_sync = sync_row
        if best_async is None or async_row["seconds"] < best_async["seconds"]:
            best_async = async_row
    if best_sync is not None:
        out["disaggregated"] = best_sync
        out["async"] = best_async
    return out


def _specs(model):
    from jaxsys.models import transformer

    return transformer.param_specs(model)


def _is_spec(x) -> bool:
    from jaxsys.models.params import is_spec

    return is_spec(x)
