"""Quantized matmuls of the transformer's dense layers: inference formats read from a quantized
checkpoint (`config.model.quant`), int8 training with a straight-through estimator and fp8
training (`config.model.quant_train`). docs/quantization.md says how this fits together.

Every dense weight is used by one einsum whose contracted letters lead the weight and end the
activation ("btd,dnh->btnh", "btnh,nhd->btd", "btf,fd->btd"), so each is a matmul
x[M, K'] @ W[K', N'] with K' the product of the contracted dimensions and N' of the others.
`linear` runs that einsum: on a float weight as it is, with `quant_train='int8'` as an int8
matmul with a straight-through estimator (`int8_matmul`), with `quant_train='fp8'` as an fp8 one
(`fp8_matmul`: e4m3 operands, e5m2 gradient, current per-tensor scales from the whole tensor's
amax, reduced over the shards by jaxsys.parallel); on a quantized weight (a dict of codes and scales,
`quantized_spec`) through the kernels of jaxsys.kernels.quantized_matmul.

Quantized weights keep the float weight's dimensions and logical axes, so they shard like the
weight they replace (a column-parallel weight splits N', a row-parallel one K'):

    w8a16 / w8a8   q      int8   the weight's shape            w ~ q * scale
                   scale  fp32   [lead..., out dims]           one per output channel
    w4a16, w4a8,   packed uint8  the weight's shape with its last contracted dimension halved: two
    w4a4
                                 codes per byte, in the kernel's layout (reference.repack_w4 of
                                 reference.pack_int4 along the flattened K')
                   scale  fp32   [lead..., K'/G, out dims]     one per group of G k per channel
                   zero   int8   as scale (config.model.quant_zero_point)

The groups' dimension carries the logical name of the leading contracted dimension (`heads` for
wo, `mlp` for w_down), so under tensor parallelism a rank holds the scales of its own rows; over
`embed` and MLA's `latent` (FSDP-sharded at rest, gathered before use) it is left unsharded.

W8A8 and W4A8 quantize the activations per token inside `linear`, over the K' a rank holds: under
tensor parallelism a row-parallel matmul's activation scales are per shard (finer than one
device's), so its results differ from one device's by quantization noise, while W8A16, W4A16 and
W4A4 (activations per token and group of G, Atom's groups, which never straddle a shard) are
exact reshapes of the same sums.

`config.model.quant_rotate` stores H W for each dense weight, H block-diagonal Hadamard in blocks of
G along K' (QuaRot's rotation, on blocks), and `linear` multiplies the activation by H before it
is quantized: x W = (x H)(H W), and an outlier channel is spread over its block. Blocks of G never
straddle a tensor-parallel shard (config validation), so the rotation needs no communication.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxsys.kernels.quantized_matmul import kernel as qkernel
from jaxsys.kernels.quantized_matmul import reference as qref
from jaxsys.models import lora
from jaxsys.models.params import ParamSpec
from jaxsys.parallel import collectives

# The dense weights a quantized model stores as codes (those a model has), and how many of their
# dimensions (after the layer dimensions) are contracted: attention's and the SwiGLU's, and MLA's
# projections (models/mla.py). Embeddings, the output layer, norms and MoE experts stay in
# floating point, as in GPTQ and AWQ.
CONTRACTED = {
    "wq": 1,
    "wk": 1,
    "wv": 1,
    "wo": 2,
    "w_gate": 1,
    "w_up": 1,
    "w_down": 1,
    "wq_a": 1,
    "wq_b": 1,
    "wkv_a": 1,
    "wk_rope": 1,
    "wk_b": 1,
    "wv_b": 1,
}


def contracted(name: str) -> int:
    """How many leading (after the layers) dimensions projection `name` contracts."""
    return CONTRACTED[name]


CODES = {"w8a16": "q", "w8a8": "q", "w4a16": "packed", "w4a8": "packed", "w4a4": "packed"}
FOUR_BIT = ("w4a16", "w4a8", "w4a4")  # the formats of 4-bit weights in groups of G


def is_quantized(w) -> bool:
    """A quantized weight: the dict of codes and scales `quantized_spec` describes."""
    return isinstance(w, dict) and ("q" in w or "packed" in w)


def _lead(axes) -> int:
    """Dimensions up to and including `layers` (chunks, layers): the stacked layers."""
    return axes.index("layers") + 1 if "layers" in axes else 0


def quantized_spec(spec: ParamSpec, name: str, fmt: str, group_size: int, zero_point: bool) -> dict:
    """The ParamSpecs of weight `name` (a ParamSpec of the float model) stored as `fmt`."""
    lead = _lead(spec.axes)
    c = CONTRACTED[name]
    shape, axes = spec.shape, spec.axes
    k_dims, k_axes = shape[lead : lead + c], axes[lead : lead + c]
    out_dims, out_axes = shape[lead + c :], axes[lead + c :]
    lead_dims, lead_axes = shape[:lead], axes[:lead]
    codes = functools.partial(ParamSpec, init="zeros", decay=False)
    if fmt in ("w8a16", "w8a8"):
        return {
            "q": codes(shape, axes, dtype="int8"),
            "scale": ParamSpec(lead_dims + out_dims, lead_axes + out_axes, init="ones", decay=False, dtype="float32"),
        }
    group_axis = None if k_axes[0] in ("embed", "latent") else k_axes[0]  # FSDP-only axes: scales whole
    packed_shape = lead_dims + k_dims[:-1] + (k_dims[-1] // 2,) + out_dims
    group_shape = lead_dims + (math.prod(k_dims) // group_size,) + out_dims
    group_axes = lead_axes + (group_axis,) + out_axes
    out = {
        "packed": codes(packed_shape, axes, dtype="uint8"),
        "scale": ParamSpec(group_shape, group_axes, init="ones", decay=False, dtype="float32"),
    }
    if zero_point:
        out["zero"] = codes(group_shape, group_axes, dtype="int8")
    return out


def quantize_specs(layer_specs: dict, m) -> dict:
    """The model's layer ParamSpecs with every dense weight of CONTRACTED replaced by its
    quantized form (config.model.quant)."""
    if m.quant == "none":
        return layer_specs
    return {
        name: quantized_spec(s, name, m.quant, m.quant_group_size, m.quant_zero_point) if name in CONTRACTED else s
        for name, s in layer_specs.items()
    }


# ----------------------------------------------------------------------------- the matmuls


_CAPTURED: dict | None = None


@contextlib.contextmanager
def capture_inputs():
    """Record the activation each `linear` call with a name receives, as {name: x}, while the
    context is open (trace time: inside a jitted function the values are its tracers, which it may
    return). Calibration (jaxsys/quantization/params.py) reads a layer's matmul inputs this way."""
    global _CAPTURED
    outer, _CAPTURED = _CAPTURED, {}
    try:
        yield _CAPTURED
    finally:
        _CAPTURED = outer


