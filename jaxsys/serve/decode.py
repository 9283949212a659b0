"""Generation from any jaxsys checkpoint with a contiguous KV cache, on the training mesh's
`data` and `tensor` axes.

The cache is per layer [L, B, S, K, H] for keys and for values, sequence b's slot s holding
position s: B split over the batch axes (data, fsdp, expert), the K kv heads over `tensor` like
the weights that make them. Two compiled functions, one shard_map each, run the model's own layer
code (`transformer.layer_stack(..., kv=...)`, so tensor parallelism, FSDP gathers and quantized
weights work as in training):

    prefill(params, tokens[B, Tb], lengths[B], cache) -> (logits[B, V] at each prompt's last token, cache)
    decode(params, tokens[B], positions[B], cache)    -> (logits[B, V] of the next token, cache)

Prompts are right-padded to a bucket Tb (a power of two >= 16), so prefill compiles once per
bucket and decode once per (B, S). Padding positions write garbage into slots >= a prompt's
length; every later decode step writes its own slot before it attends, and attention masks slots
past the query's position, so the garbage is never read.

Sampling (outside the shard_map, on the gathered [B, V] logits): temperature 0 is greedy; top-k and
top-p (nucleus) filter before a categorical draw; one PRNG key per step from `seed`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxsys.config import ConfigError, layer_pattern
from jaxsys.models import transformer

if TYPE_CHECKING:  # the program is built by jaxsys.program, which the serving code does not import
    from jaxsys.program import Program

MIN_BUCKET = 16


def check_servable(config) -> None:
    """Generation runs on the data and tensor axes; name what it does not support."""
    m = config.model
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


def bucket(length: int, max_len: int) -> int:
    """The padded prompt length prefill compiles for: the next power of two >= 16, at most max_len."""
    return min(max(MIN_BUCKET, 1 << max(length - 1, 1).bit_length()), max_len)


def sample(logits, key, temperature, top_k, top_p):
    """Next tokens [B] from logits [B, V] (fp32): greedy where temperature == 0; else softmax of
    logits / temperature restricted to the top_k (0: all) most likely tokens and to the smallest
    set whose probability reaches top_p (1: all), drawn with `key`."""
    greedy = jnp.argmax(logits.astype(jnp.float32), axis=-1)
    drawn = jax.random.categorical(key, filtered_logits(logits, temperature, top_k, top_p), axis=-1)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def filtered_logits(logits, temperature, top_k, top_p):
    """The logits `sample` draws from when temperature > 0 (scaled, -inf outside the top-k and
    top-p sets); their softmax is the sampling distribution (serve/spec_engine.py's p and q)."""
    logits = logits.astype(jnp.float32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]  # one sort: the filters below keep its order
    vocab = logits.shape[-1]
    kth = ordered[:, jnp.clip(top_k - 1, 0, vocab - 1)][:, None]
    drop_k = (top_k > 0) & (ordered < kth)
    ordered = jnp.where(drop_k, -jnp.inf, ordered)
    scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
    keep = before < top_p  # the first token is always kept
    cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled < cutoff, -jnp.inf, scaled)


