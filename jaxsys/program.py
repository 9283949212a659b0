"""The program of a config on a mesh: where the training state lives and the step functions over it.

    program = build(config, mesh)
    state = program.init()
    step = program.train_step_fn()          # (state, batch) -> (state, metrics)

A batch is a [B, T+1] int32 array of a token stream, or a `data.Batch` (tokens, segments, loss
weights) of a corpus of documents (`Program.batch_specs`, `Program.abstract_batch`); the objective
of a weighted batch is the sum of its weighted token losses over the global weight sum.

`Placement` is what (config, mesh) fixes about the state: the parameter specs, their
PartitionSpecs and memory kinds, the ZeRO plans, the optimizer, and how to make or describe a
state. `Program` adds the per-shard step (objective, gradients, optimizer update) and the jitted
global functions built from it. The training loop (jaxsys/train.py) and the analysis
(jaxsys/analysis/) both start from `build`; nothing here imports either.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsys import data as data_lib
from jaxsys.config import ConfigError
from jaxsys.models import moe as moe_lib
from jaxsys.models import params as params_lib
from jaxsys.models import transformer
from jaxsys.optim import optimizer as optimizer_lib
from jaxsys.optim import outer as outer_lib
from jaxsys.optim import zo
from jaxsys.optim.schedules import schedule
from jaxsys.parallel import collectives, expert, expert_placement, offload, pipeline, zero
from jaxsys.parallel.spmd import per_shard
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
class Placement:
    """What (config, mesh) fixes about the training state: specs, PartitionSpecs, memory kinds,
    ZeRO plans and the optimizer; making a state, or its shapes and shardings without one."""

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
        return jax.tree.map(lambda s, k: NamedSharding(self.mesh, s, memory_kind=k), pspecs, kinds, is_leaf=_is_p)

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
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, self.state_shardings
        )

    def _init(self, key) -> TrainState:
        m = self.config.model
        if m.kind == "flax":  # the module's own initialisers (models/flax_model.py)
            from jaxsys.models import flax_model

            params = flax_model.init_params(m, key, jnp.dtype(m.param_dtype))
        else:
            params = params_lib.init_params(self.specs, key, jnp.dtype(m.param_dtype))
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
        """B T: the tokens of a global batch, what every per-token loss of a token stream's batch
        (and every MoE loss) is divided by; a weighted batch's are divided by its weight sum."""
        return self.config.train.batch_size * self.config.data.seq_len

    @property
    def documents(self) -> bool:
        """Batches are `data.Batch`es (tokens, segments, weights) of a corpus of documents."""
        return data_lib.is_documents(self.config.data)

    @property
    def batch_specs(self):
        """The batch's PartitionSpecs: one P for a token stream's [B, T+1] array, a `data.Batch` of
        them (every array split over the batch axes alike) for a corpus of documents."""
        p = self.batch_pspec
        return data_lib.Batch(p, p, p) if self.documents else p

    def abstract_batch(self):
        """Shapes, dtypes and shardings of a global batch (`batch_specs`), for lowering."""
        c = self.config
        b, t = c.train.batch_size, c.data.seq_len
        tokens = jax.ShapeDtypeStruct((b, t + 1), jnp.int32, sharding=self.batch_sharding)
        if not self.documents:
            return tokens
        return data_lib.Batch(tokens, tokens, jax.ShapeDtypeStruct((b, t), jnp.float32, sharding=self.batch_sharding))

    @property
    def expert_devices(self) -> int:
        """ep, the devices the experts are split over (1 when they are not)."""
        return self.layout.size(expert.expert_axes(self.layout))


