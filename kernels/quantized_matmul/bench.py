"""Quantized matmul throughput on one GPU: the W4A16, W8A16, W8A8 and W4A8 Pallas kernels (Triton) against
XLA's bf16 dot, at decode batch sizes, beside the bandwidth bound.

    python -m jaxsys.kernels.quantized_matmul.bench --out quantized_matmul_gpu.json --plot q.png
    python -m jaxsys.kernels.quantized_matmul.bench --models llama-7b --batches 1,16,128  # quicker
    python -m jaxsys.kernels.quantized_matmul.bench --from-json q.json --plot q.png  # replot
    python -m jaxsys.kernels.quantized_matmul.bench --interpret-smoke --out smoke.json  # no GPU
    python -m jaxsys.kernels.quantized_matmul.bench --split-k --out split.json  # split-K table
    python -m jaxsys.kernels.quantized_matmul.bench --split-k --interpret-smoke  # its path, no GPU

--split-k prints one table instead: per shape, batch M and format (--split-formats, default
w4a16,w8a16), the kernel with split-K chosen by itself (kernel.split_k_for, the split shown),
the kernel with split_k=1, XLA's bf16 dot, bf16 time / kernel time for both, and each kernel's max
error against reference.py; --extra-split-ks adds fixed splits; it stops after --budget-s (170 s)
and marks the rest skipped. The kernels in the default mode run as called: split-K automatic.

For each layer shape (K, N) of Llama-7B ((4096, 4096), (4096, 11008), (11008, 4096)) and
Llama-70B ((8192, 8192), (8192, 28672), (28672, 8192)) and each batch M in 1..128, it times

  bf16   jnp.dot(x, w), x [M, K] and w [K, N] bf16 (XLA's GEMM: cuBLAS or a Triton fusion)
  w8a16  kernel.matmul_w8a16: int8 codes, fp32 scale per channel, bf16 x
  w4a16  kernel.matmul_w4a16: 4-bit codes (kernel layout), fp32 scale per group of --group-size
         (default 128) per channel, symmetric, bf16 x
  w8a8   kernel.matmul_w8a8: int8 x and weights, int32 accumulate; x is quantized beforehand (the
         per-token quantization of x, a separate XLA fusion in a model, is not timed)
  w4a8   kernel.matmul_w4ax: int8 x per token (as w8a8) and w4a16's 4-bit weights, each group's
         int8 x int8 dot in int32, scaled per group in fp32

and reports per call: time, TFLOP/s (2 M K N / t), achieved GB/s (bytes moved / t), the speed-up
over bf16 at the same shape and batch, the ideal time max(bytes moved / HBM bandwidth, FLOPs /
peak) from the device's datasheet figures (jaxsys/analysis/hardware.py's table: bf16 peak for
the A16 formats, whose dots run in bf16; int8 peak for W8A8) and the ideal speed-up. Bytes moved =
weight bytes (codes + scales [+ zero points]) + activations in + out (`bytes_moved`). Per model the
layer times are also summed (as MARLIN's bench does) into one speed-up per batch.

Timing: as flash_attention/bench.py (jit, compile, two warm-up runs, then the median over
--repeats samples of enough back-to-back runs to take --min-time), with two changes for kernels of
a few microseconds. (1) One jitted program runs the matmul on C copies of the weights in sequence,
C large enough that the copies together exceed --l2-mib twice (H100: 50 MiB of L2; a 7B layer in
W4A16 is 8.4 MB and would otherwise be read from L2, not HBM), at least --min-copies; the time per
call is the program's time / C, so Python's dispatch cost is spread over C calls. Each call's
operands pass through lax.optimization_barrier so that XLA cannot merge the dots that share x.
(2) Block sizes: block_m is M's next power of two in [16, 128]; each of --block-ns is measured and
the fastest is reported (all rows are kept in the JSON, `best` marks the fastest).
Correctness: at the smallest and largest batch of each shape and format the kernel's output is
compared with reference.py (max |error| / max |reference|; bf16 outputs round to 2^-8).

On a machine without a GPU the script says so and exits 0; with --interpret-smoke it instead runs
one tiny shape per format in Pallas interpret mode end to end (results checked against the
reference; exit 1 on a mismatch).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsys.analysis import hardware
from jaxsys.kernels import platforms
from jaxsys.kernels.flash_attention.bench import median_seconds
from jaxsys.kernels.quantized_matmul import kernel
from jaxsys.kernels.quantized_matmul import reference as ref

FORMATS = ("bf16", "w8a16", "w4a16", "w8a8", "w4a8")
INT8_ACTIVATIONS = ("w8a8", "w4a8")  # x quantized per token beforehand; their dots use the int8 peak
SHAPES = {  # (K, N) of the transformer blocks' matmuls: qkv/o projection, gate/up, down
    "llama-7b": [(4096, 4096), (4096, 11008), (11008, 4096)],
    "llama-70b": [(8192, 8192), (8192, 28672), (28672, 8192)],
}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
SMOKE_SHAPES = {"smoke": [(256, 192)]}
TOLERANCE = 2.0**-7  # max |error| / max |reference|: bf16 outputs, one rounding each


# ----------------------------------------------------------------------------- the roofline


def bytes_moved(fmt: str, m: int, k: int, n: int, group_size: int = 128, zero_point: bool = False) -> dict:
    """HBM bytes of one x[M, K] @ W[K, N] in `fmt`, each operand read once and y written once:
    weights = codes + scales (+ zero points); activations in (bf16 x, or int8 x and fp32
    per-token scales for W8A8); out = bf16 y."""
    if fmt == "bf16":
        weights, x = 2 * k * n, 2 * m * k
    elif fmt == "w8a16":
        weights, x = k * n + 4 * n, 2 * m * k
    elif fmt == "w4a16":
        weights, x = k * n // 2 + 4 * (k // group_size) * n * (1 + zero_point / 4), 2 * m * k
    elif fmt == "w8a8":
        weights, x = k * n + 4 * n, m * k + 4 * m
    elif fmt == "w4a8":
        weights, x = k * n // 2 + 4 * (k // group_size) * n, m * k + 4 * m
    else:
        raise ValueError(f"unknown format {fmt!r}; choose from {FORMATS}")
    out = 2 * m * n
    return dict(weights=weights, activations=x, out=out, total=weights + x + out)


def flops(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n


def ideal_seconds(fmt: str, m: int, k: int, n: int, hw, group_size: int = 128) -> float:
    """max(bytes moved / HBM bandwidth, FLOPs / peak): int8 peak for W8A8, bf16 otherwise (the
    A16 kernels dot bf16 codes)."""
    peak = hw.peak("int8" if fmt in INT8_ACTIVATIONS else "bfloat16")
    return max(bytes_moved(fmt, m, k, n, group_size)["total"] / hw.hbm_bytes_per_s, flops(m, k, n) / peak)


def hardware_for(device):
    """The datasheet profile of a device (analysis/hardware.py `for_device`), or None if unknown."""
    return hardware.for_device(device)


# ----------------------------------------------------------------------------- operands and calls


def block_m_for(m: int) -> int:
    return max(16, min(128, 1 << max(m - 1, 1).bit_length()))


def make_data(fmt, m, k, key):
    """The activation operands of one call: (x,) bf16, or (xq, sx) for W8A8 and W4A8."""
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    if fmt in INT8_ACTIVATIONS:
        return ref.quantize_per_token(x)
    return (x,)


def make_weights(fmt, k, n, group_size, key):
    """Random weights in `fmt` (random bytes are valid 4-bit codes in either nibble layout)."""
    kq, ks = jax.random.split(key)
    if fmt == "bf16":
        return (jax.random.normal(kq, (k, n), jnp.bfloat16) * 0.02,)
    if fmt in ("w8a16", "w8a8"):
        q = jax.random.randint(kq, (k, n), -127, 128, jnp.int32).astype(jnp.int8)
        return q, jax.random.uniform(ks, (n,), jnp.float32, 1e-4, 1e-3)
    packed = jax.random.bits(kq, (k // 2, n), jnp.uint8)
    return packed, jax.random.uniform(ks, (k // group_size, n), jnp.float32, 1e-3, 1e-2)


def call_fn(fmt, m, block_n, args):
    """(data, weights) -> y for one format: the kernels with interpret / backend as asked."""
    interp = True if args.interpret_smoke else False
    common = dict(block_n=block_n, interpret=interp, backend="generic")
    if fmt == "bf16":
        return lambda data, w: jnp.dot(data[0], w[0], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    if fmt == "w8a16":
        return lambda data, w: kernel.matmul_w8a16(data[0], *w, block_m=block_m_for(m), **common)
    if fmt == "w4a16":
        return lambda data, w: kernel.matmul_w4a16(data[0], *w, block_m=block_m_for(m), **common)
    if fmt == "w4a8":
        return lambda data, w: kernel.matmul_w4ax(
            *data, *w, None, jnp.bfloat16, block_m=max(32, block_m_for(m)), **common
        )
    return lambda data, w: kernel.matmul_w8a8(*data, *w, jnp.bfloat16, block_m=max(32, block_m_for(m)), **common)


def reference_fn(fmt, group_size):
    if fmt == "bf16":
        return lambda data, w: jnp.dot(
            data[0].astype(jnp.float32), w[0].astype(jnp.float32), precision=lax.Precision.HIGHEST
        ).astype(jnp.bfloat16)
    if fmt == "w8a16":
        return lambda data, w: ref.matmul_w8a16(data[0], *w)
    if fmt == "w4a16":
        return lambda data, w: ref.matmul_w4a16(data[0], ref.unrepack_w4(w[0], group_size), w[1])
    if fmt == "w4a8":
        return lambda data, w: ref.matmul_w4ax(*data, ref.unrepack_w4(w[0], group_size), w[1], None, jnp.bfloat16)
    return lambda data, w: ref.matmul_w8a8(*data, *w, jnp.bfloat16)


def copies_for(fmt, k, n, args) -> int:
    """Weight copies per timed program: together over twice the L2, at least --min-copies."""
    weight_bytes = bytes_moved(fmt, 1, k, n, args.group_size)["weights"]
    return int(min(args.max_copies, max(args.min_copies, math.ceil(2 * args.l2_mib * 2**20 / weight_bytes))))


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


# ----------------------------------------------------------------------------- measuring


def measure_shape(model, k, n, args, hw, key):
    """All rows of one layer shape: every format, batch and block_n."""
    rows = []
    for fi, fmt in enumerate(args.formats):
        copies = copies_for(fmt, k, n, args)
        keys = jax.random.split(jax.random.fold_in(key, fi), copies + 1)
        weights = [make_weights(fmt, k, n, args.group_size, kk) for kk in keys[:copies]]
        for m in args.batches:
            data = make_data(fmt, m, k, keys[-1])
            moved = bytes_moved(fmt, m, k, n, args.group_size)
            base = dict(
                model=model,
                K=k,
                N=n,
                M=m,
                format=fmt,
                copies=copies,
                bytes=moved["total"],
                weight_bytes=moved["weights"],
            )
            if hw is not None:
                base["ideal_us"] = ideal_seconds(fmt, m, k, n, hw, args.group_size) * 1e6
            block_ns = [None] if fmt == "bf16" else args.block_ns
            check = m in (min(args.batches), max(args.batches))
            for bn in block_ns:
                row = dict(base, block_n=bn)
                fn = call_fn(fmt, m, bn, args)
                many = jax.jit(lambda d, ws, fn=fn: [fn(*lax.optimization_barrier((d, w))) for w in ws])
                try:
                    if check:
                        row["max_rel_err"] = rel_err(
                            jax.jit(fn)(data, weights[0]), jax.jit(reference_fn(fmt, args.group_size))(data, weights[0])
                        )
                        check = False  # one block_n is enough: the kernel body is the same
                    seconds = median_seconds(many, (data, weights), args.repeats, args.min_time) / copies
                    row |= dict(
                        us=seconds * 1e6, tflops=flops(m, k, n) / seconds / 1e12, gbps=moved["total"] / seconds / 1e9
                    )
                    if "ideal_us" in row:
                        row["roofline_frac"] = row["ideal_us"] / row["us"]
                except Exception as e:  # one failing configuration must not lose the others
                    row["error"] = platforms.error_line(e)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        del weights
    return rows


def finish(rows, hw=None, group_size=128):
    """Mark the fastest block_n per (shape, batch, format) `best` and add the speed-ups over bf16
    (measured, and ideal when the device's figures are known)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["K"], r["N"], r["M"], r["format"]), []).append(r)
    best = {}
    for key, rs in groups.items():
        timed = [r for r in rs if "us" in r]
        for r in rs:
            r["best"] = False
        if timed:
            b = min(timed, key=lambda r: r["us"])
            b["best"] = True
            best[key] = b
    for (model, k, n, m, fmt), r in best.items():
        base = best.get((model, k, n, m, "bf16"))
        if base is not None:
            r["speedup_vs_bf16"] = base["us"] / r["us"]
            if "ideal_us" in r and "ideal_us" in base:
                r["ideal_speedup"] = base["ideal_us"] / r["ideal_us"]
    return rows


def per_model(rows):
    """Sum of the layer shapes' best times per (model, batch, format) and the speed-ups over bf16:
    {model: {fmt: {M: dict(us, ideal_us, speedup, ideal_speedup)}}}."""
    out = {}
    for r in rows:
        if not r.get("best"):
            continue
        cell = (
            out.setdefault(r["model"], {})
            .setdefault(r["format"], {})
            .setdefault(r["M"], dict(us=0.0, ideal_us=0.0, shapes=0))
        )
        cell["us"] += r["us"]
        cell["ideal_us"] += r.get("ideal_us", float("nan"))
        cell["shapes"] += 1
    for model, fmts in out.items():
        for fmt, by_m in fmts.items():
            for m, cell in by_m.items():
                base = fmts.get("bf16", {}).get(m)
                if base and base["shapes"] == cell["shapes"]:
                    cell["speedup"] = base["us"] / cell["us"]
                    cell["ideal_speedup"] = base["ideal_us"] / cell["ideal_us"]
    return out


# ----------------------------------------------------------------------------- split-K side by side

SPLIT_FORMATS = ("w4a16", "w8a16")
SPLIT_SMOKE_SHAPES = {"smoke": [(1024, 192)]}  # 8 K blocks: 2 splits at M = 1 with 132 SMs


def split_k_call(fmt, m, split_k, args):
    """(data, weights) -> y of one kernel at a given split_k (1: the unsplit kernel)."""
    common = dict(block_n=args.split_block_n, split_k=split_k, interpret=bool(args.interpret_smoke), backend="generic")
    if fmt == "w8a16":
        return lambda data, w: kernel.matmul_w8a16(data[0], *w, block_m=block_m_for(m), **common)
    if fmt == "w4a16":
        return lambda data, w: kernel.matmul_w4a16(data[0], *w, block_m=block_m_for(m), **common)
    if fmt == "w4a8":
        return lambda data, w: kernel.matmul_w4ax(*data, *w, None, jnp.bfloat16, block_m=block_m_for(m), **common)
    return lambda data, w: kernel.matmul_w8a8(*data, *w, jnp.bfloat16, block_m=block_m_for(m), **common)


def chosen_split_k(fmt, m, k, n, args, cores) -> int:
    """The split the kernel picks by itself for this call (kernel.split_k_for, as _plan does)."""
    return kernel.split_k_for(
        m,
        k,
        n,
        block_m=block_m_for(m),
        block_n=args.split_block_n,
        group_size=args.group_size if fmt in ("w4a16", "w4a8") else 0,
        cores=cores,
    )


def _timed(fn, data, weights, args):
    """(seconds per call, the first copy's output): one program over all weight copies."""
    many = jax.jit(lambda d, ws: [fn(*lax.optimization_barrier((d, w))) for w in ws])
    first = many(data, weights)[0]
    return median_seconds(many, (data, weights), args.repeats, args.min_time) / len(weights), first


def measure_split_k_shape(model, k, n, args, hw, key, cores, deadline):
    """Rows of one layer shape: per batch M and format, the kernel with split-K chosen by itself
    and with split_k=1, XLA's bf16 dot, the ratios bf16 time / kernel time, and each kernel's max
    error against reference.py (on the first weight copy). The reference runs once per format, at
    the largest M; smaller M compare with its first rows (rows of a matmul are independent)."""
    rows = []
    batches = sorted(args.batches)
    if time.monotonic() > deadline:  # not even the weights: making them takes time too
        return [
            dict(model=model, K=k, N=n, M=m, format=fmt, error="skipped: past --budget-s")
            for fmt in args.split_formats
            for m in batches
        ]
    kx, kw = jax.random.split(key)
    x_all = jax.random.normal(kx, (batches[-1], k), jnp.bfloat16)
    bf16_copies = copies_for("bf16", k, n, args)
    bf16_w = [make_weights("bf16", k, n, args.group_size, kk) for kk in jax.random.split(kw, bf16_copies)]
    bf16_fn = call_fn("bf16", 1, None, args)
    bf16_us = {}
    for m in batches:
        if time.monotonic() > deadline:
            break
        bf16_us[m] = _timed(bf16_fn, (x_all[:m],), bf16_w, args)[0] * 1e6
    del bf16_w
    for fi, fmt in enumerate(args.split_formats):
        copies = copies_for(fmt, k, n, args)
        weights = [
            make_weights(fmt, k, n, args.group_size, kk)
            for kk in jax.random.split(jax.random.fold_in(kw, fi + 1), copies)
        ]
        full = make_data(fmt, batches[-1], k, kx) if fmt in INT8_ACTIVATIONS else (x_all,)
        want = np.asarray(jax.jit(reference_fn(fmt, args.group_size))(full, weights[0]), np.float32)
        for m in batches:
            if m not in bf16_us or time.monotonic() > deadline:
                rows.append(dict(model=model, K=k, N=n, M=m, format=fmt, error="skipped: past --budget-s"))
                continue
            data = tuple(a[:m] for a in full)
            auto = chosen_split_k(fmt, m, k, n, args, cores)
            row = dict(model=model, K=k, N=n, M=m, format=fmt, copies=copies, split_k=auto, bf16_us=bf16_us[m])
            if hw is not None:
                row["ideal_speedup"] = ideal_seconds("bf16", m, k, n, hw) / ideal_seconds(
                    fmt, m, k, n, hw, args.group_size
                )
            try:
                us1, out1 = _timed(split_k_call(fmt, m, 1, args), data, weights, args)
                row |= dict(us_split1=us1 * 1e6, err_split1=rel_err(out1, want[:m]))
                if auto == 1:  # the same kernel: not timed twice
                    row |= dict(us_auto=row["us_split1"], err_auto=row["err_split1"])
                else:
                    usa, outa = _timed(split_k_call(fmt, m, auto, args), data, weights, args)
                    row |= dict(us_auto=usa * 1e6, err_auto=rel_err(outa, want[:m]))
                for extra in args.extra_split_ks:  # fixed splits beside the chosen one, to tune the chooser
                    if extra not in (1, auto):
                        use, oute = _timed(split_k_call(fmt, m, extra, args), data, weights, args)
                        row[f"us_split{extra}"] = use * 1e6
                        row["err_extra_max"] = max(row.get("err_extra_max", 0.0), rel_err(oute, want[:m]))
                row |= dict(
                    speedup_auto=row["bf16_us"] / row["us_auto"],
                    speedup_split1=row["bf16_us"] / row["us_split1"],
                    gbps_auto=bytes_moved(fmt, m, k, n, args.group_size)["total"] / row["us_auto"] / 1e3,
                )
            except Exception as e:  # one failing configuration must not lose the others
                row["error"] = platforms.error_line(e)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        del weights
    return rows


def markdown_split_k(rows) -> str:
    extras = sorted({int(key[8:]) for r in rows for key in r if key.startswith("us_split") and key != "us_split1"})
    lines = [
        "| model | K | N | M | format | splits | auto µs | split_k=1 µs | bf16 µs | bf16/auto "
        "| bf16/split_k=1 | ideal × | GB/s auto | max err auto | max err split_k=1 | note |"
        + "".join(f" split_k={e} µs |" for e in extras),
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|" + "---:|" * len(extras),
    ]
    f = lambda r, key, spec: format(r[key], spec) if r.get(key) is not None else "-"
    for r in rows:
        errs = (r.get("err_auto"), r.get("err_split1"), r.get("err_extra_max"))
        bad = [e for e in errs if e is not None and e > TOLERANCE]
        note = (r.get("error", "") + (" MISMATCH" if bad else "")).strip()
        lines.append(
            f"| {r['model']} | {r['K']} | {r['N']} | {r['M']} | {r['format']} | {f(r, 'split_k', 'd')} "
            f"| {f(r, 'us_auto', '.1f')} | {f(r, 'us_split1', '.1f')} | {f(r, 'bf16_us', '.1f')} "
            f"| {f(r, 'speedup_auto', '.2f')} | {f(r, 'speedup_split1', '.2f')} | {f(r, 'ideal_speedup', '.2f')} "
            f"| {f(r, 'gbps_auto', '.0f')} | {f(r, 'err_auto', '.1e')} | {f(r, 'err_split1', '.1e')} | {note} |"
            + "".join(f" {f(r, f'us_split{e}', '.1f')} |" for e in extras)
        )
    return "\n".join(lines)


def main_split_k(args, device, hw, backend, argv) -> int:
    """--split-k: the side-by-side table (markdown_split_k), within --budget-s."""
    shapes = {m: SHAPES[m] for m in args.models}
    cores = args.cores if args.cores is not None else kernel.device_cores()
    if args.interpret_smoke:
        shapes, args.batches = SPLIT_SMOKE_SHAPES, [1, 5]
        args.repeats, args.min_time, args.min_copies, args.max_copies = 1, 0.0, 2, 2
        cores = 132 if cores is None else cores  # pretend an H100 so that the automatic split splits
    start = time.monotonic()
    deadline = start + args.budget_s
    rows = []
    key = jax.random.PRNGKey(0)
    # the models' shapes interleaved (7B qkv, 70B qkv, 7B up, ...): a --budget-s cut leaves both covered
    order = sorted(
        ((i, model, k, n) for model, ls in shapes.items() for i, (k, n) in enumerate(ls)), key=lambda t: t[0]
    )
    for i, model, k, n in order:
        rows += measure_split_k_shape(model, k, n, args, hw, jax.random.fold_in(key, i), cores, deadline)
        print(f"[{time.monotonic() - start:.0f} s] {model} {k}x{n} done", file=sys.stderr, flush=True)
    print(
        f"\n{device.device_kind} ({backend}), {cores} SMs, jax {jax.__version__}; W4A16 group size "
        f"{args.group_size}; block_n {args.split_block_n}; {time.monotonic() - start:.0f} s\n"
    )
    print(markdown_split_k(rows))
    if args.out:
        record = platforms.bench_record(
            "jaxsys.kernels.quantized_matmul.bench",
            argv,
            cores=cores,
            interpret_smoke=args.interpret_smoke,
            args=vars(args),
            results=rows,
        )
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"\nwrote {args.out}")
    errs = lambda r: (r.get("err_auto", 0.0), r.get("err_split1", 0.0), r.get("err_extra_max", 0.0))
    bad = [r for r in rows if "error" in r or max(errs(r)) > TOLERANCE]
    if args.interpret_smoke and bad:
        print(f"\n{len(bad)} rows failed or differ from the reference", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- output


def markdown(rows) -> str:
    lines = [
        "| model | K | N | M | format | block_n | µs | TFLOP/s | GB/s | × bf16 | ideal µs "
        "| ideal × | of roofline | note |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    f = lambda r, key, spec: format(r[key], spec) if r.get(key) is not None else "-"
    for r in rows:
        if not r.get("best") and "error" not in r:
            continue
        note = r.get("error", "")
        if "max_rel_err" in r:
            note = (
                note + f" err {r['max_rel_err']:.1e}" + (" MISMATCH" if r["max_rel_err"] > TOLERANCE else "")
            ).strip()
        lines.append(
            f"| {r['model']} | {r['K']} | {r['N']} | {r['M']} | {r['format']} "
            f"| {f(r, 'block_n', 'd')} | {f(r, 'us', '.1f')} | {f(r, 'tflops', '.2f')} "
            f"| {f(r, 'gbps', '.0f')} | {f(r, 'speedup_vs_bf16', '.2f')} "
            f"| {f(r, 'ideal_us', '.1f')} | {f(r, 'ideal_speedup', '.2f')} "
            f"| {f(r, 'roofline_frac', '.0%')} | {note} |"
        )
    return "\n".join(lines)


def markdown_models(summary) -> str:
    lines = []
    for model, fmts in summary.items():
        quant = [f for f in FORMATS if f in fmts and f != "bf16"]
        batches = sorted({m for f in fmts.values() for m in f})
        lines += [
            f"\n{model}: speed-up over bf16 of the summed layer times, measured (ideal)\n",
            "| M | bf16 µs | " + " | ".join(quant) + " |",
            "|---:|---:|" + "---:|" * len(quant),
        ]
        for m in batches:
            base = fmts.get("bf16", {}).get(m, {})
            cells = []
            for fmt in quant:
                c = fmts[fmt].get(m, {})
                cells.append(f"{c['speedup']:.2f} ({c['ideal_speedup']:.2f})" if "speedup" in c else "-")
            lines.append(f"| {m} | {base.get('us', float('nan')):.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(record, path) -> bool:
    """Speed-up over bf16 vs batch per model: measured (solid) and ideal (dashed) for each
    format. Returns False (and says so) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    summary = per_model(record["results"])
    fig, axes = plt.subplots(1, max(1, len(summary)), figsize=(6 * max(1, len(summary)), 4.5), squeeze=False)
    colors = {"w8a16": "tab:blue", "w4a16": "tab:red", "w8a8": "tab:green", "w4a8": "tab:purple"}
    for ax, (model, fmts) in zip(axes[0], summary.items()):
        for fmt, by_m in fmts.items():
            if fmt == "bf16":
                continue
            ms = sorted(m for m in by_m if "speedup" in by_m[m])
            ax.plot(ms, [by_m[m]["speedup"] for m in ms], "o-", color=colors[fmt], label=f"{fmt} measured")
            ax.plot(ms, [by_m[m]["ideal_speedup"] for m in ms], "--", color=colors[fmt], label=f"{fmt} ideal")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch M (tokens)")
        ax.set_ylabel("speed-up over bf16 (summed layers)")
        ax.set_title(f"{model} on {record['device']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return True


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=lambda s: s.split(","), default=list(SHAPES))
    p.add_argument("--batches", type=ints, default=list(BATCHES))
    p.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS))
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--block-ns", type=ints, default=[64, 128])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.02, help="seconds per timing sample")
    p.add_argument("--l2-mib", type=float, default=50.0, help="the GPU's L2 (H100: 50 MiB)")
    p.add_argument("--min-copies", type=int, default=4)
    p.add_argument("--max-copies", type=int, default=16)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="write a speed-up vs batch plot here (matplotlib)")
    p.add_argument("--from-json", default=None, help="no measuring: table and plot from this JSON")
    p.add_argument(
        "--split-k",
        action="store_true",
        help="side by side per shape and batch: split-K chosen by itself, split_k=1, XLA's bf16 dot",
    )
    p.add_argument("--split-formats", type=lambda s: s.split(","), default=list(SPLIT_FORMATS))
    p.add_argument("--split-block-n", type=int, default=128, help="--split-k: the kernels' block_n")
    p.add_argument("--cores", type=int, default=None, help="--split-k: SMs to choose splits for (default: the GPU's)")
    p.add_argument("--budget-s", type=float, default=170.0, help="--split-k: stop measuring after this long")
    p.add_argument(
        "--extra-split-ks",
        type=ints,
        default=[],
        help="--split-k: also time these fixed splits (us_split<S> in the JSON and table)",
    )
    p.add_argument(
        "--interpret-smoke",
        action="store_true",
        help="no GPU needed: one tiny shape per format in Pallas interpret mode",
    )
    return p.parse_args(argv)


def report(record, plot_path=None) -> None:
    print(
        f"\n{record['device']} ({record['backend']}), jax {record['jax']}; W4A16 group size "
        f"{record['args']['group_size']}; ideal = max(bytes / HBM BW, FLOPs / peak)\n"
    )
    print(markdown(record["results"]))
    print(markdown_models(per_model(record["results"])))
    if plot_path:
        plot(record, plot_path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            report(json.load(f), args.plot)
        return 0
    unknown = [f for f in args.formats if f not in FORMATS] + [f for f in args.split_formats if f not in FORMATS[1:]]
    unknown += [m for m in args.models if m not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown formats/models {unknown}: formats {FORMATS}, models {list(SHAPES)}")
    backend = jax.default_backend()
    shapes = {m: SHAPES[m] for m in args.models}
    if args.interpret_smoke:
        shapes, args.batches, args.block_ns = SMOKE_SHAPES, [1, 5], [64]
        args.repeats, args.min_time, args.min_copies, args.max_copies = 1, 0.0, 2, 2
    elif backend != "gpu":
        print(
            f"bench.py measures GPU kernels; the default JAX backend here is {backend!r}, so "
            "nothing was measured. Run it on a GPU machine, or pass --interpret-smoke to check "
            "the script in Pallas interpret mode."
        )
        return 0
    device = jax.devices()[0]
    hw = hardware_for(device)
    if args.split_k:
        return main_split_k(args, device, hw, backend, argv)
    rows = []
    key = jax.random.PRNGKey(0)
    for model, layer_shapes in shapes.items():
        for i, (k, n) in enumerate(layer_shapes):
            rows += measure_shape(model, k, n, args, hw, jax.random.fold_in(key, i))
    finish(rows)
    record = platforms.bench_record(
        "jaxsys.kernels.quantized_matmul.bench",
        argv,
        numpy=np.__version__,
        hardware=None
        if hw is None
        else dict(name=hw.name, hbm_bytes_per_s=hw.hbm_bytes_per_s, peak_flops=hw.peak_flops),
        bytes_convention="weights (codes + scales [+ zeros]) + activations in + bf16 out, once each",
        interpret_smoke=args.interpret_smoke,
        args=vars(args),
        results=rows,
        per_model=per_model(rows),
    )
    report(record, args.plot)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"\nwrote {args.out}")
    bad = [r for r in rows if "error" in r or r.get("max_rel_err", 0.0) > TOLERANCE]
    if args.interpret_smoke and bad:
        print(f"\n{len(bad)} rows failed or differ from the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