@dataclasses.dataclass
class Decoder:
    """The compiled prefill and decode of `program`'s model for `batch` sequences of up to
    `max_len` tokens (prompt and continuation)."""

    program: Program
    batch: int
    max_len: int

    def __post_init__(self):
        check_servable(self.program.config)
        layout = self.program.layout
        shards = layout.size(layout.compute_axes("batch"))
        if self.batch % shards:
            raise ConfigError(
                f"a generation batch of {self.batch} does not split over the {shards} batch "
                "shards of the mesh: pad it (Decoder.padded_batch) or shrink config.mesh.data"
            )
        m = self.program.config.model
        self.cache_pspec = layout.compute_spec(("layers", "batch", None, "kv_heads", None))
        self.rows_pspec = layout.compute_spec(("batch", None))
        self.batch_pspec = layout.compute_spec(("batch",))
        self.cache_shape = (m.n_layers, self.batch, self.max_len, m.n_kv_heads, m.head_dim)
        self.cache_dtype = jnp.dtype(m.compute_dtype)
        self._prefill = self._compile(prefill=True)
        self._decode = self._compile(prefill=False)
        self._extend = None  # compiled on first use (speculative decoding)

    @staticmethod
    def padded_batch(n: int, layout) -> int:
        shards = layout.size(layout.compute_axes("batch"))
        return -(-n // shards) * shards

    # -- per shard
    def _forward(self, params, tokens, positions, kv):
        m, layout, specs = self.program.config.model, self.program.layout, self.program.specs
        x = transformer.embed(params, tokens, m, layout, specs)
        x, _, kv = transformer.layer_stack(params["layers"], x, positions, m, layout, specs, kv=kv)
        return transformer.final_norm(params, x, m, layout, specs), kv

    def _logits(self, params, h):
        """h[B, 1, D] -> the full-vocabulary logits [B, V] (gathered over the vocabulary shards)."""
        m, layout, specs = self.program.config.model, self.program.layout, self.program.specs
        logits = transformer.output_logits(params, h, m, layout, specs)[:, 0].astype(jnp.float32)
        axes = layout.compute_axes("vocab")
        return jax.lax.all_gather(logits, axes, axis=-1, tiled=True) if axes else logits

    def _local_prefill(self, params, tokens, lengths, k, v):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        h, kv = self._forward(params, tokens, positions, {"k": k, "v": v})
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)
        return self._logits(params, last), kv["k"], kv["v"]

    def _local_decode(self, params, tokens, positions, k, v):
        h, kv = self._forward(params, tokens[:, None], positions[:, None], {"k": k, "v": v})
        return self._logits(params, h), kv["k"], kv["v"]

    def _local_extend(self, params, tokens, start, k, v):
        """tokens [B, T] at positions start[b] .. + T - 1 -> logits [B, T, V] of every position
        (speculative verification scores k drafted tokens in one forward)."""
        positions = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
        h, kv = self._forward(params, tokens, positions, {"k": k, "v": v})
        m, layout, specs = self.program.config.model, self.program.layout, self.program.specs
        logits = transformer.output_logits(params, h, m, layout, specs).astype(jnp.float32)
        axes = layout.compute_axes("vocab")
        logits = jax.lax.all_gather(logits, axes, axis=-1, tiled=True) if axes else logits
        return logits, kv["k"], kv["v"]

    def extend(self, params, tokens, start, cache):
        """Run tokens [B, T] at positions start[b].. through the model, writing the cache; returns
        (logits [B, T, V], cache). Compiled once per T."""
        if self._extend is None:
            p = self.program
            fn = jax.shard_map(
                self._local_extend,
                mesh=p.mesh,
                in_specs=(p.param_pspecs, self.rows_pspec, self.batch_pspec, self.cache_pspec, self.cache_pspec),
                out_specs=(p.layout.compute_spec(("batch", None, None)), self.cache_pspec, self.cache_pspec),
                check_vma=False,
            )
            self._extend = jax.jit(fn, donate_argnums=(3, 4))
        logits, k, v = self._extend(
            params, self.put(tokens, self.rows_pspec), self.put(start, self.batch_pspec), *cache
        )
        return logits, (k, v)

    def _compile(self, prefill: bool):
        program = self.program
        local = self._local_prefill if prefill else self._local_decode
        tokens_spec = self.rows_pspec if prefill else self.batch_pspec
        fn = jax.shard_map(
            local,
            mesh=program.mesh,
            in_specs=(program.param_pspecs, tokens_spec, self.batch_pspec, self.cache_pspec, self.cache_pspec),
            out_specs=(self.rows_pspec, self.cache_pspec, self.cache_pspec),
            check_vma=False,
        )
        return jax.jit(fn, donate_argnums=(3, 4))

    # -- global
    def init_cache(self):
        sharding = NamedSharding(self.program.mesh, self.cache_pspec)
        zeros = jax.jit(lambda: jnp.zeros(self.cache_shape, self.cache_dtype), out_shardings=sharding)
        return zeros(), zeros()

    def put(self, array, pspec):
        return jax.device_put(np.asarray(array), NamedSharding(self.program.mesh, pspec))

    def prefill(self, params, tokens, lengths, cache):
        """tokens [B, Tb] (right-padded), lengths [B] -> (logits [B, V], cache)."""
        logits, k, v = self._prefill(
            params, self.put(tokens, self.rows_pspec), self.put(lengths, self.batch_pspec), *cache
        )
        return logits, (k, v)

    def decode(self, params, tokens, positions, cache):
        logits, k, v = self._decode(
            params, self.put(tokens, self.batch_pspec), self.put(positions, self.batch_pspec), *cache
        )
        return logits, (k, v)


_sample = jax.jit(sample)


def generate(
    decoder: Decoder,
    params,
    prompts: list,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    on_token=None,
) -> list[list[int]]:
    """Continue each prompt (a list of token ids) by `max_new_tokens` tokens. `on_token(step,
    tokens[B])` sees each step's tokens as they come (streaming). Returns the new tokens per prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(
            f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got "
            f"temperature={temperature}, top_k={top_k}, top_p={top_p}"
        )
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > decoder.max_len:
        raise ValueError(
            f"a prompt of {longest} tokens plus {max_new_tokens} new ones exceeds the cache of "
            f"{decoder.max_len} positions: shorten the prompt or lower --max-new-tokens"
        )
    if len(prompts) > decoder.batch:
        raise ValueError(f"{len(prompts)} prompts for a decoder of batch {decoder.batch}")
    width = bucket(longest, decoder.max_len)
    rows = np.zeros((decoder.batch, width), np.int32)
    lengths = np.ones(decoder.batch, np.int32)  # padding rows: a one-token dummy prompt
    for i, p in enumerate(prompts):
        rows[i, : len(p)] = p
        lengths[i] = len(p)
    cache = decoder.init_cache()
    logits, cache = decoder.prefill(params, rows, lengths, cache)
    key = jax.random.key(seed)
    settings = (jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))
    out = []
    for step in range(max_new_tokens):
        tokens = _sample(logits, jax.random.fold_in(key, step), *settings)
        host = np.asarray(tokens)
        out.append(host)
        if on_token is not None:
            on_token(step, host[: len(prompts)])
        if step + 1 < max_new_tokens:
            logits, cache = decoder.decode(params, host, lengths + step, cache)
    new = np.stack(out, axis=1)
    return [new[i].tolist() for i in range(len(prompts))]