class Program(Placement):
    """The step functions over a `Placement`'s state: per-shard objective, gradients and update
    (the `_local_*` methods, inside shard_map), and the jitted global functions built from them."""

    # -- per-shard functions
    def _local_weights(self, weights):
        """This device's [B, T'] of the loss weights [B, T]: the positions its targets are (under
        context parallelism, its T/P of them), cut as `transformer.split_tokens` cuts targets."""
        padded = jnp.pad(weights, ((0, 0), (1, 0)))  # [B, T+1], so that the targets' cut applies
        return transformer.split_tokens(padded, self.config.model, self.layout)[1]

    def weight_norm(self, batch):
        """The global batch's loss-weight sum (at least 1), on every shard; None for a token
        stream's batch (whose losses are divided by `tokens_per_step`)."""
        weights = data_lib.batch_parts(batch)[2]
        if weights is None:
            return None
        total = collectives.sum_over_batch_shards(jnp.sum(self._local_weights(weights)), self.layout.batch_axes)
        return jnp.maximum(total, 1.0)

    def _local_objective(self, params, batch, hook=None, norm=None):
        """This shard's share of the global mean objective (the shares sum to it over the shards):
        token cross-entropy plus the MoE losses. Aux: (its share of the cross-entropy, MoE stats).
        `hook` sees every weight as it is read (`execution.weights_as_used`; zeroth-order perturbations).
        A weighted batch (`data.Batch`): the weighted losses over `norm`, the global weight sum
        (`weight_norm` of the whole batch; computed here when not given); segments reach the model
        only with config.data.packing (one document a row needs no mask)."""
        c, per_token = self.config, self.tokens_per_step
        tokens, segments, weights = data_lib.batch_parts(batch)
        if c.model.kind == "flax":  # a Flax module (models/flax_model.py): the same objective
            from jaxsys.models import flax_model

            losses, moe_stats = flax_model.token_losses(params, tokens, c.model, self.layout, self.specs)
        else:
            documents = {"segments": segments} if c.data.packing and segments is not None else {}
            losses, moe_stats = transformer.token_losses(
                params,
                tokens,
                c.model,
                self.layout,
                self.specs,
                self.unroll_layers,
                c.parallel.expert_dispatch,
                hook,
                **documents,
            )
        if weights is None:
            ce = jnp.sum(losses) / per_token
        else:
            norm = self.weight_norm(batch) if norm is None else norm
            ce = jnp.sum(losses * self._local_weights(weights).astype(losses.dtype)) / norm
        return ce + _moe_term(moe_stats, per_token), (ce, moe_stats)

    def _local_loss(self, params, batch):
        """This shard's share of the global mean token cross-entropy (evaluation)."""
        if self.pipeline_eval is not None:
            return self._pipeline(params, batch, self.pipeline_eval)[2][0]
        return self._local_objective(params, batch)[1][0]

    def _metrics(self, ce, moe_stats, norm=None):
        """Step metrics from this shard's cross-entropy share and MoE stats: the loss terms summed
        over the batch axes (one all-reduce), the routing statistics (already global) as they are;
        for a weighted batch, `loss_tokens`, its global weight sum `norm`."""
        axes, per_token = self.layout.batch_axes, self.tokens_per_step
        terms = {"loss": ce}
        if moe_stats:
            terms.update(moe_aux_loss=moe_stats["aux_loss"] / per_token, moe_z_loss=moe_stats["z_loss"] / per_token)
        metrics = collectives.sum_over_batch_shards(terms, axes)
        if moe_stats:
            metrics.update({f"moe_{k}": moe_stats[k] for k in moe_lib.ROUTING_STATISTICS})
        if norm is not None:
            metrics["loss_tokens"] = norm
        return metrics

    def _pipeline(self, params, batch, program: pipeline.Program):
        """Through the pipeline executor, tokens split into micro-batches: (this shard's objective
        share, gradients (None without backward), (its cross-entropy share, MoE stats)). A weighted
        batch's loss weights, and under config.data.packing its segment ids and positions, travel
        with each micro-batch (`pipeline.run`'s extras), so every stage masks and the last one
        weights each token's loss."""
        c, m, layout, specs = self.config, self.config.model, self.layout, self.specs
        tokens, segments, weights = data_lib.batch_parts(batch)
        packed = c.data.packing and segments is not None
        if packed:
            inputs, targets, positions, segments = transformer.split_tokens(tokens, m, layout, segments)
        else:
            inputs, targets, positions = transformer.split_tokens(tokens, m, layout)
        # the ticks read a stage's weights many times: with config.offload.params they move in once
        params = offload.fetch(params, layout.params_on_host)
        split = lambda a: a.reshape(program.m, a.shape[0] // program.m, *a.shape[1:])
        norm = self.tokens_per_step
        extras = {}
        if weights is not None:
            extras["weights"] = split(self._local_weights(weights).astype(jnp.float32))
        if packed:
            extras.update(segments=split(segments), positions=split(positions))

        def stack(w, x, extra=None):
            y, moe_stats = transformer.layer_stack(
                w,
                x,
                extra["positions"] if packed else positions,
                m,
                layout,
                specs,
                self.unroll_layers,
                c.parallel.expert_dispatch,
                segments=extra["segments"] if packed else None,
            )
            return y, _moe_term(moe_stats, norm), moe_stats

        if weights is None:
            loss = lambda sh, h, t: jnp.sum(transformer.output_loss(sh, h, t, m, layout, specs)) / norm
        else:
            weight_norm = self.weight_norm(batch)
            loss = lambda sh, h, t, extra: (
                jnp.sum(transformer.output_loss(sh, h, t, m, layout, specs) * extra["weights"]) / weight_norm
            )

        fns = pipeline.StageFns(
            embed=lambda sh, ids: transformer.embed(sh, ids, m, layout, specs),
            stack=stack,
            norm=lambda sh, y: transformer.final_norm(sh, y, m, layout, specs),
            loss=loss,
        )
        ce, grads, moe_stats = pipeline.run(fns, params, split(inputs), split(targets), program, extras or None)
        return ce + _moe_term(moe_stats, norm), grads, (ce, moe_stats)

    def _local_grads(self, params, batch):
        """(objective, reduced gradients, metrics) of this shard's batch."""
        mb = self.config.train.microbatches
        norm = self.weight_norm(batch)  # of the whole batch, before it is cut into micro-batches
        objective = lambda p, b: self._local_objective(p, b, norm=norm)
        value_and_grad = jax.value_and_grad(objective, has_aux=True)
        if self.pipeline_train is not None:
            loss, grads, (ce, moe_stats) = self._pipeline(params, batch, self.pipeline_train)
        elif mb > 1:  # gradient accumulation over micro-batches (MoE balance per micro-batch)

            def accumulate(total, micro):
                return jax.tree.map(jnp.add, total, value_and_grad(params, micro)), None

            batches = jax.tree.map(lambda a: a.reshape(mb, a.shape[0] // mb, *a.shape[1:]), batch)
            first = jax.tree.map(lambda a: a[0], batches)
            zero_total = jax.tree.map(jnp.zeros_like, jax.eval_shape(value_and_grad, params, first))
            ((loss, (ce, moe_stats)), grads), _ = jax.lax.scan(accumulate, zero_total, batches)
        else:
            (loss, (ce, moe_stats)), grads = value_and_grad(params, batch)
        # weights read from host memory get their gradients there (the transpose of the move in)
        grads = offload.fetch(grads, self.layout.params_on_host)
        grads = jax.tree.map(zero.reduce_gradient, grads, self.plans)
        metrics = self._metrics(ce, moe_stats, norm)
        objective = metrics["loss"] + metrics.get("moe_aux_loss", 0.0) + metrics.get("moe_z_loss", 0.0)
        return objective, grads, metrics

    def _local_step(self, state: TrainState, batch):
        if self.config.train.optimizer == "zo":  # two forwards, no gradients (jaxsys/optim/zo.py)
            return zo.local_step(self, state, batch)
        if outer_lib.enabled(self.config.train):  # an island's inner step (DiLoCo: jaxsys/optim/outer.py)
            return outer_lib.local_step(self, state, batch)
        _, grads, metrics = self._local_grads(state.params, batch)
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
                self.optimizer,
                grads,
                state.opt_state,
                param_slices,
                self.state_kinds.opt_state,
                device,
                self.offload.host_update,
                leafwise=self.config.train.optimizer == "adamw" and not self.offload.params,
                grad_scale=scale,
                tpu_tiles=self.mesh.devices.flat[0].platform == "tpu",
            )
            params = offload.place(jax.tree.map(zero.gather_slices, param_slices, self.plans), self.state_kinds.params)
        else:
            if scale is not None:
                grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, param_slices)
            params = jax.tree.map(zero.gather_slices, optax.apply_updates(param_slices, updates), self.plans)
        metrics.update(grad_norm=grad_norm, lr=schedule(self.config.train)(state.step))
        return TrainState(state.step + 1, params, opt_state), metrics

    def _shard_map(self, f, in_specs, out_specs):
        return per_shard(f, self.mesh, in_specs, out_specs)

    # -- jitted global functions
    def train_step_fn(self):
        """(state, batch) -> (state, metrics); the state is donated. The batch: tokens[B, T+1], or a
        `data.Batch` of a corpus of documents (`batch_specs`)."""
        step = self._shard_map(self._local_step, (self.state_pspecs, self.batch_specs), (self.state_pspecs, P()))
        if self.state_kinds is None:
            return jax.jit(step, donate_argnums=0)
        return jax.jit(step, donate_argnums=0, out_shardings=(self.state_shardings, NamedSharding(self.mesh, P())))

    def place_experts_fn(self):
        """(state, perm[Lm, E]) -> the state with every MoE layer's experts, router columns and
        their optimizer moments moved to the slots `perm` says (parallel/expert_placement.py); the
        state is donated."""
        specs = self.specs

        def place(state, perm):
            move = lambda leaf, spec: expert_placement.permute_leaf(leaf, spec, perm)
            params = jax.tree.map(move, state.params, specs)
            opt_state = optax.tree_map_params(
                self.optimizer,
                move,
                state.opt_state,
                specs,
                transform_non_params=lambda x: x,
                is_leaf=params_lib.is_spec,
            )
            return TrainState(state.step, params, opt_state)

        return jax.jit(
            place, in_shardings=(self.state_shardings, None), out_shardings=self.state_shardings, donate_argnums=0
        )

    def eval_loss_fn(self):
        def local(params, batch):
            return collectives.sum_over_batch_shards(self._local_loss(params, batch), self.layout.batch_axes)

        return jax.jit(self._shard_map(local, (self.param_pspecs, self.batch_specs), P()))

    def loss_and_grads_fn(self, metrics: bool = False):
        """(params, tokens) -> (objective, reduced gradients before clipping[, step metrics]), for
        tests and analysis. The objective is the mean token cross-entropy plus the MoE losses."""
        if self.config.train.optimizer == "zo":
            raise ConfigError(
                "config.train.optimizer='zo' computes no gradients (two forwards per step, "
                "jaxsys/optim/zo.py): use train_step_fn, or zo.projected_gradient for the estimate"
            )
        out_pspecs = self.param_pspecs if self.config.train.zero_stage < 2 else self.grad_pspecs
        outputs = self._local_grads if metrics else (lambda p, t: self._local_grads(p, t)[:2])
        return jax.jit(
            self._shard_map(
                outputs, (self.param_pspecs, self.batch_specs), (P(), out_pspecs, P())[: 3 if metrics else 2]
            )
        )


@dataclasses.dataclass(frozen=True)
class Capability:
    """A feature of a config that only some XLA backends build. `build` refuses it elsewhere with
    `message`; `cpu_stand_in` replaces it by its nearest CPU-buildable form (`stand_in`: section,
    key, value), where it has one, so that the planner still gets a compiled memory figure."""

    name: str
    needs: Callable[[Any], bool]  # whether `config` uses the feature
    platforms: tuple[str, ...]  # the platforms whose compilers build it
    stand_in: tuple[str, str, Any] | None  # its nearest form XLA:CPU builds (None: no CPU form)
    message: Callable[[Any, str], str]  # (config, platform) -> the error naming the key and the fix

    def refused(self, config, platform: str) -> bool:
        return self.needs(config) and platform not in self.platforms


def _pipelined_ring(c) -> bool:
    return c.mesh.pipe > 1 and c.mesh.seq > 1 and c.model.context_parallel != "allgather"


# What XLA:CPU cannot run here but TPUs and GPUs compile (cudnn attention: GPUs only), in the order
# `build` checks them: the one list that `build` and `cpu_stand_in` both read.
CAPABILITIES = (
    Capability(
        "cudnn attention",
        lambda c: c.model.attention_impl == "cudnn",
        ("gpu",),
        None,
        lambda c, platform: (
            f"config.model.attention_impl='cudnn' needs NVIDIA GPUs, but the mesh is on "
            f"{platform}: use 'pallas' or 'reference'"
        ),
    ),
    Capability(
        "ring / tokenring context parallelism under a pipeline",
        _pipelined_ring,
        ("tpu", "gpu"),
        ("model", "context_parallel", "allgather"),  # keeps the gathered K/V: an upper bound
        lambda c, platform: (
            f"config.model.context_parallel={c.model.context_parallel!r} with config.mesh.pipe="
            f"{c.mesh.pipe} on {platform}: the ring's collective-permutes run inside the per-stage "
            "branches of the pipeline, where XLA:CPU pairs them wrongly (the loss came out wrong); use "
            "'allgather' with a pipeline here (TPU and GPU compile it: docs/pipeline.md)"
        ),
    ),
    Capability(
        "collective matmul under a pipeline",
        lambda c: c.mesh.pipe > 1 and bool(c.parallel.get("collective_matmul", False)),
        ("tpu", "gpu"),
        ("parallel", "collective_matmul", False),  # the plain SP collectives: the same residuals
        lambda c, platform: (
            f"config.parallel.collective_matmul=True with config.mesh.pipe={c.mesh.pipe} on {platform}: "
            "its collective-permutes run inside the per-stage branches of the pipeline, where XLA:CPU waits "
            "for every device of the mesh and deadlocks; set collective_matmul=False here (TPU and GPU "
            "compile it: docs/comm_overlap.md)"
        ),
    ),
    Capability(
        "ragged expert dispatch",
        lambda c: c.parallel.expert_dispatch == "ragged",
        ("gpu", "tpu"),
        ("parallel", "expert_dispatch", "padded"),  # an upper bound
        lambda c, platform: (
            f"config.parallel.expert_dispatch='ragged' (lax.ragged_all_to_all) needs a GPU "
            f"or TPU; XLA:{platform.upper()} does not implement it: use 'padded'"
        ),
    ),
)


def cpu_stand_in(config):
    """(config, changes): `config` with what `build` refuses on XLA:CPU but TPUs and GPUs compile
    (`CAPABILITIES`) replaced by its nearest CPU-buildable form, for a compiled memory figure on
    fake CPU devices (`jaxsys.plan`): collective matmul under a pipeline -> the plain SP collectives
    (the same residuals), ring / tokenring context parallelism under a pipeline -> allgather (keeps
    the gathered K/V: an upper bound), ragged expert dispatch -> padded (an upper bound). `changes`
    names them; empty when the config builds as it is (or uses a feature with no CPU form, which
    `build` then refuses)."""
    import copy

    changes = [cap.stand_in for cap in CAPABILITIES if cap.stand_in and cap.refused(config, "cpu")]
    if not changes:
        return config, []
    stand_in = copy.deepcopy(config)
    for section, key, value in changes:
        stand_in[section][key] = value
    return stand_in, [f"{section}.{key}={value}" for section, key, value in changes]


def build(config, mesh, unroll_layers: bool = False) -> Program:
    platform = mesh.devices.flat[0].platform
    for cap in CAPABILITIES:  # what this platform's compiler cannot build
        if cap.refused(config, platform):
            raise ConfigError(cap.message(config, platform))
    layout = Layout.from_config(config)
    t, p = config.train, config.mesh.pipe
    if config.model.kind == "flax":  # names and shapes of a Flax module's nnx.Params, checked here
        from jaxsys.models import flax_model

        specs = flax_model.validate_model(config)
    else:
        specs = transformer.param_specs(config.model, chunks=t.virtual_stages if p > 1 else 1)
    is_spec = params_lib.is_spec
    param_pspecs = jax.tree.map(lambda s: layout.param_spec(s.axes), specs, is_leaf=is_spec)
    plans = jax.tree.map(lambda s: zero.plan(layout, s.axes, s.shape, config.train.zero_stage), specs, is_leaf=is_spec)
    grad_pspecs = jax.tree.map(lambda s: zero.grad_spec(layout, s, config.train.zero_stage), specs, is_leaf=is_spec)
    abstract = params_lib.abstract_params(specs, jnp.dtype(config.model.param_dtype))
    if config.model.quant != "none":  # a quantized checkpoint's codes are not trained: no state
        optimizer, opt_pspecs = optax.identity(), optax.EmptyState()
    else:
        optimizer = optimizer_lib.make_optimizer(config.train, specs, grad_pspecs, layout.mesh_sizes)
        opt_pspecs = optimizer_lib.state_pspecs(config.train, specs, grad_pspecs, optimizer, layout.mesh_sizes)
    if outer_lib.enabled(t):  # islands on `data`: no reduction over it; their states stacked over it
        outer_lib.check(config, layout.mesh_sizes)
        plans = outer_lib.island_plans(plans)
        optimizer = outer_lib.make(optimizer, t, layout.mesh_sizes["data"])
        opt_pspecs = outer_lib.state_pspecs(opt_pspecs, param_pspecs, t)
    state_pspecs = TrainState(P(), param_pspecs, opt_pspecs)
    plan = offload.Plan.from_config(config)
    state_kinds = None
    if plan.any:
        offload.require_host_memory(mesh.devices.flat, "config.offload")
    if plan.optimizer or plan.params:
        # elements per device of one optimizer-state leaf of each parameter (as held for the update)
        state_sizes = jax.tree.map(
            lambda s, spec: math.prod(NamedSharding(mesh, spec).shard_shape(s.shape)),
            specs,
            grad_pspecs,
            is_leaf=is_spec,
        )
        opt_kinds = offload.state_kinds(optimizer, abstract, state_sizes, plan.fraction if plan.optimizer else 0.0)
        param_kinds = jax.tree.map(
            lambda _: offload.HOST if plan.params else offload.DEVICE, param_pspecs, is_leaf=_is_p
        )
        state_kinds = TrainState(offload.DEVICE, param_kinds, opt_kinds)
    batch_pspec = layout.compute_spec(("batch", None))
    pipeline_train = pipeline_eval = None
    if p > 1:
        schedule = pipeline.make_schedule(t.pipeline_schedule, p, t.microbatches, t.virtual_stages)
        vp = bool(config.parallel.vocab_parallel)
        overlap = config.parallel.pipeline_overlap
        pipeline_train = pipeline.lockstep(schedule, backward=True, vocab_parallel=vp, overlap=overlap)
        pipeline_eval = pipeline.lockstep(schedule, backward=False, vocab_parallel=vp, overlap=overlap)
    return Program(
        config,
        mesh,
        layout,
        specs,
        param_pspecs,
        plans,
        grad_pspecs,
        optimizer,
        state_pspecs,
        batch_pspec,
        unroll_layers,
        pipeline_train,
        pipeline_eval,
        plan,
        state_kinds,
    )
