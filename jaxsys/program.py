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
import zlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsys import data as data_lib
from jaxsys.config import ConfigError
from jaxsys.models import adapters, lora, mtp, transformer
from jaxsys.models import moe as moe_lib
from jaxsys.models import params as params_lib
from jaxsys.objectives import dpo
from jaxsys.optim import optimizer as optimizer_lib
from jaxsys.optim import outer as outer_lib
from jaxsys.optim import zo
from jaxsys.optim.schedules import schedule
from jaxsys.parallel import collectives, expert, expert_placement, offload, pipeline, zero
from jaxsys.parallel.spmd import per_shard
from jaxsys.sharding import Layout


def _moe_term(moe_stats, norm: int):
    """What the MoE layers add to the objective: their load-balancing and z-loss sums, per token."""
    if "aux_loss" not in moe_stats:
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
    specs: Any  # ParamSpec pytree (LoRA nodes on the adapted projections: models/lora.py)
    param_pspecs: Any
    plans: Any  # zero.LeafPlan per trainable leaf
    grad_pspecs: Any  # gradients of the trainable leaves as the update sees them (sliced over `data` at ZeRO >= 1)
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

    # -- the trainable part of the parameters: all of them, or with LoRA the adapters alone
    @property
    def lora(self) -> bool:
        return adapters.enabled(self.config)

    @property
    def trainable_specs(self):
        """The ParamSpecs of what is trained: every parameter, or the adapters (`adapters.trainable`)."""
        return adapters.trainable(self.specs) if self.lora else self.specs

    def trainable_of(self, tree):
        """The trainable part of a parameter-shaped tree (parameters, their PartitionSpecs, ...)."""
        return adapters.trainable(tree) if self.lora else tree

    def with_trainable(self, params, trainable):
        """`params` with their trainable part replaced."""
        return adapters.with_trainable(params, trainable) if self.lora else trainable

    @property
    def trainable_pspecs(self):
        return self.trainable_of(self.param_pspecs)

    @property
    def needs_reference(self) -> bool:
        """DPO without adapters: the steps take the reference model's parameters as an argument
        (with LoRA the reference is the base itself, the adapters left out)."""
        return self.config.train.objective == "dpo" and not self.lora

    def _init(self, key) -> TrainState:
        m = self.config.model
        dtype = jnp.dtype(m.param_dtype)
        if m.kind == "flax":  # the module's own initialisers (models/flax_model.py)
            from jaxsys.models import flax_model

            params = flax_model.init_params(m, key, dtype)
        elif self.lora:  # the base as without adapters (the same seed, the same base), then A and B
            base = params_lib.init_params(adapters.strip(self.specs), key, dtype)
            new = params_lib.init_params(adapters.trainable(self.specs), jax.random.fold_in(key, 1), dtype)
            params = adapters.attach(base, new, self.specs)
        else:
            params = params_lib.init_params(self.specs, key, dtype)
        return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(self.trainable_of(params)))

    def fresh_state(self, params) -> TrainState:
        """Step 0 and a fresh optimizer state around `params` (config.checkpoint.init_from)."""
        start = lambda p: TrainState(jnp.zeros((), jnp.int32), p, self.optimizer.init(self.trainable_of(p)))
        return jax.jit(start, out_shardings=self.state_shardings, donate_argnums=0)(params)

    def with_fresh_adapters(self, base, seed: int | None = None):
        """LoRA parameters from the base model's (`adapters.strip` of this program's tree, e.g. read
        from config.checkpoint.init_from) and adapters initialised as `init` initialises them
        (A from the seed, B zero): the adapted model starts as the base model."""
        seed = self.config.seed if seed is None else seed
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0), 1)
        dtype = jnp.dtype(self.config.model.param_dtype)
        shardings = self.trainable_of(self.param_shardings)
        new = jax.jit(lambda k: params_lib.init_params(self.trainable_specs, k, dtype), out_shardings=shardings)(key)
        return adapters.attach(base, new, self.specs)

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

    def _local_objective(self, params, batch, hook=None, norm=None, multi_token: bool = True):
        """This shard's share of the global mean objective (the shares sum to it over the shards):
        token cross-entropy plus the MoE losses. Aux: (its share of the cross-entropy, MoE stats).
        `hook` sees every weight as it is read (`execution.weights_as_used`; zeroth-order perturbations).
        A weighted batch (`data.Batch`): the weighted losses over `norm`, the global weight sum
        (`weight_norm` of the whole batch; computed here when not given); segments reach the model
        only with config.data.packing (one document a row needs no mask). `multi_token`: the MTP
        modules' loss joins when the model has them (config.model.mtp; evaluation skips them)."""
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
                multi_token=multi_token and mtp.enabled(c.model),
            )
        if weights is None:
            ce = jnp.sum(losses) / per_token
        else:
            norm = self.weight_norm(batch) if norm is None else norm
            ce = jnp.sum(losses * self._local_weights(weights).astype(losses.dtype)) / norm
        objective = ce + _moe_term(moe_stats, per_token)
        if "mtp" in moe_stats:  # DeepSeek-V3's modules: lambda times their mean loss (models/mtp.py)
            moe_stats = dict(moe_stats)
            moe_stats["mtp_loss"] = self._mtp_share(
                moe_stats.pop("mtp"), weights, per_token if weights is None else norm
            )
            objective = objective + c.model.mtp.loss_weight * moe_stats["mtp_loss"]
        return objective, (ce, moe_stats)

    def _mtp_share(self, mtp_losses, weights, norm):
        """This shard's share of (1 / D_m) sum_k L_k over the global batch: depth k's per-token
        losses weighted by the chained main weights (mtp.chain_weights) and divided by the main
        loss's normalizer `norm` (its token count or weight sum, of the whole step: micro-batch
        shares add up). A row's last k positions have no depth-k target and count as zeros, a
        k / T bias of the mean (0.05% at T = 2048, k = 1)."""
        shape = mtp_losses.shape[1:]
        w = jnp.ones(shape, jnp.float32) if weights is None else self._local_weights(weights).astype(jnp.float32)
        share = sum(
            jnp.sum(mtp_losses[k].astype(jnp.float32) * mtp.chain_weights(w, k + 1)) for k in range(mtp_losses.shape[0])
        )
        return share / (mtp_losses.shape[0] * norm)

    def _dropout_hook(self, key):
        """The weight hook (`execution.weights_as_used`) that gives each LoRA node with dropout its
        key while its layer runs: `key` folded with the projection's name, the layer and this
        device's place among the batch shards (so that shards drop different units). None without
        dropout or key (evaluation)."""
        if key is None or not self.lora or float(self.config.lora.dropout) == 0.0:
            return None
        key = jax.random.fold_in(key, collectives.axis_index(self.layout.batch_axes))

        def hook(name, w, index):
            if not lora.is_lora(w):
                return w
            k = jax.random.fold_in(jax.random.fold_in(key, zlib.crc32(name.encode()) % (1 << 31)), index)
            return dataclasses.replace(w, key=k)

        return hook

    def _local_dpo(self, params, batch, reference=None, hook=None):
        """This shard's share of the DPO loss (objectives/dpo.py) over the global batch's B/2 pairs,
        plus the MoE losses of the policy's forward. Aux: (that share, MoE stats, the shares of the
        logged terms, `dpo_*`). The reference's per-token losses come from the base (the adapters
        left out) with LoRA, else from `reference`, the frozen starting model's parameters; they
        take no gradient. Rows 2i and 2i + 1 of every shard are a pair (config checks the batch)."""
        c, layout = self.config, self.layout
        tokens, _, weights = data_lib.batch_parts(batch)
        w = self._local_weights(weights)
        run = lambda p, specs, h: transformer.token_losses(
            p, tokens, c.model, layout, specs, self.unroll_layers, c.parallel.expert_dispatch, h
        )
        losses, moe_stats = run(params, self.specs, hook)
        if self.lora:
            ref_losses, _ = run(adapters.strip(params), adapters.strip(self.specs), None)
        else:
            ref_losses, _ = run(reference, self.specs, None)
        ref_losses = jax.lax.stop_gradient(ref_losses)
        terms = dpo.pair_terms(dpo.sequence_logps(losses, w), dpo.sequence_logps(ref_losses, w), c.train.dpo.beta)
        pairs = c.train.batch_size // 2
        share = jnp.sum(terms["loss"]) / pairs
        logged = {f"dpo_{k}": jnp.sum(terms[k]) / pairs for k in dpo.TERMS}
        return share + _moe_term(moe_stats, self.tokens_per_step), (share, moe_stats, logged)

    def _local_loss(self, params, batch, reference=None):
        """This shard's share of the global mean token cross-entropy (evaluation); of the DPO loss
        for config.train.objective='dpo'."""
        return self._local_eval(params, batch, reference)["loss"]

    def _local_eval(self, params, batch, reference=None):
        """This shard's shares of the evaluation's terms: {"loss"} (the cross-entropy, or the DPO
        loss with its `dpo_*` terms)."""
        if self.config.train.objective == "dpo":
            _, (share, _, logged) = self._local_dpo(params, batch, reference)
            return {"loss": share, **logged}
        if self.pipeline_eval is not None:
            return {"loss": self._pipeline(params, batch, self.pipeline_eval)[2][0]}
        # the cross-entropy alone: the MTP modules (config.model.mtp) are not run for evaluation
        return {"loss": self._local_objective(params, batch, multi_token=False)[1][0]}

    def _metrics(self, ce, moe_stats, norm=None, extra=None):
        """Step metrics from this shard's cross-entropy share and MoE stats: the loss terms summed
        over the batch axes (one all-reduce), the routing statistics (already global) as they are;
        for a weighted batch, `loss_tokens`, its global weight sum `norm`; `extra`: more shares of
        global means (DPO's terms), summed alike."""
        axes, per_token = self.layout.batch_axes, self.tokens_per_step
        terms = {"loss": ce, **(extra or {})}
        if "aux_loss" in moe_stats:
            terms.update(moe_aux_loss=moe_stats["aux_loss"] / per_token, moe_z_loss=moe_stats["z_loss"] / per_token)
        if "mtp_loss" in moe_stats:
            terms["mtp_loss"] = moe_stats["mtp_loss"]
        metrics = collectives.sum_over_batch_shards(terms, axes)
        if "load" in moe_stats:
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

    def _local_grads(self, params, batch, key=None, reference=None):
        """(objective, reduced gradients, metrics) of this shard's batch. Only the trainable part
        of `params` is differentiated (`trainable_of`: with LoRA the adapters; the frozen base gets
        no gradient and no reduction). `key`: the step's PRNG key (LoRA dropout); `reference`: the
        reference model's parameters (DPO without adapters)."""
        mb = self.config.train.microbatches
        norm = self.weight_norm(batch)  # of the whole batch, before it is cut into micro-batches
        dpo_objective = self.config.train.objective == "dpo"

        def objective(trainable, b, micro=0):
            p = self.with_trainable(params, trainable)
            hook = self._dropout_hook(None if key is None else jax.random.fold_in(key, micro))
            if dpo_objective:
                return self._local_dpo(p, b, reference, hook)
            loss, (ce, moe_stats) = self._local_objective(p, b, hook, norm=norm)
            return loss, (ce, moe_stats, {})

        value_and_grad = jax.value_and_grad(objective, has_aux=True)
        trainable = self.trainable_of(params)
        if self.pipeline_train is not None:
            loss, grads, (ce, moe_stats) = self._pipeline(params, batch, self.pipeline_train)
            extra = {}
        elif mb > 1:  # gradient accumulation over micro-batches (MoE balance per micro-batch)

            def accumulate(total, xs):
                micro, i = xs
                return jax.tree.map(jnp.add, total, value_and_grad(trainable, micro, i)), None

            batches = jax.tree.map(lambda a: a.reshape(mb, a.shape[0] // mb, *a.shape[1:]), batch)
            first = jax.tree.map(lambda a: a[0], batches)
            zero_total = jax.tree.map(jnp.zeros_like, jax.eval_shape(value_and_grad, trainable, first))
            ((loss, (ce, moe_stats, extra)), grads), _ = jax.lax.scan(accumulate, zero_total, (batches, jnp.arange(mb)))
        else:
            (loss, (ce, moe_stats, extra)), grads = value_and_grad(trainable, batch)
        # weights read from host memory get their gradients there (the transpose of the move in)
        grads = offload.fetch(grads, self.layout.params_on_host)
        grads = jax.tree.map(zero.reduce_gradient, grads, self.plans)
        # DPO's logged terms ride along only when there are some (a subclass's _metrics, e.g. GRPO's, takes three)
        metrics = self._metrics(ce, moe_stats, norm, extra) if extra else self._metrics(ce, moe_stats, norm)
        objective = metrics["loss"] + metrics.get("moe_aux_loss", 0.0) + metrics.get("moe_z_loss", 0.0)
        objective = objective + self.config.model.mtp.loss_weight * metrics.get("mtp_loss", 0.0)
        return objective, grads, metrics

    def _local_step(self, state: TrainState, batch, reference=None):
        if self.config.train.optimizer == "zo":  # two forwards, no gradients (jaxsys/optim/zo.py)
            return zo.local_step(self, state, batch)
        if outer_lib.enabled(self.config.train):  # an island's inner step (DiLoCo: jaxsys/optim/outer.py)
            return outer_lib.local_step(self, state, batch)
        key = jax.random.fold_in(jax.random.key(self.config.seed), state.step) if self.lora else None
        _, grads, metrics = self._local_grads(state.params, batch, key, reference)
        if self.config.train.zero_stage == 1:  # all-reduced: keep this rank's slice
            grads = jax.tree.map(zero.take_slice, grads, self.plans)
        grad_norm = zero.global_norm(grads, self.grad_pspecs, self.layout)
        clip = self.config.train.grad_clip
        scale = jnp.minimum(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else None
        param_slices = jax.tree.map(zero.take_slice, self.trainable_of(state.params), self.plans)
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
            trained = jax.tree.map(zero.gather_slices, optax.apply_updates(param_slices, updates), self.plans)
            params = self.with_trainable(state.params, trained)  # the frozen part passes through
        rate = self.config.model.moe.bias_update_rate
        if rate and "moe_load" in metrics:  # auxiliary-loss-free balancing: no gradient moves the bias
            moe_params = dict(params["layers"]["moe"])
            moe_params["router_bias"] = moe_lib.update_bias(moe_params["router_bias"], metrics["moe_load"], rate)
            params = {**params, "layers": {**params["layers"], "moe": moe_params}}
        metrics.update(grad_norm=grad_norm, lr=schedule(self.config.train)(state.step))
        return TrainState(state.step + 1, params, opt_state), metrics

    def _shard_map(self, f, in_specs, out_specs):
        return per_shard(f, self.mesh, in_specs, out_specs)

    # -- jitted global functions
    def _with_reference(self, specs: tuple) -> tuple:
        """In-specs of a step function, with the reference parameters' when `needs_reference`."""
        return specs + ((self.param_pspecs,) if self.needs_reference else ())

    def abstract_args(self) -> tuple:
        """Abstract (state, batch[, reference parameters]) of the train step, for lowering."""
        state = self.abstract_state()
        return (state, self.abstract_batch()) + ((state.params,) if self.needs_reference else ())

    def train_step_fn(self):
        """(state, batch) -> (state, metrics); the state is donated. The batch: tokens[B, T+1], or a
        `data.Batch` of a corpus of documents (`batch_specs`). DPO without adapters
        (`needs_reference`): (state, batch, reference parameters) -> (state, metrics)."""
        in_specs = self._with_reference((self.state_pspecs, self.batch_specs))
        step = self._shard_map(self._local_step, in_specs, (self.state_pspecs, P()))
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
        """(params, batch[, reference parameters: `needs_reference`]) -> the batch's mean loss."""

        def local(params, batch, reference=None):
            return collectives.sum_over_batch_shards(self._local_loss(params, batch, reference), self.layout.batch_axes)

        return jax.jit(self._shard_map(local, self._with_reference((self.param_pspecs, self.batch_specs)), P()))

    def eval_metrics_fn(self):
        """(params, batch[, reference]) -> {"loss", and for DPO its `dpo_*` terms}: the batch's means."""

        def local(params, batch, reference=None):
            return collectives.sum_over_batch_shards(self._local_eval(params, batch, reference), self.layout.batch_axes)

        return jax.jit(self._shard_map(local, self._with_reference((self.param_pspecs, self.batch_specs)), P()))

    def loss_and_grads_fn(self, metrics: bool = False):
        """(params, tokens) -> (objective, reduced gradients before clipping[, step metrics]), for
        tests and analysis. The objective is the mean token cross-entropy plus the MoE losses."""
        if self.config.train.optimizer == "zo":
            raise ConfigError(
                "config.train.optimizer='zo' computes no gradients (two forwards per step, "
                "jaxsys/optim/zo.py): use train_step_fn, or zo.projected_gradient for the estimate"
            )
        out_pspecs = self.trainable_pspecs if self.config.train.zero_stage < 2 else self.grad_pspecs
        outputs = lambda p, t, *ref: self._local_grads(p, t, None, *ref)[: 3 if metrics else 2]
        in_specs = self._with_reference((self.param_pspecs, self.batch_specs))
        return jax.jit(self._shard_map(outputs, in_specs, (P(), out_pspecs, P())[: 3 if metrics else 2]))


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
        specs = adapters.wrap_specs(specs, config)  # LoRA nodes on the adapted projections (config.lora)
    is_spec = params_lib.is_spec
    param_pspecs = jax.tree.map(lambda s: layout.param_spec(s.axes), specs, is_leaf=is_spec)
    # the update, its gradients and the optimizer state cover the trainable leaves: with LoRA, the adapters
    trained = adapters.trainable(specs) if adapters.enabled(config) else specs
    stage = config.train.zero_stage
    plans = jax.tree.map(lambda s: zero.plan(layout, s.axes, s.shape, stage, s.partial), trained, is_leaf=is_spec)
    grad_pspecs = jax.tree.map(lambda s: zero.grad_spec(layout, s, stage), trained, is_leaf=is_spec)
    abstract = params_lib.abstract_params(specs, jnp.dtype(config.model.param_dtype))
    if config.model.quant != "none" and not adapters.enabled(config):  # a quantized checkpoint's codes
        optimizer, opt_pspecs = optax.identity(), optax.EmptyState()  # are not trained: no state
    else:
        optimizer = optimizer_lib.make_optimizer(config.train, trained, grad_pspecs, layout.mesh_sizes)
        opt_pspecs = optimizer_lib.state_pspecs(config.train, trained, grad_pspecs, optimizer, layout.mesh_sizes)
    if outer_lib.enabled(t):  # islands on `data`: no reduction over it; their states stacked over it
        outer_lib.check(config, layout.mesh_sizes)  # (LoRA and DPO are refused with islands: config)
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
