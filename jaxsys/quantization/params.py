"""A parameter tree's dense weights in the stored formats of `config.model.quant` (models/quant.py):

  `quantize_params`  round to nearest (kernels/quantized_matmul/reference.py's quantizers), or GPTQ
                     for the weights given a Hessian;
  `gptq_params`      GPTQ with calibration: layer by layer, each layer's matmul inputs recorded on
                     batches of the training split of the config's corpus, run through the already
                     quantized layers before it (as the GPTQ reference code does), and each weight
                     quantized against the Hessian of its own inputs (gptq.py).

Formats: w8a16 and w8a8 (int8 per channel), w4a16, w4a8 and w4a4 (4-bit per group of G k, packed
two per byte in the kernel's layout, optional zero points; the activation format is the model's
business, models/quant.py). With `rotate` each weight is first multiplied by the block Hadamard H
(QuaRot's rotation on blocks of G, reference.rotate_groups) and GPTQ's Hessian by H on both sides:
the codes are of H W, and the model rotates its activations to match. Embeddings, the output
layer, norms and MoE experts stay in floating point.
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import data as data_lib
from jaxsys.config import apply_overrides, block_pattern
from jaxsys.kernels.quantized_matmul import reference as qref
from jaxsys.models import ladder, quant, transformer
from jaxsys.quantization import gptq
from jaxsys.sharding import Layout


def _matrix(w, contracted: int):
    """A layer's float weight [K dims, N dims] as [K', N']."""
    k = int(np.prod(w.shape[:contracted]))
    return w.reshape(k, -1)


