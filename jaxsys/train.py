"""Training: the state, the step (one shard_map over the whole mesh), and the loop.

    python -m jaxsys.train --config configs/tiny.py --workdir /tmp/tiny [--config.key=value ...]

or, from a notebook, `jaxsys.train.main(config, workdir)`.

The step runs inside `jax.shard_map` over every mesh axis. Per shard: forward and backward of the
model (whose collectives are the Megatron and FSDP ones of `jaxsys.parallel`), the data-parallel
gradient reduction and ZeRO update of `jaxsys.parallel.zero`, clipping by the global norm. The
program therefore contains exactly the collectives jaxsys wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import data as data_lib
from jaxsys import optim, zo
from jaxsys.analysis import flops as flops_lib
from jaxsys.analysis import hardware
from jaxsys.checkpoint import Checkpointer
from jaxsys.config import ConfigError, load_config, validate, parse_with_overrides
from jaxsys.mesh import cpu_unless_accelerator, make_mesh, maybe_initialize_distributed
from jaxsys.models import moe as moe_lib
from jaxsys.models import params as params_lib
from jaxsys.models import transformer
from jaxsys.parallel import expert, expert_placement, offload, pipeline, zero
from jaxsys.sharding import Layout


def _moe_term(moe_stats, norm: int):
    """What the MoE layers add to the objective: their load-balancing and z-loss sums, per token."""
    if not moe_stats:
        return jnp.zeros((), jnp.float32)
    return (moe_stats["aux_loss"] + moe_stats["z_loss"]) / norm


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any
    opt_state: Any


def _is_p(x) -> bool:
    return isinstance(x, P)


@dataclasses.dataclass
class Program:
    """Everything derived from (config, mesh): specs, shardings and the compiled functions."""

    config: Any
    mesh: jax.sharding.Mesh
    layout: Layout
    specs: Any  # ParamSpec pytree
    param_pspecs: Any
    plans: Any  # zero.LeafPlan per leaf
    grad_pspecs: Any  # gradients as the update sees them (sliced over `data` at ZeRO >= 1)
    optimizer: optax.GradientTransformation
    state_pspecs: TrainState
    batch_pspec: P
    unroll_layers: bool = False  # write the layer scan out (for counting collectives)
    pipeline_train: pipeline.Program | None = None  # the schedule in lockstep ticks (mesh.pipe > 1)
    pipeline_eval: pipeline.Program | None = None  # its forwards only
    offload: offload.Plan = offload.Plan()
    state_kinds: TrainState | None = None  # memory kind of every state leaf (device | pinned_host)

    # -- shardings and shapes
    def shardings(self, pspecs, kinds=None):
        if kinds is None:
            return jax.tree.map(lambda s: NamedSharding(self.mesh, s), pspecs, is_leaf=_is_p)
        return jax.tree.map(lambda s, k: NamedSharding(self.mesh, s, memory_kind=k), pspecs, kinds,
                            is_leaf=_is_p)

    @property
    def state_shardings(self) -> TrainState:
        return self.shardings(self.state_pspecs, self.state_kinds)

    @property
    def param_shardings(self):
        return self.shardings(self.param_pspecs, self.state_kinds.params if self.state_kinds else None)

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.batch_pspec)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state without materialising it."""
        shapes = jax.eval_shape(self._init, jax.random.key(0))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, self.state_shardings)

    def _init(self, key) -> TrainState:
        params = params_lib.init_params(self.specs, key, jnp.dtype(self.config.model.param_dtype))
        return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params))

    def fresh_state(self, params) -> TrainState:
        """Step 0 and a fresh optimizer state around `params` (config.checkpoint.init_from)."""
        start = lambda p: TrainState(jnp.zeros((), jnp.int32), p, self.optimizer.init(p))
        return jax.jit(start, out_shardings=self.state_shardings, donate_argnums=0)(params)

    def init(self, seed: int | None = None) -> TrainState:
        seed = self.config.seed if seed is None else seed
        init = jax.jit(self._init, out_shardings=self.state_shardings)
        return init(jax.random.fold_in(jax.random.key(seed), 0))

    @property
    def tokens_per_step(self) -> int:
        """B T: the tokens of a global batch, what every per-token loss is divided by."""
        return self.config.train.batch_size * self.config.data.seq_len

    # -- per-shard functions
    def _local_objective(self, params, tokens, hook=None):
        """This shard's share of the global mean objective (the shares sum to it over the shards):
        token cross-entropy plus the MoE losses. Aux: (its share of the cross-entropy, MoE stats).
        `hook` sees every weight as it is read (`transformer._weights`; zeroth-order perturbations)."""
        c, norm = self.config, self.tokens_per_step
        losses, moe_stats = transformer.token_losses(params, tokens, c.model, self.layout, self.specs,
                                                     self.unroll_layers, c.parallel.expert_dispatch, hook)
        ce = jnp.sum(losses) / norm
        return ce + _moe_term(moe_stats, norm), (ce, moe_stats)

    def _local_loss(self, params, tokens):
        """This shard's share of the global mean token cross-entropy (evaluation)."""
        if self.pipeline_eval is not None:
            return self._pipeline(params, tokens, self.pipeline_eval)[2][0]
        return self._local_objective(params, tokens)[1][0]

    def _metrics(self, ce, moe_stats):
        """Step metrics from this shard's cross-entropy share and MoE stats: the loss terms summed
        over the batch axes (one all-reduce), the routing statistics (already global) as they are."""
        axes, norm = self.layout.batch_axes, self.tokens_per_step
        terms = {"loss": ce}
        if moe_stats:
            terms.update(moe_aux_loss=moe_stats["aux_loss"] / norm, moe_z_loss=moe_stats["z_loss"] / norm)
        metrics = jax.lax.psum(terms, axes) if axes else terms
        if moe_stats:
            metrics.update({f"moe_{k}": moe_stats[k] for k in moe_lib.ROUTING_STATISTICS})
        return metrics

    def _pipeline(self, params, tokens, program: pipeline.Program):
        """Through the pipeline executor, tokens split into micro-batches: (this shard's objective
        share, gradients (None without backward), (its cross-entropy share, MoE stats))."""
        c, m, layout, specs = self.config, self.config.model, self.layout, self.specs
        inputs, targets, positions = transformer.split_tokens(tokens, m, layout)
        # the ticks read a stage's weights many times: with config.offload.params they move in once
        params = offload.fetch(params, layout.params_on_host)
        split = lambda a: a.reshape(program.m, a.shape[0] // program.m, *a.shape[1:])
        norm = self.tokens_per_step

        def stack(w, x):
            y, moe_stats = transformer.layer_stack(w, x, positions, m, layout, specs, self.unroll_layers,
                                                   c.parallel.expert_dispatch)
            return y, _moe_term(moe_stats, norm), moe_stats

        fns = pipeline.StageFns(
            embed=lambda sh, ids: transformer.embed(sh, ids, m, layout, specs),
            stack=stack,
            norm=lambda sh, y: transformer.final_norm(sh, y, m, layout, specs),
            loss=lambda sh, h, t: jnp.sum(transformer.output_loss(sh, h, t, m, layout, specs)) / norm)
        ce, grads, moe_stats = pipeline.run(fns, params, split(inputs), split(targets), program)
        return ce + _moe_term(moe_stats, norm), grads, (ce, moe_stats)

    def _local_grads(self, params, tokens):
        """(objective, reduced gradients, metrics) of this shard's tokens."""
        mb = self.config.train.microbatches
        value_and_grad = jax.value_and_grad(self._local_objective, has_aux=True)
        if self.pipeline_train is not None:
            loss, grads, (ce, moe_stats) = self._pipeline(params, tokens, self.pipeline_train)
        elif mb > 1:  # gradient accumulation over micro-batches (MoE balance per micro-batch)
            def accumulate(total, batch):
                return jax.tree.map(jnp.add, total, value_and_grad(params, batch)), None

            batches = tokens.reshape(mb, tokens.shape[0] // mb, *tokens.shape[1:])
            zero_total = jax.tree.map(jnp.zeros_like, jax.eval_shape(value_and_grad, params, batches[0]))
            ((loss, (ce, moe_stats)), grads), _ = jax.lax.scan(accumulate, zero_total, batches)
        else:
            (loss, (ce, moe_stats)), grads = value_and_grad(params, tokens)
        # weights read from host memory get their gradients there (the transpose of the move in)
        grads = offload.fetch(grads, self.layout.params_on_host)
        grads = jax.tree.map(zero.reduce_gradient, grads, self.plans)
        metrics = self._metrics(ce, moe_stats)
        objective = metrics["loss"] + metrics.get("moe_aux_loss", 0.0) + metrics.get("moe_z_loss", 0.0)
        return objective, grads, metrics

    def _local_step(self, state: TrainState, tokens):
        if self.config.train.optimizer == "zo":  # two forwards, no gradients (jaxsys/zo.py)
            return zo.local_step(self, state, tokens)
        _, grads, metrics = self._local_grads(state.params, tokens)
        if self.config.train.zero_stage == 1:  # all-reduced: keep this rank's slice
            grads = jax.tree.map(zero.take_slice, grads, self.plans)
        grad_norm = zero.global_norm(grads, self.grad_pspecs, self.layout)
        clip = self.config.train.grad_clip
        scale = jnp.minimum(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else None
        param_slices = jax.tree.map(zero.take_slice, state.params, self.plans)
        if self.offload.optimizer or self.offload.params:
            # the clipping scale goes with the gradients: the streamed update applies it per layer
            device = jax.tree.map(lambda _: offload.DEVICE, state.params)
            param_slices, opt_state = offload.split_update(
                self.optimizer, grads, state.opt_state, param_slices, self.state_kinds.opt_state, device,
                self.offload.host_update, leafwise=self.config.train.optimizer == "adamw" and not self.offload.params, grad_scale=scale,
                tpu_tiles=self.mesh.devices.flat[0].platform == "tpu")
            params = offload.place(jax.tree.map(zero.gather_slices, param_slices, self.plans),
                                   self.state_kinds.params)
        else:
            if scale is not None:
                grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, param_slices)
            params = jax.tree.map(zero.gather_slices, optax.apply_updates(param_slices, updates), self.plans)
        metrics.update(grad_norm=grad_norm, lr=optim.schedule(self.config.train)(state.step))
        return TrainState(state.step + 1, params, opt_state), metrics

    def _shard_map(self, f, in_specs, out_specs):
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    # -- jitted global functions
    def train_step_fn(self):
        """(state, tokens[B, T+1]) -> (state, metrics); the state is donated."""
        step = self._shard_map(self._local_step, (self.state_pspecs, self.batch_pspec),
                               (self.state_pspecs, P()))
        if self.state_kinds is None:
            return jax.jit(step, donate_argnums=0)
        return jax.jit(step, donate_argnums=0,
                       out_shardings=(self.state_shardings, NamedSharding(self.mesh, P())))

    @property
    def expert_devices(self) -> int:
        """ep, the devices the experts are split over (1 when they are not)."""
        return self.layout.size(expert.expert_axes(self.layout))

    def place_experts_fn(self):
        """(state, perm[Lm, E]) -> the state with every MoE layer's experts, router columns and
        their optimizer moments moved to the slots `perm` says (parallel/expert_placement.py); the
        state is donated."""
        specs = self.specs

        def place(state, perm):
            move = lambda leaf, spec: expert_placement.permute_leaf(leaf, spec, perm)
            params = jax.tree.map(move, state.params, specs)
            opt_state = optax.tree_map_params(self.optimizer, move, state.opt_state, specs,
                                              transform_non_params=lambda x: x, is_leaf=params_lib.is_spec)
            return TrainState(state.step, params, opt_state)

        return jax.jit(place, in_shardings=(self.state_shardings, None), out_shardings=self.state_shardings,
                       donate_argnums=0)

    def eval_loss_fn(self):
        def local(params, tokens):
            loss = self._local_loss(params, tokens)
            return jax.lax.psum(loss, self.layout.batch_axes) if self.layout.batch_axes else loss

        return jax.jit(self._shard_map(local, (self.param_pspecs, self.batch_pspec), P()))

    def loss_and_grads_fn(self, metrics: bool = False):
        """(params, tokens) -> (objective, reduced gradients before clipping[, step metrics]), for
        tests and analysis. The objective is the mean token cross-entropy plus the MoE losses."""
        if self.config.train.optimizer == "zo":
            raise ConfigError("config.train.optimizer='zo' computes no gradients (two forwards per step, "
                              "jaxsys/zo.py): use train_step_fn, or zo.projected_gradient for the estimate")
        out_pspecs = self.param_pspecs if self.config.train.zero_stage < 2 else self.grad_pspecs
        outputs = self._local_grads if metrics else (lambda p, t: self._local_grads(p, t)[:2])
        return jax.jit(self._shard_map(outputs, (self.param_pspecs, self.batch_pspec),
                                       (P(), out_pspecs, P())[:3 if metrics else 2]))


def build(config, mesh, unroll_layers: bool = False) -> Program:
    platform = mesh.devices.flat[0].platform
    if config.model.attention_impl == "cudnn" and platform != "gpu":
        raise ConfigError(f"config.model.attention_impl='cudnn' needs NVIDIA GPUs, but the mesh is on "
                          f"{platform}: use 'pallas' or 'reference'")
    if (config.mesh.pipe > 1 and config.mesh.seq > 1 and config.model.context_parallel != "allgather"
            and platform not in ("tpu", "gpu")):
        raise ConfigError(
            f"config.model.context_parallel={config.model.context_parallel!r} with config.mesh.pipe="
            f"{config.mesh.pipe} on {platform}: the ring's collective-permutes run inside the per-stage "
            "branches of the pipeline, where XLA:CPU pairs them wrongly (the loss came out wrong); use "
            "'allgather' with a pipeline here (TPU and GPU compile it: docs/pipeline.md)")
    if config.parallel.expert_dispatch == "ragged" and platform not in ("gpu", "tpu"):
        raise ConfigError(f"config.parallel.expert_dispatch='ragged' (lax.ragged_all_to_all) needs a GPU "
                          f"or TPU; XLA:{platform.upper()} does not implement it: use 'padded'")
    layout = Layout.from_config(config)
    t, p = config.train, config.mesh.pipe
    specs = transformer.param_specs(config.model, chunks=t.virtual_stages if p > 1 else 1)
    is_spec = params_lib.is_spec
    param_pspecs = jax.tree.map(lambda s: layout.param_spec(s.axes), specs, is_leaf=is_spec)
    plans = jax.tree.map(lambda s: zero.plan(layout, s.axes, s.shape, config.train.zero_stage),
                         specs, is_leaf=is_spec)
    grad_pspecs = jax.tree.map(lambda s: zero.grad_spec(layout, s, config.train.zero_stage), specs,
                               is_leaf=is_spec)
    abstract = params_lib.abstract_params(specs, jnp.dtype(config.model.param_dtype))
    if config.model.quant != "none":  # a quantized checkpoint's codes are not trained: no state
        optimizer, opt_pspecs = optax.identity(), optax.EmptyState()
    else:
        optimizer = optim.make_optimizer(config.train, specs, grad_pspecs, layout.mesh_sizes)
        opt_pspecs = optim.state_pspecs(config.train, specs, grad_pspecs, optimizer, layout.mesh_sizes)
    state_pspecs = TrainState(P(), param_pspecs, opt_pspecs)
    plan = offload.Plan.from_config(config)
    state_kinds = None
    if plan.any:
        offload.require_host_memory(mesh.devices.flat, "config.offload")
    if plan.optimizer or plan.params:
        # elements per device of one optimizer-state leaf of each parameter (as held for the update)
        state_sizes = jax.tree.map(
            lambda s, spec: math.prod(NamedSharding(mesh, spec).shard_shape(s.shape)), specs, grad_pspecs,
            is_leaf=is_spec)
        opt_kinds = offload.state_kinds(optimizer, abstract, state_sizes,
                                        plan.fraction if plan.optimizer else 0.0)
        param_kinds = jax.tree.map(lambda _: offload.HOST if plan.params else offload.DEVICE, param_pspecs,
                                   is_leaf=_is_p)
        state_kinds = TrainState(offload.DEVICE, param_kinds, opt_kinds)
    batch_pspec = layout.compute_spec(("batch", None))
    pipeline_train = pipeline_eval = None
    if p > 1:
        schedule = pipeline.make_schedule(t.pipeline_schedule, p, t.microbatches, t.virtual_stages)
        vp = bool(config.parallel.vocab_parallel)
        pipeline_train = pipeline.lockstep(schedule, backward=True, vocab_parallel=vp)
        pipeline_eval = pipeline.lockstep(schedule, backward=False, vocab_parallel=vp)
    return Program(config, mesh, layout, specs, param_pspecs, plans, grad_pspecs, optimizer,
                   state_pspecs, batch_pspec, unroll_layers, pipeline_train, pipeline_eval, plan, state_kinds)


# ----------------------------------------------------------------------------- the loop


class MetricsWriter:
    """metrics.jsonl plus TensorBoard events, written by process 0 only."""

    def __init__(self, workdir: str, enabled: bool):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb = None
        if enabled:
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(os.path.join(workdir, "tb"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.tb.add_scalar(key, value, record["step"])
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _array(x) -> np.ndarray:
    """A replicated (P()) output of the step, on the host."""
    return np.asarray(x.addressable_data(0))


def _scalar(x) -> float:
    return float(_array(x))


def _check_finite(value: float, step: int, config, what: str = "loss") -> None:
    if not math.isfinite(value):
        raise FloatingPointError(
            f"{what} is {value} at step {step}: training stopped. Lower config.train.lr "
            f"(now {config.train.lr}), keep config.train.grad_clip > 0, or use float32 "
            "(config.model.compute_dtype) to find the cause.")


def evaluate(program: Program, eval_fn, params, corpus) -> float:
    c = program.config
    losses = [eval_fn(params, data_lib.global_batch(corpus, program.batch_sharding, c.seed, i,
                                                     c.train.batch_size, c.data.seq_len, "eval"))
              for i in range(c.train.eval_batches)]
    return float(np.mean([_scalar(l) for l in losses]))


def main(config, workdir: str) -> list[dict]:
    """Train `config`, writing metrics.jsonl, TensorBoard events and config.json to `workdir`.
    Returns the logged records."""
    cpu_unless_accelerator()
    maybe_initialize_distributed(config.distributed)
    validate(config)
    if config.model.quant != "none":
        raise ConfigError(
            f"config.model.quant={config.model.quant!r} describes a quantized checkpoint, which is for "
            "inference: evaluate it with `python -m jaxsys.evaluate --workdir W`; to train with int8 "
            "matmuls use config.model.quant_train='int8' with quant='none'")
    corpus = data_lib.load_corpus(config.data)
    if corpus.vocab_needed > config.model.vocab_size:
        raise ConfigError(f"the corpus has token ids up to {corpus.vocab_needed - 1} but "
                          f"config.model.vocab_size={config.model.vocab_size}: raise the vocab size")
    mesh = make_mesh(config)
    lead = jax.process_index() == 0
    checkpointer = Checkpointer(workdir, config.checkpoint) if config.checkpoint.enabled else None
    resume_step = checkpointer.latest_step() if checkpointer else None
    exists = os.path.exists(os.path.join(workdir, "metrics.jsonl")) and resume_step is None
    if jax.process_count() > 1:  # process 0 decides for all, so that none is left waiting
        from jax.experimental import multihost_utils
        exists = bool(multihost_utils.broadcast_one_to_all(np.int32(exists)))
    if exists:
        raise FileExistsError(f"{workdir} already holds a run (metrics.jsonl) with no checkpoint to "
                              "resume from: pass a new --workdir or remove the old one; nothing was "
                              "overwritten")
    os.makedirs(workdir, exist_ok=True)
    if lead:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))

    program = build(config, mesh)
    t, m = config.train, config.model
    tokens_per_step = program.tokens_per_step
    flops_per_step = flops_lib.step_flops_per_token(config) * tokens_per_step
    peak = config.hardware.peak_flops or hardware.job_peak_flops(m.compute_dtype)

    if resume_step is not None:
        state = checkpointer.restore(program.abstract_state())
        if lead:
            print(f"jaxsys: resumed from step {resume_step} of {checkpoint_lib.directory(workdir)}", flush=True)
    elif config.checkpoint.init_from:  # a new run from another run's parameters (fine-tuning)
        params, from_step = checkpoint_lib.restore_params(config.checkpoint.init_from,
                                                          program.abstract_state().params)
        state = program.fresh_state(params)
        if lead:
            print(f"jaxsys: parameters from step {from_step} of {config.checkpoint.init_from} "
                  "(config.checkpoint.init_from); starting at step 0 with a fresh optimizer state", flush=True)
    else:
        state = program.init()
    start_step = int(resume_step or 0)
    batch = lambda step, split="train": data_lib.global_batch(
        corpus, program.batch_sharding, config.seed, step, t.batch_size, config.data.seq_len, split)
    start = time.perf_counter()
    step_fn = program.train_step_fn().lower(state, batch(0)).compile()
    eval_fn = program.eval_loss_fn() if corpus.has_eval else None
    n_params = params_lib.count(program.specs)
    if lead:
        from jaxsys.analysis import report
        axes = " ".join(f"{a}={s}" for a, s in program.layout.mesh_sizes.items() if s > 1) or "1 device"
        print(f"jaxsys: {n_params / 1e6:.2f}M params, mesh {axes}, {corpus.description}, "
              f"compiled in {time.perf_counter() - start:.1f}s", flush=True)
        print(report.startup_summary(program, step_fn), flush=True)

    writer = MetricsWriter(workdir, lead)
    n_moe = expert_placement.n_moe_layers(program.specs)
    routing = expert_placement.RoutingLog(n_moe, m.moe.experts, program.expert_devices) if n_moe else None
    rebalance_every, placement_notes = config.parallel.expert_rebalance_every, {}
    place_experts = program.place_experts_fn() if rebalance_every else None
    from tqdm import tqdm
    bar = tqdm(total=t.steps, initial=start_step, disable=not (lead and t.progress), dynamic_ncols=True)
    records, pending = [], None
    window_start, window_steps = time.perf_counter(), 0

    def eval_due(step: int) -> bool:
        return eval_fn is not None and (step == t.steps or bool(t.eval_every and step % t.eval_every == 0))

    def finish(step: int, metrics, eval_loss) -> None:
        """Read step `step`'s metrics (blocking), check them, log when due."""
        nonlocal window_start, window_steps
        loss = _scalar(metrics["loss"])
        _check_finite(loss, step, config)
        _check_finite(_scalar(metrics["grad_norm"]), step, config, "gradient norm")
        bar.update(1)
        window_steps += 1
        if routing is not None:
            load = _array(metrics["moe_load"])
            routing.add(load, _array(metrics["moe_pairs"]))
        if step % t.log_every == 0 or step == 1 or step == t.steps or eval_loss is not None:
            elapsed = time.perf_counter() - window_start
            tokens_per_s = window_steps * tokens_per_step / elapsed
            record = {"step": step, "loss": loss, "tokens_per_s": tokens_per_s,
                      "mfu": flops_per_step * window_steps / elapsed / peak if peak else 0.0,
                      "grad_norm": _scalar(metrics["grad_norm"]), "lr": _scalar(metrics["lr"])}
            if eval_loss is not None:
                record["eval_loss"] = eval_loss
            if routing is not None:
                record.update(moe_aux_loss=_scalar(metrics["moe_aux_loss"]),
                              moe_z_loss=_scalar(metrics["moe_z_loss"]),
                              **routing.record(load, _array(metrics["moe_dropped"])), **placement_notes)
                placement_notes.clear()
            records.append(record)
            writer.write(record)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
            window_start, window_steps = time.perf_counter(), 0

    try:
        for step in range(start_step, t.steps):
            state, metrics = step_fn(state, batch(step))
            if pending is not None:  # read the previous step while this one runs
                finish(*pending)
            eval_loss = None
            if eval_due(step + 1):  # after `finish`, so that this step's window holds its compute
                jax.block_until_ready(state)  # the step's own compute is training time
                paused = time.perf_counter()
                eval_loss = evaluate(program, eval_fn, state.params, corpus)
                window_start += time.perf_counter() - paused  # not training time
            pending = (step + 1, metrics, eval_loss)
            if rebalance_every and (step + 1) % rebalance_every == 0 and step + 1 < t.steps:
                finish(*pending)  # the window holds this step
                pending = None
                paused = time.perf_counter()
                perm, summary = routing.rebalance(config.parallel.expert_colocate)
                state = jax.block_until_ready(place_experts(state, perm))
                window_start += time.perf_counter() - paused  # not training time
                placement_notes.update(summary)
                if lead and not t.progress:
                    print(f"jaxsys: experts re-placed after step {step + 1}: {summary}", flush=True)
            if checkpointer and checkpointer.due(step + 1, final=step + 1 == t.steps):
                finish(*pending)  # a state is saved only once its step's numbers are checked
                pending = None
                jax.block_until_ready(state)
                paused = time.perf_counter()
                checkpointer.save(step + 1, state, config)
                window_start += time.perf_counter() - paused  # not training time
        if pending is not None:
            finish(*pending)
        if routing is not None and lead:
            routing.save(os.path.join(workdir, "moe_routing.npz"))
    finally:
        bar.close()
        writer.close()
        if checkpointer:
            checkpointer.close()
    return records


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Train a jaxsys config.")
    parser.add_argument("--config", required=True, help="configs/<name>.py[:arg]")
    parser.add_argument("--workdir", required=True, help="directory for metrics, events, config")
    args, overrides = parse_with_overrides(parser, argv, "--config.train.steps=10")
    return args, overrides


def cli(argv=None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config, overrides)
        main(config, args.workdir)
    except (ConfigError, data_lib.DataError, checkpoint_lib.CheckpointError, FileExistsError,
            FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # Run the imported module's cli, not this __main__ copy, so that classes such as TrainState
    # are the same objects everywhere (jaxsys.analysis imports jaxsys.train).
    from jaxsys import train as _train

    sys.exit(_train.cli())
