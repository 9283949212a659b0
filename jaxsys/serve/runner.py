"""The model's one cached forward on a mesh, compiled: what every serving path runs on the device.

    runner = ModelRunner(program)
    logits, cache = runner(params, tokens[R], positions[R], cache)

Row r is one token at its position; the cache (jaxsys/cache/) holds every row's sequence and says
how to attend (its page table, contiguous slots, quantized pages or a read window). Per shard it is
`transformer.forward` on one token per row, then the full-vocabulary logits [R, V] (fp32, gathered
over the vocabulary shards); the model's own layer code runs, so tensor parallelism, FSDP gathers
and quantized weights work as in training. One compiled program per (row count, cache type); the
cache is donated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxsys.cache.base import ROW, ROWS
from jaxsys.config import ConfigError, layer_pattern
from jaxsys.models import transformer
from jaxsys.parallel import tensor
from jaxsys.parallel.spmd import per_shard
from jaxsys.serve import sampling


def check_servable(config) -> None:
    """Serving runs on the data/fsdp and tensor axes with softmax attention; name what it does not
    support."""
    m = config.model
    if m.kind == "flax":
        raise ConfigError(
            "config.model.kind='flax': generation and serving need jaxsys's transformer and its KV "
            "cache (docs/flax.md); evaluate a Flax model with python -m jaxsys.evaluate"
        )
    if config.mesh.pipe > 1 or config.mesh.seq > 1:
        raise ConfigError(
            f"generation runs on the data/fsdp and tensor axes; config.mesh.pipe="
            f"{config.mesh.pipe} and config.mesh.seq={config.mesh.seq} must be 1 "
            "(override them: --config.mesh.pipe=1 --config.mesh.seq=1)"
        )
    if config.parallel.sequence_parallel:
        raise ConfigError(
            "generation decodes one token per sequence, which sequence parallelism cannot "
            "split: set --config.parallel.sequence_parallel=false"
        )
    if "linear" in layer_pattern(m):
        raise ConfigError(
            f"config.model.layer_pattern={m.layer_pattern!r}: KV-cache generation needs "
            "softmax attention layers (linear layers' recurrent state is not implemented)"
        )


class ModelRunner:
    def __init__(self, program):
        self.program = program
        self._fns: dict = {}

    def _local(self, params, tokens, positions, cache):
        p = self.program
        m, layout = p.config.model, p.layout
        logits, cache = transformer.forward(params, tokens[:, None], positions[:, None], m, layout, p.specs, cache)
        return tensor.gather_vocab(logits[:, 0].astype(jnp.float32), layout.compute_axes("vocab")), cache

    def _compile(self, cache):
        p = self.program
        row, rows = p.layout.compute_spec(ROW), p.layout.compute_spec(ROWS)
        specs = cache.pspecs(p.layout)
        fn = per_shard(self._local, p.mesh, (p.param_pspecs, row, row, specs), (rows, specs))
        return jax.jit(fn, donate_argnums=(3,))

    def __call__(self, params, tokens, positions, cache):
        """(logits [R, V] fp32, the cache after the rows' writes)."""
        key = jax.tree.structure(cache)
        if key not in self._fns:
            self._fns[key] = self._compile(cache)
        return self._fns[key](params, tokens, positions, cache)

    def compiled(self) -> int:
        """Programs compiled so far (every row bucket of every cache type, every decode loop)."""
        return sum(fn._cache_size() for fn in self._fns.values())

    # -- several decode steps in one call (multi-step decoding)
    def _local_loop(self, params, tokens, positions, cache, steps, seed, n, temperature, top_k, top_p, *, most, greedy):
        """`steps` (<= `most`, traced) decode steps of every row on the device: each feeds the token
        it samples (with the key of the sequence's n + i-th token, as one step at a time would) to
        the next."""

        def body(i, carry):
            tokens, cache, out = carry
            logits, cache = self._local(params, tokens, positions + i, cache)
            if greedy:
                nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            else:
                nxt = sampling.sample_rows(logits, seed, n + i, temperature, top_k, top_p)
            return nxt, cache, out.at[i].set(nxt)

        out = jnp.zeros((most, tokens.shape[0]), jnp.int32)
        _, cache, out = jax.lax.fori_loop(0, steps[0], body, (tokens, cache, out))
        return out, cache

    def decode_loop(self, params, tokens, positions, cache, steps, settings: tuple, most: int, greedy: bool):
        """Rows decoding `steps` (a device int32 [D], <= `most`) tokens in one compiled call: (the
        tokens [most, R], of which the first `steps` rows are this call's, the cache). `settings`:
        per row (seed, n, temperature, top_k, top_p); with `greedy` the argmax. Compiled once per
        (row count, cache type, most, greedy)."""
        key = ("loop", jax.tree.structure(cache), most, greedy)
        if key not in self._fns:
            p = self.program
            row = p.layout.compute_spec(ROW)
            specs = cache.pspecs(p.layout)
            local = functools.partial(self._local_loop, most=most, greedy=greedy)
            out_spec = p.layout.compute_spec((None, "batch"))
            fn = per_shard(local, p.mesh, (p.param_pspecs, row, row, specs, row) + (row,) * 5, (out_spec, specs))
            self._fns[key] = jax.jit(fn, donate_argnums=(3,))
        return self._fns[key](params, tokens, positions, cache, steps, *settings)
