"""Quantize a trained (or converted) checkpoint's dense layers into a new workdir.

    python -m jaxsys.quantize --workdir W --out W_q --format w4a16 --method gptq [--group-size 128]
        [--zero-point] [--calibration-batches 8] [--step S]
    python -m jaxsys.evaluate --workdir W_q          # held-out loss and perplexity through the kernels

Formats (config.model.quant, models/quant.py): w8a16 (int8 per channel), w4a16 (4-bit per group of
G k, packed two per byte in the kernel's layout, optional zero points), w8a8 (int8 weights per
channel; activations quantized per token at run time). Methods:

  rtn   round to nearest, weight by weight (kernels/quantized_matmul/reference.py's quantizers);
  gptq  GPTQ (Frantar et al. 2022; jaxsys/gptq.py): each matmul's weights are rounded one input
        row at a time and the error pushed onto the rows not yet rounded, weighted by the inverse
        Hessian of the layer's calibration inputs (batches of the training split of the
        config's corpus). Layers are calibrated in order, each on the outputs of the already
        quantized layers before it, as the GPTQ reference code does.

W_q holds config.json (the source config with config.model.quant* set) and checkpoint step S
(the source's), whose parameters are the quantized tree and whose optimizer state is empty: it
restores onto any mesh that divides the model (tensor parallelism included) like any workdir.
Embeddings, the output layer, norms and MoE experts stay in floating point.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import data as data_lib
from jaxsys.config import MESH_AXES, QUANT_FORMATS, ConfigError, base_config, block_pattern, validate
from jaxsys.kernels.quantized_matmul import reference as qref
from jaxsys.models import ladder, quant, transformer
from jaxsys.sharding import Layout

METHODS = ("rtn", "gptq")


def _matrix(w, contracted: int):
    """A layer's float weight [K dims, N dims] as [K', N']."""
    k = int(np.prod(w.shape[:contracted]))
    return w.reshape(k, -1)


