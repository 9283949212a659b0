"""A small GPT written in Flax NNX, trained by jaxsys as it is (configs/flax_gpt.py, docs/flax.md).

    python -m jaxsys.train --config configs/flax_gpt.py --workdir /tmp/flax_gpt

Plain Flax: token and position embeddings, pre-norm blocks of causal multi-head attention and a
GELU MLP, a final LayerNorm, and an output layer tied to the token embedding or its own. The only
thing jaxsys asks of it is a logical axis name on every parameter dimension that should be
sharded, from jaxsys's vocabulary (`vocab`, `embed`, `heads`, `head_dim`, `mlp`, ...: the keys
of config.sharding.params). The two ways Flax offers are both used here:
`nnx.with_partitioning(initializer, names)` on a layer's initialiser, and
`nnx.Param(value, out_sharding=names)` on a parameter made by hand. Under jaxsys's default rules
`embed` is split over the `fsdp` mesh axis at rest (ZeRO-3) and the other names over `tensor`
(not used for Flax models: docs/flax.md).

`GPT(**kwargs, rngs=nnx.Rngs(key))` is what jaxsys builds; `model(tokens[B, T])` returns
logits [B, T, vocab_size].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

normal = nnx.initializers.normal
zeros = nnx.initializers.zeros_init()
ones = nnx.initializers.ones_init()


class CausalSelfAttention(nnx.Module):
    """Multi-head causal attention; q, k, v and the output projection as [D, N, H] / [N, H, D]."""

    def __init__(self, d_model: int, n_heads: int, *, init_std: float, out_std: float, rngs: nnx.Rngs):
        head_dim = d_model // n_heads
        shape = (d_model, n_heads, head_dim)
        names = ("embed", "heads", "head_dim")
        self.wq = nnx.Param(normal(init_std)(rngs.params(), shape), out_sharding=names)
        self.wk = nnx.Param(normal(init_std)(rngs.params(), shape), out_sharding=names)
        self.wv = nnx.Param(normal(init_std)(rngs.params(), shape), out_sharding=names)
        self.wo = nnx.Param(
            normal(out_std)(rngs.params(), (n_heads, head_dim, d_model)), out_sharding=("heads", "head_dim", "embed")
        )

    def __call__(self, x):  # x[B, T, D]
        q = jnp.einsum("btd,dnh->btnh", x, self.wq[...])
        k = jnp.einsum("btd,dnh->btnh", x, self.wk[...])
        v = jnp.einsum("btd,dnh->btnh", x, self.wv[...])
        scores = jnp.einsum("btnh,bsnh->bnts", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
        T = x.shape[1]
        causal = jnp.tril(jnp.ones((T, T), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(v.dtype)
        o = jnp.einsum("bnts,bsnh->btnh", probs, v)
        return jnp.einsum("btnh,nhd->btd", o, self.wo[...])


class Block(nnx.Module):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, *, init_std: float, out_std: float, rngs: nnx.Rngs):
        norm = lambda: nnx.LayerNorm(
            d_model,
            scale_init=nnx.with_partitioning(ones, ("embed",)),
            bias_init=nnx.with_partitioning(zeros, ("embed",)),
            rngs=rngs,
        )
        self.ln1, self.ln2 = norm(), norm()
        self.attn = CausalSelfAttention(d_model, n_heads, init_std=init_std, out_std=out_std, rngs=rngs)
        self.up = nnx.Linear(
            d_model,
            d_ff,
            kernel_init=nnx.with_partitioning(normal(init_std), ("embed", "mlp")),
            bias_init=nnx.with_partitioning(zeros, ("mlp",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            d_ff,
            d_model,
            kernel_init=nnx.with_partitioning(normal(out_std), ("mlp", "embed")),
            bias_init=nnx.with_partitioning(zeros, ("embed",)),
            rngs=rngs,
        )

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    """GPT-2-style decoder: tokens[B, T] -> logits[B, T, vocab_size]."""

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        d_ff: int = 512,
        max_len: int = 256,
        tie_embeddings: bool = True,
        init_std: float = 0.02,
        *,
        rngs: nnx.Rngs,
    ):
        out_std = init_std / (2 * n_layers) ** 0.5  # GPT-2's scaling of the residual projections
        self.tie_embeddings = tie_embeddings
        self.embed = nnx.Embed(
            vocab_size, d_model, rngs=rngs, embedding_init=nnx.with_partitioning(normal(init_std), ("vocab", "embed"))
        )
        self.positions = nnx.Param(normal(init_std)(rngs.params(), (max_len, d_model)), out_sharding=(None, "embed"))
        self.blocks = nnx.List(
            [Block(d_model, n_heads, d_ff, init_std=init_std, out_std=out_std, rngs=rngs) for _ in range(n_layers)]
        )
        self.ln_f = nnx.LayerNorm(
            d_model,
            scale_init=nnx.with_partitioning(ones, ("embed",)),
            bias_init=nnx.with_partitioning(zeros, ("embed",)),
            rngs=rngs,
        )
        if not tie_embeddings:
            self.unembed = nnx.Linear(
                d_model,
                vocab_size,
                use_bias=False,
                rngs=rngs,
                kernel_init=nnx.with_partitioning(normal(init_std), ("embed", "vocab")),
            )

    def __call__(self, tokens):
        T = tokens.shape[1]
        x = self.embed(tokens) + self.positions[...][:T]
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.embed.attend(x) if self.tie_embeddings else self.unembed(x)