@dataclasses.dataclass(frozen=True)
class _Einsum:
    batch: tuple[int, ...]  # x's leading (not contracted) dimension count, as letters
    contracted: int  # contracted dimensions: x's last, the weight's first


def _parse(eq: str) -> _Einsum:
    inputs, out = eq.split("->")
    xs, ws = inputs.split(",")
    contracted = "".join(l for l in ws if l in xs)
    if not (
        ws.startswith(contracted)
        and xs.endswith(contracted)
        and out == xs[: len(xs) - len(contracted)] + ws[len(contracted) :]
    ):
        raise ValueError(f"linear({eq!r}): the contracted letters must lead the weight and end the input")
    return _Einsum(tuple(xs[: len(xs) - len(contracted)]), len(contracted))


def block_m(rows: int, minimum: int = 16) -> int:
    """The kernels' row tile for a matmul of `rows` tokens: the next power of two, 16..128 (int8
    operands: at least 32, their native TPU tile)."""
    return max(minimum, min(128, 1 << max(rows - 1, 1).bit_length()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _quantized_matmul(x2, w, fmt: str, impl: str):
    """x2[M, K'] @ the quantized weight w (its codes reshaped [K', N'] by the caller) -> [M, N'].
    Differentiable in x2 (QLoRA trains adapters through a frozen quantized base): dx = dy W^T with
    W dequantized (straight through the activation rounding of w8a8); the codes get no gradient."""
    return _quantized_forward(x2, w, fmt, impl)


def _quantized_fwd(x2, w, fmt, impl):
    return _quantized_forward(x2, w, fmt, impl), w


def _quantized_bwd(fmt, impl, w, dy):
    weight = _dequantized_matrix(w, fmt)  # [K', N'] fp32
    dx = jnp.dot(dy.astype(jnp.float32), weight.T, precision=jax.lax.Precision.HIGHEST)
    return dx.astype(dy.dtype), None


_quantized_matmul.defvjp(_quantized_fwd, _quantized_bwd)


def _dequantized_matrix(mat, fmt: str):
    """The fp32 [K', N'] weight of a layer's 2-D operands (`_as_matrix`)."""
    if fmt in FOUR_BIT:
        packed, s = mat["packed"], mat["scale"]
        group_size = 2 * packed.shape[0] // s.shape[0]
        return qref.dequantize_w4(qref.unrepack_w4(packed, group_size), s, mat.get("zero"))
    return mat["q"].astype(jnp.float32) * mat["scale"][None, :]


def _quantized_forward(x2, w, fmt: str, impl: str):
    # interpret mode on CPU, compiled elsewhere; split_k None: on a GPU, decode-sized M (<= 64)
    # splits K over enough programs to fill the SMs (kernel.choose_split_k), larger M does not
    kw = dict(interpret=None, split_k=None)
    if fmt in ("w8a16", "w8a8"):
        q, s = w["q"], w["scale"]
        if fmt == "w8a16":
            if impl == "reference":
                return qref.matmul_w8a16(x2, q, s)
            return qkernel.matmul_w8a16(x2, q, s, block_m=block_m(x2.shape[0]), **kw)
        xq, sx = qref.quantize_per_token(x2)
        if impl == "reference":
            return qref.matmul_w8a8(xq, sx, q, s, x2.dtype)
        return qkernel.matmul_w8a8(xq, sx, q, s, x2.dtype, block_m=block_m(x2.shape[0], 32), **kw)
    packed, s, z = w["packed"], w["scale"], w.get("zero")
    group_size = 2 * packed.shape[0] // s.shape[0]
    if fmt == "w4a16":
        if impl == "reference":
            return qref.matmul_w4a16(x2, qref.unrepack_w4(packed, group_size), s, z)
        return qkernel.matmul_w4a16(x2, packed, s, z, block_m=block_m(x2.shape[0]), **kw)
    # W4A8: int8 per token; W4A4: 4-bit per token and group (Atom), each group's sum in int32
    xq, sx = qref.quantize_per_token(x2) if fmt == "w4a8" else qref.quantize_per_token_group(x2, group_size, 4)
    if impl == "reference":
        return qref.matmul_w4ax(xq, sx, qref.unrepack_w4(packed, group_size), s, z, x2.dtype)
    return qkernel.matmul_w4ax(xq, sx, packed, s, z, x2.dtype, block_m=block_m(x2.shape[0], 32), **kw)


def _as_matrix(w, contracted: int, fmt: str):
    """A layer's quantized weight as 2-D operands: codes [K', N'] (packed [K'/2, N']), scales [N']
    or [K'/G, N'], with the stored output dimensions."""
    codes = w[CODES[fmt]]
    out_dims = codes.shape[contracted:]
    n = math.prod(out_dims)
    mat = {CODES[fmt]: codes.reshape(-1, n), "scale": w["scale"].reshape(-1, n)}
    if fmt not in FOUR_BIT:
        mat["scale"] = mat["scale"].reshape(n)
    if "zero" in w:
        mat["zero"] = w["zero"].reshape(-1, n)
    return mat, out_dims


def linear(eq: str, x, w, m, name: str = ""):
    """jnp.einsum(eq, x, w) for one dense layer, x[..., K dims] and w[K dims, N dims]: as written
    for a float weight; through the quantized kernels for a quantized one (`m.quant`,
    `m.quant_impl`); as an int8 matmul with a straight-through estimator for a float weight under
    `m.quant_train='int8'`, or an fp8 one under `'fp8'`. `name` labels the input for `capture_inputs`."""
    if lora.is_lora(w):  # a LoRA-wrapped weight (models/lora.py): the base's product plus the adapter's
        y = linear(eq, x, w.base, m, name)
        return y + lora.low_rank(x, w, _parse(eq).contracted).astype(y.dtype)
    if _CAPTURED is not None and name:
        _CAPTURED[name] = x
    quantized = is_quantized(w)
    if not quantized and m.quant_train == "none":
        return jnp.einsum(eq, x, w)
    form = _parse(eq)
    batch_dims = x.shape[: len(form.batch)]
    x2 = x.reshape(math.prod(batch_dims), -1)
    if quantized:
        mat, out_dims = _as_matrix(w, form.contracted, m.quant)
        if m.quant_rotate:  # the codes are of H W (quantization/params.py): x W = (x H)(H W)
            x2 = qref.rotate_groups(x2, m.quant_group_size)
        y2 = _quantized_matmul(x2, mat, m.quant, m.quant_impl)
    else:
        out_dims = w.shape[form.contracted :]
        w2 = w.reshape(x2.shape[1], -1)
        if m.quant_train == "fp8":
            y2 = fp8_matmul(x2, w2).astype(x.dtype)
        else:
            y2 = int8_matmul(x2, w2, m.quant_impl == "pallas").astype(x.dtype)
    return y2.reshape(*batch_dims, *out_dims)


# ----------------------------------------------------------------------------- int8 training


def _int8_product(a, b, sa, sb, pallas: bool, out_dtype=jnp.float32):
    """int8 a[M, K] @ int8 b[K, N] in int32, times sa[M] sb[N]."""
    if pallas:
        return qkernel.matmul_w8a8(a, sa, b, sb, out_dtype, block_m=block_m(a.shape[0], 32))
    return qref.matmul_w8a8(a, sa, b, sb, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def int8_matmul(x, w, pallas: bool = False):
    """x[M, K] @ w[K, N] with both operands quantized to int8 (x per row, w per column; symmetric,
    round to nearest) and an int32 product, in fp32. Backward (straight-through: rounding counts
    as the identity), the two gradient matmuls are int8 too, each operand scaled along its
    non-contracted dimension (the only scales that factor out of an integer sum):
        dx = q(dy, per row) @ q(w^T, per column k)        dw = q(x^T, per row k) @ q(dy, per column n)
    `pallas` runs the three products through the W8A8 kernel (bitwise equal to the reference)."""
    return _int8_forward(x, w, pallas)


def _int8_forward(x, w, pallas):
    xq, sx = qref.quantize_per_token(x)
    wq, sw = qref.quantize_w8(w)
    return _int8_product(xq, wq, sx, sw, pallas)


def _int8_fwd(x, w, pallas):
    return _int8_forward(x, w, pallas), (x, w)


def _int8_bwd(pallas, residuals, dy):
    x, w = residuals
    dy = dy.astype(jnp.float32)
    dyq_rows, s_dy_rows = qref.quantize_per_token(dy)
    wtq, s_wt = qref.quantize_w8(w.T)  # w^T [N, K]: one scale per k
    dx = _int8_product(dyq_rows, wtq, s_dy_rows, s_wt, pallas)
    xtq, s_xt = qref.quantize_per_token(x.T)  # x^T [K, M]: one scale per k
    dyq_cols, s_dy_cols = qref.quantize_w8(dy)  # dy [M, N]: one scale per n
    dw = _int8_product(xtq, dyq_cols, s_xt, s_dy_cols, pallas)
    return dx.astype(x.dtype), dw.astype(w.dtype)


int8_matmul.defvjp(_int8_fwd, _int8_bwd)


# ----------------------------------------------------------------------------- fp8 training

E4M3 = jnp.float8_e4m3fn  # forward operands: 4 exponent bits, 3 mantissa bits, max 448, no inf
E5M2 = jnp.float8_e5m2  # gradients: 5 exponent bits, 2 mantissa bits, max 57344


def fp8_scale(amax, dtype):
    """The current scale of a tensor whose absmax is `amax`: amax / max(dtype), 1 where amax is 0."""
    return jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0).astype(jnp.float32)


def fp8_quantize(x, dtype, scale=None):
    """x as `dtype` codes with one per-tensor scale: by default the current one (`fp8_scale` of
    amax(|x|) on this device); codes = x / scale rounded to nearest even and saturated at
    +-max(dtype) (e4m3fn has no infinity: an unclipped overflow would be NaN), which a given
    `scale` (a stale or delayed one) can reach. x ~ codes * scale."""
    fmax = float(jnp.finfo(dtype).max)
    x = x.astype(jnp.float32)
    if scale is None:
        scale = fp8_scale(jnp.max(jnp.abs(x)), dtype)
    return jnp.clip(x / scale, -fmax, fmax).astype(dtype), scale


def _global_scales(dtype, *tensors):
    """The current scales of `tensors`, each from its amax over the whole tensor: the local absmaxes
    reduced in one collective over the devices that hold the other shards (and replicas) of it."""
    amax = jnp.stack([jnp.max(jnp.abs(t.astype(jnp.float32))) for t in tensors])
    amax = collectives.max_over_replicas_and_shards(amax)
    return [fp8_scale(amax[i], dtype) for i in range(len(tensors))]


def _fp8_product(a, b, sa, sb, a_contract: int = 1, b_contract: int = 0):
    """fp8 a @ fp8 b (contracting a's dimension `a_contract` with b's `b_contract`), accumulated in
    fp32, times the per-tensor scales sa * sb: one dot_general on the fp8 operands with an fp32
    result, which XLA:GPU (sm90) keeps as a GEMM on the fp8 operands (a Triton GEMM fusion when
    compiled deviceless); dequantize-then-dot does not (docs/quantization.md)."""
    dims = (((a_contract,), (b_contract,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32) * (sa * sb)


@jax.custom_vjp
def fp8_matmul(x, w):
    """x[M, K] @ w[K, N] with both operands cast to float8_e4m3fn (one current scale per tensor,
    from the amax of the whole tensor across its shards: `_global_scales`, `fp8_quantize`), products accumulated in fp32. Backward (straight-through), dy is cast to
    float8_e5m2 with its own per-tensor scale and the gradient matmuls reuse the forward's e4m3
    operands:  dx = q(dy) @ q(w)^T,  dw = q(x)^T @ q(dy), fp32 accumulation. The residuals are the
    fp8 codes and their scales, a quarter of fp32 x and w."""
    return _fp8_fwd(x, w)[0]


def _fp8_fwd(x, w):
    sx, sw = _global_scales(E4M3, x, w)
    xq, _ = fp8_quantize(x, E4M3, sx)
    wq, _ = fp8_quantize(w, E4M3, sw)
    # The codes are kept as their bits (uint8): a scan over layers stacks its residuals with
    # dynamic-update-slice, which XLA:CPU widens for float8 through an IEEE-style reduce-precision
    # that turns e4m3fn's codes above 240 into NaN. The dtypes ride as zero-size arrays (a
    # custom_vjp residual must be an array).
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint8)
    dtypes = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
    return _fp8_product(xq, wq, sx, sw), (bits(xq), sx, bits(wq), sw, dtypes)


def _fp8_bwd(residuals, dy):
    xbits, sx, wbits, sw, (x_dtype, w_dtype) = residuals
    xq, wq = (jax.lax.bitcast_convert_type(b, E4M3) for b in (xbits, wbits))
    dyq, sdy = fp8_quantize(dy, E5M2, *_global_scales(E5M2, dy))
    dx = _fp8_product(dyq, wq, sdy, sw, 1, 1)  # dy[M, N] . w[K, N] over N -> [M, K]
    dw = _fp8_product(xq, dyq, sx, sdy, 0, 0)  # x[M, K] . dy[M, N] over M -> [K, N]
    return dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype)


fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)


# ----------------------------------------------------------------------------- storage


def bits_per_weight(fmt: str, group_size: int = 128, zero_point: bool = False) -> float:
    """Stored bits per weight element of a quantized matrix with many rows (the per-channel scale
    of w8 is negligible; w4's per-group scale, fp32, and zero point, int8, are not)."""
    if fmt in ("w8a16", "w8a8"):
        return 8.0
    if fmt in FOUR_BIT:
        return 4.0 + (32.0 + (8.0 if zero_point else 0.0)) / group_size
    raise ValueError(f"no storage figure for format {fmt!r}")


def dequantize_layer(w, fmt: str, contracted: int, rotation: int = 0):
    """The fp32 weight one layer's quantized leaf stands for, in the float weight's shape (no layer
    dimensions; vmap over them): for tests and calibration, never on the model's path. `rotation`:
    the block size G of the Hadamard the codes were stored under (config.model.quant_rotate), undone
    here (H is its own inverse); 0 for none."""
    mat, out_dims = _as_matrix(w, contracted, fmt)
    codes = w[CODES[fmt]]
    k_dims = codes.shape[:contracted]
    if fmt in FOUR_BIT:
        k_dims = k_dims[:-1] + (2 * k_dims[-1],)
    matrix = _dequantized_matrix(mat, fmt)
    if rotation:
        matrix = qref.rotate_groups(matrix, rotation, axis=0)
    return matrix.reshape(*k_dims, *out_dims)


def rotation(m) -> int:
    """The Hadamard block size the model's quantized weights are stored under: G with
    config.model.quant_rotate, else 0."""
    return m.quant_group_size if m.quant != "none" and m.quant_rotate else 0
