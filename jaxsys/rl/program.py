"""The GRPO trainer: `program.Program` with GRPO's objective over a batch of `Rollouts`.

Only the objective changes: the per-shard gradients, their reduction (ZeRO, FSDP), clipping and the
optimizer update are the Program's own (`_local_grads`, `_local_step`), so every layout that trains
the language model trains the policy. The policy's token log-probabilities are the negated token
losses of `transformer.token_losses`, cut per shard as the targets are.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxsys import program as program_lib
from jaxsys.config import ConfigError
from jaxsys.models import transformer
from jaxsys.parallel import collectives
from jaxsys.rl import loss as loss_lib

METRICS = ("loss", "pg", "kl", "ratio", "clipped")


class Rollouts(NamedTuple):
    """A training batch of sampled completions; every array split over the batch axes alike."""

    tokens: jax.Array  # [B, T+1] int32: prompt, completion, padding (0)
    mask: jax.Array  # [B, T] float32: 1 where the target (tokens[:, 1:]) is a completion token
    advantages: jax.Array  # [B, T] float32: the sample's group-normalised advantage on each token
    old_logp: jax.Array  # [B, T] float32: log-probability of each target under the behaviour weights
    ref_logp: jax.Array  # [B, T] float32: ... under the frozen reference


class GRPOProgram(program_lib.Program):
    """A Program whose objective is GRPO's (jaxsys/rl/loss.py) on `Rollouts` batches."""

    @property
    def documents(self) -> bool:
        return False

    @property
    def batch_specs(self):
        p = self.batch_pspec
        return Rollouts(p, p, p, p, p)

    def abstract_batch(self):
        c = self.config
        b, t = c.train.batch_size, c.data.seq_len
        s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
        f = s((b, t), jnp.float32)
        return Rollouts(s((b, t + 1), jnp.int32), f, f, f, f)

    def weight_norm(self, batch):
        """The global batch's completion tokens (at least 1), on every shard."""
        total = collectives.sum_over_batch_shards(jnp.sum(self._local_weights(batch.mask)), self.layout.batch_axes)
        return jnp.maximum(total, 1.0)

    def _local_logp(self, params, tokens, hook=None):
        c = self.config
        losses, moe_stats = transformer.token_losses(
            params, tokens, c.model, self.layout, self.specs, self.unroll_layers, c.parallel.expert_dispatch, hook
        )
        return -losses, moe_stats

    def _local_objective(self, params, batch, hook=None, norm=None):
        rl = self.config.rl
        logp, moe_stats = self._local_logp(params, batch.tokens, hook)
        cut = lambda a: self._local_weights(a).astype(logp.dtype)
        terms = loss_lib.token_terms(
            logp, cut(batch.old_logp), cut(batch.ref_logp), cut(batch.advantages), rl.clip, rl.kl
        )
        norm = self.weight_norm(batch) if norm is None else norm
        mask = cut(batch.mask)
        shares = {name: jnp.sum(terms[name] * mask) / norm for name in METRICS}
        return shares["loss"] + program_lib._moe_term(moe_stats, self.tokens_per_step), (shares, moe_stats)

    def _metrics(self, shares, moe_stats, norm=None):
        metrics = collectives.sum_over_batch_shards(shares, self.layout.batch_axes)
        if norm is not None:
            metrics["loss_tokens"] = norm
        return metrics

    def logprobs_fn(self):
        """(params, tokens[B, T+1]) -> log-probabilities [B, T] of the targets tokens[:, 1:]: the
        reference's, and the policy's own for the warm-up (no context parallelism: T whole)."""

        def local(params, tokens):
            return self._local_logp(params, tokens)[0]

        return jax.jit(self._shard_map(local, (self.param_pspecs, self.batch_pspec), self.batch_pspec))


def build(config, mesh) -> GRPOProgram:
    """`program.build`'s Program with GRPO's objective; ConfigError for what it does not support."""
    if config.mesh.pipe > 1:
        raise ConfigError(
            f"config.mesh.pipe={config.mesh.pipe}: the GRPO trainer runs without a pipeline (the pipeline "
            "executor computes the cross-entropy objective only); use fsdp / data / tensor for the trainer"
        )
    if config.mesh.seq > 1:
        raise ConfigError(f"config.mesh.seq={config.mesh.seq}: the GRPO trainer runs without context parallelism")
    if config.train.optimizer == "zo":
        raise ConfigError("config.train.optimizer='zo' computes no gradients: GRPO needs adamw (or galore)")
    base = program_lib.build(config, mesh)
    return GRPOProgram(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})


__all__ = ["GRPOProgram", "Rollouts", "build"]