def quantize_matrix(w2, fmt: str, group_size: int = 128, zero_point: bool = False, hessian=None):
    """One layer's weight w2[K', N'] -> (codes, scale, zero or None) in the stored form: int8 q
    [K', N'] and scale [N'] (w8a16, w8a8), or packed uint8 [K'/2, N'] in the kernel layout, scale
    and zero [K'/G, N'] (w4a16). RTN without `hessian`; GPTQ with (hessian, rows) of the inputs."""
    w2 = np.asarray(w2, np.float32)
    bits = "w4" if fmt == "w4a16" else "w8"
    if hessian is not None:
        from jaxsys import gptq

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
    if fmt == "w4a16":
        codes = codes.reshape(*spec_k_dims[:-1], spec_k_dims[-1] // 2, *out_dims)
        scale = scale.reshape(-1, *out_dims)
        out = {"packed": codes, "scale": scale}
        if zero is not None:
            out["zero"] = zero.reshape(-1, *out_dims)
        return out
    return {"q": codes.reshape(*spec_k_dims, *out_dims), "scale": scale.reshape(out_dims)}


def quantize_layer_leaf(name: str, w, fmt: str, group_size: int, zero_point: bool, hessian=None) -> dict:
    """One layer's float weight `name` (no layer dimensions) -> its quantized dict."""
    c = quant.CONTRACTED[name]
    codes, scale, zero = quantize_matrix(_matrix(np.asarray(w), c), fmt, group_size, zero_point, hessian)
    return _stored(name, codes, scale, zero, w.shape[:c], w.shape[c:], fmt)


def _stack(per_layer: list[dict]) -> dict:
    return {k: np.stack([d[k] for d in per_layer]) for k in per_layer[0]}


def quantize_params(params, m, fmt: str, group_size: int = 128, zero_point: bool = False, hessians=None) -> dict:
    """The float parameter tree (layers [L, ...], host or device arrays) with every dense weight
    of `quant.CONTRACTED` quantized as `fmt`; `hessians[(name, layer)]` = (H, rows) selects GPTQ
    for that weight (RTN where absent)."""
    layers = dict(params["layers"])
    for name in quant.CONTRACTED:
        if name not in layers:
            continue
        stack = np.asarray(layers[name], np.float32)
        layers[name] = _stack(
            [
                quantize_layer_leaf(
                    name, stack[i], fmt, group_size, zero_point, None if hessians is None else hessians.get((name, i))
                )
                for i in range(stack.shape[0])
            ]
        )
    return {**params, "layers": layers}


# ----------------------------------------------------------------------------- GPTQ calibration


def _single_device(config):
    """A copy of `config` on one device (the layout calibration and quantization run on)."""
    config = copy.deepcopy(config)
    for axis in MESH_AXES:
        config.mesh[axis] = 1
        config.dcn[axis] = 1
    config.train.virtual_stages = 1
    config.parallel.vocab_parallel = False
    return config


def gptq_params(
    params, config, corpus, fmt: str, group_size: int, zero_point: bool, batches: int = 8, log=None
) -> dict:
    """GPTQ of every dense weight, layer by layer: the inputs of layer l's matmuls come from running
    the already quantized layers 0..l-1 (dequantized) on `batches` training batches of `corpus`;
    each weight is quantized against the Hessian of its own inputs (jaxsys/gptq.py). `params` are
    float, layers [L, ...], on one device; `config` is the model's (any mesh: this runs on one)."""
    from jaxsys import gptq

    config = _single_device(config)
    m, layout = config.model, Layout.from_config(config)
    t = config.train
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tokens = [
        data_lib.global_batch(corpus, sharding, config.seed, i, t.batch_size, config.data.seq_len)
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
            q = quantize_layer_leaf(name, np.asarray(w[name], np.float32), fmt, group_size, zero_point, sums[name])
            quantized[name].append(q)
            hessians[(name, index(name))] = sums[name]
            deq[name] = quant.dequantize_layer(jax.tree.map(jnp.asarray, q), fmt, quant.CONTRACTED[name]).astype(
                compute
            )
        xs = [run(x, deq, kind, mlp_kind)[0] for x in xs]  # the next layer sees this one quantized
        for key in counts:
            counts[key] += key == "all" or key == mlp_kind
        if log:
            log(f"layer {l + 1}/{m.n_layers} quantized (GPTQ on {len(tokens)} batches)")
    out_layers = dict(layers)
    for name, per_layer in quantized.items():
        out_layers[name] = _stack(per_layer)
    return {**params, "layers": out_layers}


# ----------------------------------------------------------------------------- the command


def quantized_config(config, fmt: str, group_size: int, zero_point: bool):
    out = copy.deepcopy(config)
    out.model.quant, out.model.quant_group_size, out.model.quant_zero_point = fmt, group_size, zero_point
    out.model.quant_train = "none"
    out.train.virtual_stages = 1  # quantized layers are stored [L, ...] whatever the source's schedule
    if out.mesh.pipe > 1 and out.train.pipeline_schedule == "interleaved_1f1b":
        out.train.pipeline_schedule = "1f1b"
    return out


def quantize_workdir(
    workdir: str,
    out: str,
    fmt: str,
    method: str = "rtn",
    group_size: int = 128,
    zero_point: bool = False,
    calibration_batches: int = 8,
    step: int | None = None,
    log=print,
) -> dict:
    """Read `workdir`'s checkpoint (default: latest) onto one device, quantize it, write `out`.
    Returns a summary (step, bytes before and after, seconds)."""
    from jaxsys import program as program_lib
    from jaxsys.mesh import cpu_unless_accelerator, make_mesh

    cpu_unless_accelerator()
    if fmt not in QUANT_FORMATS[1:]:
        raise ConfigError(f"--format {fmt!r}: choose one of {QUANT_FORMATS[1:]}")
    if method not in METHODS:
        raise ConfigError(f"--method {method!r}: choose one of {METHODS}")
    checkpoint_lib.require_new_workdir(out)
    if not os.path.isdir(workdir):
        raise checkpoint_lib.CheckpointError(
            f"--workdir {workdir} does not exist: pass the workdir of a run "
            "(or one written by `python -m jaxsys.convert --from-hf`)"
        )
    reader = checkpoint_lib.Checkpointer(workdir, base_config().checkpoint, read_only=True)
    try:
        step = reader.latest_step() if step is None else step
        source = reader.saved_config(step)
        if source.model.quant != "none":
            raise ConfigError(
                f"{workdir} step {step} is already quantized (config.model.quant="
                f"{source.model.quant!r}): quantize the float checkpoint it came from"
            )
        target = quantized_config(source, fmt, group_size, zero_point)
        validate(target)  # group sizes against the model and the saved mesh, before any reading
        one = _single_device(source)
        program = program_lib.build(one, make_mesh(one, jax.devices()[:1]))
        start = time.perf_counter()
        params = reader.restore(program.abstract_state(), step).params
    finally:
        reader.close()
    m = one.model
    if method == "gptq":
        corpus = data_lib.load_corpus(one.data)
        qparams = gptq_params(params, one, corpus, fmt, group_size, zero_point, calibration_batches, log)
    else:
        qparams = quantize_params(jax.tree.map(np.asarray, params), m, fmt, group_size, zero_point)
    one_q = _single_device(target)
    program_q = program_lib.build(one_q, make_mesh(one_q, jax.devices()[:1]))
    abstract = program_q.abstract_state()
    qparams = jax.tree.map(lambda a, s: jax.device_put(np.asarray(a, s.dtype), s.sharding), qparams, abstract.params)
    state = program_lib.TrainState(jax.device_put(np.int32(step), abstract.step.sharding), qparams, optax.EmptyState())
    os.makedirs(out, exist_ok=True)
    writer = checkpoint_lib.Checkpointer(out, target.checkpoint)
    writer.save(step, state, target)
    writer.close()
    if jax.process_index() == 0:
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write(target.to_json_best_effort(indent=2))
    nbytes = lambda tree: sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))
    dense = lambda tree: {k: v for k, v in tree["layers"].items() if k in quant.CONTRACTED}
    return {
        "step": int(step),
        "format": fmt,
        "method": method,
        "group_size": group_size,
        "zero_point": zero_point,
        "dense_bytes_before": nbytes(dense(params)),
        "dense_bytes_after": nbytes(dense(qparams)),
        "total_bytes_before": nbytes(params),
        "total_bytes_after": nbytes(qparams),
        "seconds": time.perf_counter() - start,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Quantize a jaxsys checkpoint's dense layers into a new workdir.")
    parser.add_argument("--workdir", required=True, help="the float run (or converted HF model) to read")
    parser.add_argument("--out", required=True, help="the new workdir to write")
    parser.add_argument("--format", required=True, choices=QUANT_FORMATS[1:])
    parser.add_argument("--method", default="rtn", choices=METHODS)
    parser.add_argument("--group-size", type=int, default=128, help="w4a16: k per scale (32, 64, 128)")
    parser.add_argument("--zero-point", action="store_true", help="w4a16: asymmetric codes with a zero point")
    parser.add_argument(
        "--calibration-batches",
        type=int,
        default=8,
        help="gptq: training batches of the config's corpus to calibrate on",
    )
    parser.add_argument("--step", type=int, help="checkpoint step to read (default: latest)")
    args = parser.parse_args(argv)
    log = lambda msg: print(f"jaxsys.quantize: {msg}", file=sys.stderr, flush=True)
    try:
        summary = quantize_workdir(
            args.workdir,
            args.out,
            args.format,
            args.method,
            args.group_size,
            args.zero_point,
            args.calibration_batches,
            args.step,
            log,
        )
    except (ConfigError, checkpoint_lib.CheckpointError, data_lib.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"jaxsys: wrote {args.out} (step {summary['step']}, {args.format} by {args.method}): dense layers "
        f"{summary['dense_bytes_before'] / 2**20:.2f} -> {summary['dense_bytes_after'] / 2**20:.2f} MiB, "
        f"all parameters {summary['total_bytes_before'] / 2**20:.2f} -> "
        f"{summary['total_bytes_after'] / 2**20:.2f} MiB in {summary['seconds']:.1f}s; evaluate with\n"
        f"  python -m jaxsys.evaluate --workdir {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
