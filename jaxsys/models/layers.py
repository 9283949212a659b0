"""Layer functions on local arrays. Shapes use B batch, T sequence, D model, N query heads,
K key/value heads, H head dim, F MLP hidden. No communication happens here."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxsys.kernels.flash_attention.reference import softcapped


def rms_norm(x, scale, eps: float):
    """x[..., D] / rms(x) * scale[D]: normalised in fp32, scaled in x's dtype (as Llama does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * scale.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are stretched for a context longer than the one trained on
    (config.model.rope_*; `rope_scaling(m)` builds it). kind "none"; "linear" (position
    interpolation, Chen et al. 2023: every frequency / factor); "llama3" (Llama 3.1: frequencies
    whose wavelength exceeds original_max_position / low_freq_factor are divided by factor, those
    below original_max_position / high_freq_factor kept, the band between interpolated); "yarn"
    (YaRN, Peng et al. 2023: frequencies that turn more than beta_fast times over the original
    context are kept, fewer than beta_slow times divided by factor, a linear ramp over the head-dim
    indices between; q and k scaled by attention_factor, 0.1 ln(factor) + 1 unless given)."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0  # yarn: 0 means 0.1 ln(factor) + 1
    truncate: bool = True  # yarn: the ramp's ends rounded out to whole indices

    @property
    def magnitude(self) -> float:
        """What RoPE's cos and sin are multiplied by (YaRN's attention factor; else 1)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


def rope_scaling(m) -> RopeScaling:
    return RopeScaling(
        m.rope_scaling,
        m.rope_factor,
        m.rope_low_freq_factor,
        m.rope_high_freq_factor,
        m.rope_original_max_position,
        m.rope_beta_fast,
        m.rope_beta_slow,
        m.rope_attention_factor,
        m.rope_truncate,
    )


def _yarn_ramp(scaling: RopeScaling, head_dim: int, theta: float):
    """[H/2] YaRN's blend weight of the interpolated frequency: 0 at index <= low (the fast
    frequencies, kept), 1 at index >= high (the slow ones, divided by factor). low / high are the
    indices whose frequency turns beta_fast / beta_slow times over original_max_position."""

    def index_of(rotations: float) -> float:
        return head_dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_of(scaling.beta_fast), index_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if high == low:
        high += 0.001  # one index: a step, not a division by zero
    return jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling()):
    """The H/2 rotation frequencies (radians per position) of RoPE: theta^(-2i/H), then `scaling`."""
    half = head_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling.kind == "linear":
        return freqs / scaling.factor
    if scaling.kind == "llama3":
        wavelength = 2 * math.pi / freqs
        context = scaling.original_max_position
        # 0 at the low-frequency edge (wavelength context / low_freq_factor), 1 at the high one
        smooth = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
        low = wavelength > context / scaling.low_freq_factor
        high = wavelength < context / scaling.high_freq_factor
        return jnp.where(low, freqs / scaling.factor, jnp.where(high, freqs, blended))
    if scaling.kind == "yarn":
        ramp = _yarn_ramp(scaling, head_dim, theta)
        return freqs / scaling.factor * ramp + freqs * (1 - ramp)
    return freqs


def rope(x, positions, theta: float, scaling: RopeScaling = RopeScaling()):
    """Rotary embeddings on x[B, T, N, H] at positions[T] (or per sequence, [B, T]), rotating the
    two halves of H (the Llama/NeoX convention), at `rope_frequencies` (times YaRN's magnitude)."""
    freqs = rope_frequencies(x.shape[-1], theta, scaling)
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [(B,) T, H/2]
    angles = angles[None, :, None, :] if positions.ndim == 1 else angles[:, :, None, :]
    cos, sin = jnp.cos(angles) * scaling.magnitude, jnp.sin(angles) * scaling.magnitude
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(
    q, k, v, causal: bool = True, q_positions=None, segment_ids=None, window: int | None = None, softcap=None
):
    """Grouped-query attention. q[B, T, N, H], k/v[B, S, K, H] with N a multiple of K; query head n
    reads key/value head n // (N/K). Softmax in fp32. Returns [B, T, N, H]. With `q_positions`
    [B, T] (decoding from a KV cache whose slot s holds position s) query t of sequence b sees the
    keys at positions <= q_positions[b, t]; otherwise `causal` masks with T == S. `segment_ids`
    [B, T] (packed documents, T == S): query t sees key s only if their ids are equal, besides the
    causal or position mask. `window` W (sliding-window attention, with either mask): a query sees
    only its last W positions, its own included. `softcap` c (Gemma 2): scores c * tanh(s / c)
    after scaling, before the mask."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = softcapped(scores * (h**-0.5), softcap)
    if q_positions is not None:
        back = q_positions[:, :, None] - jnp.arange(k.shape[1])[None, None, :]  # [B, T, S]
        mask = (back >= 0) if window is None else (back >= 0) & (back < window)
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    elif causal:
        back = jnp.arange(t)[:, None] - jnp.arange(k.shape[1])[None, :]
        mask = (back >= 0) if window is None else (back >= 0) & (back < window)
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    if segment_ids is not None:  # [B, T, S] -> [B, 1, 1, T, S] against scores [B, K, G, T, S]
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        scores = jnp.where(same[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, n, h)


def _einsum(eq, x, w, name=""):
    return jnp.einsum(eq, x, w)


def swiglu(x, w_gate, w_up, w_down, linear=_einsum):
    """SwiGLU MLP: (silu(x W_gate) * x W_up) W_down, x[B, T, D], W_gate/W_up[D, F], W_down[F, D].
    `linear(eq, x, w, name=...)` runs each matmul (models/quant.py's for quantized weights)."""
    return swiglu_down(swiglu_hidden(*swiglu_up(x, w_gate, w_up, linear)), w_down, linear)


# SwiGLU in its three parts, for a tensor-parallel block that runs its column-parallel and
# row-parallel matmuls through jaxsys.parallel.tensor (enter_matmul / leave_matmul)
def swiglu_up(x, w_gate, w_up, linear=_einsum):
    """The two column-parallel projections (x W_gate, x W_up)."""
    return linear("btd,df->btf", x, w_gate, name="w_gate"), linear("btd,df->btf", x, w_up, name="w_up")


def swiglu_hidden(gate, up, activation: str = "silu"):
    """act(gate) * up: SwiGLU's silu, or GeGLU's tanh-approximated gelu (Gemma's gelu_pytorch_tanh)."""
    act = jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return checkpoint_name(act * up, "mlp_hidden")  # host-offloadable (config.offload)


def swiglu_down(hidden, w_down, linear=_einsum):
    """The row-parallel projection hidden W_down."""
    return linear("btf,fd->btd", hidden, w_down, name="w_down")


def swiglu_experts(x, w_gate, w_up, w_down):
    """SwiGLU of every expert on its own slots: x[G, E, C, D], W_gate/W_up[E, D, F], W_down[E, F, D]
    -> [G, E, C, D] (the capacity path of a mixture of experts)."""
    gate = jnp.einsum("gecd,edf->gecf", x, w_gate)
    up = jnp.einsum("gecd,edf->gecf", x, w_up)
    return jnp.einsum("gecf,efd->gecd", jax.nn.silu(gate) * up, w_down)


def swiglu_grouped(x, w_gate, w_up, w_down, group_sizes):
    """SwiGLU of rows grouped by expert: x[M, D] whose first group_sizes[0] rows go to expert 0, the
    next group_sizes[1] to expert 1, ...; W[E, ...] as in `swiglu_experts`. Rows past
    sum(group_sizes) come out zero. A grouped matmul (`lax.ragged_dot`): no row is padded. On GPU and
    TPU JAX emits XLA's ragged-dot instruction; on CPU it falls back to E masked dense matmuls
    (E x the FLOPs and an [E, M, D] mask; docs/moe.md)."""
    gate = jax.lax.ragged_dot(x, w_gate, group_sizes)
    up = jax.lax.ragged_dot(x, w_up, group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)