def rotated_hessian(h, group_size: int):
    """The Hessian X^T X of inputs X H (H the block Hadamard, symmetric): H (X^T X) H, computed
    block by block ([K'/G, G, K'/G, G]: K'^2 G multiply-adds, not K'^3)."""
    h = np.asarray(h, np.float64)
    k = h.shape[0]
    blocks = h.reshape(k // group_size, group_size, k // group_size, group_size)
    rot = qref.hadamard(group_size).astype(np.float64)
    return np.einsum("ip,apbq,qj->aibj", rot, blocks, rot, optimize=True).reshape(k, k)


def quantize_matrix(w2, fmt: str, group_size: int = 128, zero_point: bool = False, hessian=None, rotate: bool = False):
    """One layer's weight w2[K', N'] -> (codes, scale, zero or None) in the stored form: int8 q
    [K', N'] and scale [N'] (w8a16, w8a8), or packed uint8 [K'/2, N'] in the kernel layout, scale
    and zero [K'/G, N'] (w4a16, w4a8, w4a4). RTN without `hessian`; GPTQ with (hessian, rows) of
    the inputs. `rotate`: the codes are of H W (H the block Hadamard of G)."""
    w2 = np.asarray(w2, np.float32)
    bits = "w4" if fmt in quant.FOUR_BIT else "w8"
    if rotate:
        w2 = np.asarray(qref.rotate_groups(jnp.asarray(w2), group_size, axis=0))
        if hessian is not None:
            hessian = (rotated_hessian(hessian[0], group_size), hessian[1])
    if hessian is not None:
        h, rows = hessian
        q, s, z = gptq.quantize(w2, h, rows, bits, group_size=group_size, zero_point=zero_point)
    elif bits == "w8":
        q, s = qref.quantize_w8(jnp.asarray(w2))
        z = None
    else:
        q, s, z = qref.quantize_w4(jnp.asarray(w2), group_size, zero_point)
    q, s = np.asarray(q, np.int8), np.asarray(s, np.float32)
    if bits == "w8":
        return q, s, None
    packed = np.asarray(qref.repack_w4(qref.pack_int4(jnp.asarray(q)), group_size))
    return packed, s, None if z is None else np.asarray(z, np.int8)


def _stored(name: str, codes, scale, zero, spec_k_dims, out_dims, fmt: str) -> dict:
    """The per-layer dict of `quant.quantized_spec` from 2-D codes and scales."""
    if fmt in quant.FOUR_BIT:
        codes = codes.reshape(*spec_k_dims[:-1], spec_k_dims[-1] // 2, *out_dims)
        scale = scale.reshape(-1, *out_dims)
        out = {"packed": codes, "scale": scale}
        if zero is not None:
            out["zero"] = zero.reshape(-1, *out_dims)
        return out
    return {"q": codes.reshape(*spec_k_dims, *out_dims), "scale": scale.reshape(out_dims)}


def quantize_layer_leaf(
    name: str, w, fmt: str, group_size: int, zero_point: bool, hessian=None, rotate: bool = False
) -> dict:
    """One layer's float weight `name` (no layer dimensions) -> its quantized dict."""
    c = quant.CONTRACTED[name]
    codes, scale, zero = quantize_matrix(_matrix(np.asarray(w), c), fmt, group_size, zero_point, hessian, rotate)
    return _stored(name, codes, scale, zero, w.shape[:c], w.shape[c:], fmt)


def _stack(per_layer: list[dict]) -> dict:
    return {k: np.stack([d[k] for d in per_layer]) for k in per_layer[0]}


def quantize_params(
    params, m, fmt: str, group_size: int = 128, zero_point: bool = False, hessians=None, rotate: bool = False
) -> dict:
    """The float parameter tree (layers [L, ...], host or device arrays) with every dense weight
    of `quant.CONTRACTED` quantized as `fmt`; `hessians[(name, layer)]` = (H, rows) selects GPTQ
    for that weight (RTN where absent); `rotate` stores H W (the Hessians are of unrotated inputs)."""
    layers = dict(params["layers"])
    for name in quant.CONTRACTED:
        if name not in layers:
            continue
        stack = np.asarray(layers[name], np.float32)
        layers[name] = _stack(
            [
                quantize_layer_leaf(
                    name,
                    stack[i],
                    fmt,
                    group_size,
                    zero_point,
                    None if hessians is None else hessians.get((name, i)),
                    rotate,
                )
                for i in range(stack.shape[0])
            ]
        )
    return {**params, "layers": layers}


# ----------------------------------------------------------------------------- GPTQ with calibration


def single_device(config):
    """A copy of `config` on one device (the layout calibration and quantization run on): the
    overrides `checkpoint.ONE_DEVICE` applied."""
    config = copy.deepcopy(config)
    apply_overrides(config, checkpoint_lib.ONE_DEVICE)
    return config


def gptq_params(
    params,
    config,
    corpus,
    fmt: str,
    group_size: int,
    zero_point: bool,
    batches: int = 8,
    log=None,
    rotate: bool = False,
) -> dict:
    """GPTQ of every dense weight, layer by layer: the inputs of layer l's matmuls come from running
    the already quantized layers 0..l-1 (dequantized) on `batches` training batches of `corpus`;
    each weight is quantized against the Hessian of its own inputs (gptq.py). `params` are
    float, layers [L, ...], on one device; `config` is the model's (any mesh: this runs on one)."""
    config = single_device(config)
    m, layout = config.model, Layout.from_config(config)
    t = config.train
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tokens = [  # a corpus of documents gives data.Batch: its tokens (padding included) calibrate
        data_lib.batch_parts(
            data_lib.global_batch(corpus, sharding, config.seed, i, t.batch_size, config.data.seq_len)
        )[0]
        for i in range(batches)
    ]
    positions = jnp.arange(config.data.seq_len)
    compute = jnp.dtype(m.compute_dtype)
    params = jax.tree.map(jnp.asarray, params)
    embed = jax.jit(lambda p, ids: transformer.embed(p, ids, m, layout))
    # each layer's input stream (under the ladder residual the pair (h, pending), config.model.residual)
    xs = [ladder.residual_stream(embed(params, tok[:, :-1]), m) for tok in tokens]
    pattern = block_pattern(m)
    counts = {"all": 0, "dense": 0, "moe": 0}
    index = lambda name: counts[transformer.leaf_kind(name)]
    hessians, layers = {}, params["layers"]
    quantized = {name: [] for name in quant.CONTRACTED if name in layers}

    @functools.partial(jax.jit, static_argnums=(2, 3))
    def run(x, w, kind, mlp_kind):
        B, T = jax.tree.leaves(x)[0].shape[:2]
        previous = jnp.full((B, T, m.moe.top_k), -1, jnp.int32)
        with quant.capture_inputs() as seen:
            y = transformer.block(x, w, positions, m, layout, kind, mlp_kind, previous)[0]
        return y, dict(seen)

    for l in range(m.n_layers):
        kind, mlp_kind = pattern[l % len(pattern)]
        w = {
            name: jax.tree.map(lambda a: a[index(name)].astype(compute), leaf)
            for name, leaf in layers.items()
            if transformer.leaf_kind(name) in ("all", mlp_kind)
        }
        sums = {}
        for x in xs:
            _, seen = run(x, w, kind, mlp_kind)
            for name, inputs in seen.items():
                c = quant.CONTRACTED[name]
                flat = np.asarray(inputs, np.float32).reshape(-1, int(np.prod(inputs.shape[-c:])))
                sums[name] = gptq.hessian(flat, sums.get(name))
        deq = dict(w)
        for name in quant.CONTRACTED:
            if name not in w:
                continue
            q = quantize_layer_leaf(
                name, np.asarray(w[name], np.float32), fmt, group_size, zero_point, sums[name], rotate
            )
            quantized[name].append(q)
            hessians[(name, index(name))] = sums[name]
            deq[name] = quant.dequantize_layer(
                jax.tree.map(jnp.asarray, q), fmt, quant.CONTRACTED[name], group_size if rotate else 0
            ).astype(compute)
        xs = [run(x, deq, kind, mlp_kind)[0] for x in xs]  # the next layer sees this one quantized
        for key in counts:
            counts[key] += key == "all" or key == mlp_kind
        if log:
            log(f"layer {l + 1}/{m.n_layers} quantized (GPTQ on {len(tokens)} batches)")
    out_layers = dict(layers)
    for name, per_layer in quantized.items():
        out_layers[name] = _stack(per_layer)
    return {**params, "layers": out_layers}
