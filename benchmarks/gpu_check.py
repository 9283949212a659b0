"""Every Pallas kernel compiled for the device it runs on, checked against its pure-JAX reference.

    python benchmarks/gpu_check.py [--out gpu_check.json] [--small]

On a GPU the kernels lower to Triton; on a CPU they run in interpret mode (`--small` keeps that
quick: it is how the script itself is smoke-tested). Each check compiles the kernel, runs it on
random inputs and reports max |kernel - reference| / max |reference| beside the tolerance it must
meet; one failing check does not stop the others. Exit status 1 if any check fails. `--out` is
rewritten after each check; its `completed` lists the checks that ran to the end (passed or not),
which benchmarks/gpu_kernels.sh reads to decide whether the Mosaic GPU kernels can be benched.

Tolerances: bf16 operands with fp32 accumulation on both sides, so the two differ by the rounding
of the bf16 output (2^-8 relative) plus accumulation order: 2^-6 for attention outputs and
gradients (sums over thousands of terms), 2^-7 for the quantized matmuls (one bf16 rounding of the
same integer products), 1e-3 for fp32 linear attention.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.kernels import platforms, tuning
from jaxsys.kernels.flash_attention import flash_attention, kernel_mgpu, reference_attention
from jaxsys.kernels.linear_attention import chunked, linear_attention
from jaxsys.kernels.paged_attention.kernel import paged_attention
from jaxsys.kernels.paged_attention.reference import paged_attention_reference
from jaxsys.kernels.quantized_matmul import kernel as qk
from jaxsys.kernels.quantized_matmul import reference as qr


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def worst(got_tree, want_tree) -> float:
    return max(rel_err(g, w) for g, w in zip(jax.tree.leaves(got_tree), jax.tree.leaves(want_tree)))


FLASH_CASES = ((64, True), (64, False), (128, True), (128, False))  # (H, causal)


def check_flash(small: bool, backend=None, cases=FLASH_CASES):
    t = 256 if small else 2048
    for h, causal in cases:
        block = 128 if h == 64 else 64
        keys = jax.random.split(jax.random.key(h + causal), 4)
        q = jax.random.normal(keys[0], (2, t, 8, h), jnp.bfloat16)
        k = jax.random.normal(keys[1], (2, t, 2, h), jnp.bfloat16)
        v = jax.random.normal(keys[2], (2, t, 2, h), jnp.bfloat16)
        do = jax.random.normal(keys[3], (2, t, 8, h), jnp.bfloat16)
        kernel = lambda q, k, v: flash_attention(
            q, k, v, causal=causal, block_q=block, block_k=block, backend=backend, interpret=small or None
        )
        ref = lambda q, k, v: reference_attention(q, k, v, causal=causal)
        fwd_bwd = lambda f: jax.jit(lambda q, k, v, do: (f(q, k, v), jax.vjp(f, q, k, v)[1](do)))
        got, want = fwd_bwd(kernel)(q, k, v, do), fwd_bwd(ref)(q, k, v, do)
        yield (
            f"flash{' ' + backend if backend else ''} T={t} H={h} N=8 K=2 causal={causal} block={block}: output",
            rel_err(got[0], want[0]),
            2.0**-6,
        )
        yield (
            f"flash{' ' + backend if backend else ''} T={t} H={h} N=8 K=2 causal={causal} block={block}: dq dk dv",
            worst(got[1], want[1]),
            2.0**-6,
        )


def _mosaic_gpu_or_interpreter(small: bool) -> None:
    if not small and kernel_mgpu.gpu_capability() is None:
        raise RuntimeError("the Mosaic GPU flash kernels need a Hopper GPU (compute capability 9.x)")


def _mosaic_own_checks(cases):
    """kernel_mgpu.check_on_gpu at T = 2048 for (H, segments) cases, as (what, error, tolerance)."""
    for h, segments in cases:
        errs = kernel_mgpu.check_on_gpu(t=2048, h=h, causal=True, segments=segments)
        what = f"flash mosaic_gpu T=2048 H={h} N=4 K=2 causal{' segments' if segments else ''}"
        yield f"{what}: output", errs["o_err"] / errs["o_max"], 2.0**-6
        grads = [n for n in ("dq", "dk", "dv") if f"{n}_err" in errs]
        yield f"{what}: {' '.join(grads)}", max(errs[f"{n}_err"] / errs[f"{n}_max"] for n in grads), 2.0**-6


def check_flash_mosaic(small: bool):
    """The Hopper (Mosaic GPU) kernels, forced, with the split backward (a dQ kernel beside dK/dV):
    on a GPU they need compute capability 9.x; --small runs them in Pallas' GPU interpreter on CPU.
    One of the four cases through flash_attention, then the kernels' own checks (each set compiles
    three kernels); the bench's error columns cover the rest. gpu_kernels.sh gates the Mosaic
    columns on this check, and the fused backward's on the next, within its time limit."""
    _mosaic_gpu_or_interpreter(small)
    with kernel_mgpu.backward_variant("split"):
        yield from check_flash(small, backend="mosaic_gpu", cases=((128, True),))
        if not small:  # packed documents (segment ids) at H = 128, and H = 256 (split only)
            yield from _mosaic_own_checks(((128, True), (256, False)))


def check_flash_mosaic_fused(small: bool):
    """The fused Mosaic backward (dQ added by TMA reduce-add from the dK/dV kernel into an aliased
    fp32 accumulator: the one part of it Pallas' interpreter cannot run), at H = 128 (the bench's
    error columns have H = 64)."""
    _mosaic_gpu_or_interpreter(small)
    with kernel_mgpu.backward_variant("fused"):
        yield from check_flash(small, backend="mosaic_gpu", cases=((128, True),))
        if not small:
            yield from _mosaic_own_checks(((128, True),))


def write_split_override(folder: str) -> str:
    """A tuning-cache file for this device in `folder` (for JAXSYS_TUNING_DIR) that sends every
    shape class of the Hopper kernels to the split backward: what gpu_kernels.sh sets when the
    fused backward fails its check, so that training still runs the Mosaic GPU kernels."""
    kind = tuning.current_device_kind()
    classes = itertools.product((64, 128), ("bfloat16", "float16"), (False, True), (2**i for i in range(4, 17)))
    entries = {
        tuning.shape_key(tuning.flash_attention_class(head_dim=h, dtype=d, causal=c, seq_len=t)): {
            "config": {"backward": "split"}
        }
        for h, d, c, t in classes
    }
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, tuning.device_file_name(kind) + ".json")
    header = {"note": "written by benchmarks/gpu_check.py --split-override: the fused backward failed its check"}
    with open(path, "w") as f:
        record = dict(format=tuning.FORMAT_VERSION, device_kind=kind, header=header)
        json.dump(record | dict(kernels={"flash_attention_mgpu": entries}), f, indent=1)
    return path


def check_linear(small: bool):
    t = 256 if small else 4096
    keys = jax.random.split(jax.random.key(1), 4)
    q, k = (jax.random.normal(keys[i], (2, t, 4, 64), jnp.float32) * 0.3 for i in range(2))
    v = jax.random.normal(keys[2], (2, t, 4, 64), jnp.float32)
    log_decay = -jnp.linspace(0.01, 0.2, 4)
    f = lambda q, k, v, ld: linear_attention(q, k, v, log_decay=ld, chunk_size=64)[0]
    ref = lambda q, k, v, ld: chunked(q, k, v, chunk_size=64, log_decay=ld)[0]
    do = jax.random.normal(keys[3], v.shape, jnp.float32)
    fb = lambda fn: jax.jit(lambda *a: (fn(*a), jax.vjp(fn, *a)[1](do)))
    got, want = fb(f)(q, k, v, log_decay), fb(ref)(q, k, v, log_decay)
    yield f"linear attention T={t} N=4 H=64 decay: output", rel_err(got[0], want[0]), 1e-3
    yield f"linear attention T={t} N=4 H=64 decay: dq dk dv dlog_decay", worst(got[1], want[1]), 1e-3


def check_quantized(small: bool):
    m_list, (k, n) = ((1, 16), (256, 256)) if small else ((1, 16, 128), (4096, 4096))
    keys = jax.random.split(jax.random.key(2), 2)
    w = jax.random.normal(keys[0], (k, n), jnp.float32) * 0.05
    q8, s8 = qr.quantize_w8(w)
    q4, s4, z4 = qr.quantize_w4(w, 128, zero_point=True)
    packed = qr.repack_w4(qr.pack_int4(q4), 128)
    wq, sw = qr.quantize_w8(w)
    # split_k None: chosen from the SM count (split at M <= 64 on a GPU, 1 on CPU); 2: forced
    for m, split_k in [(m, None) for m in m_list] + [(m_list[0], 2)]:
        x = jax.random.normal(jax.random.fold_in(keys[1], m), (m, k), jnp.bfloat16)
        split = dict(split_k=split_k)
        label = f"M={m} K={k} N={n} split_k={split_k or 'auto'}"
        yield (
            f"w8a16 {label}",
            rel_err(jax.jit(functools.partial(qk.matmul_w8a16, **split))(x, q8, s8), qr.matmul_w8a16(x, q8, s8)),
            2.0**-7,
        )
        w4 = jax.jit(functools.partial(qk.matmul_w4a16, **split))
        yield (
            f"w4a16 G=128 zero point {label}",
            rel_err(w4(x, packed, s4, z4), qr.matmul_w4a16(x, qr.pack_int4(q4), s4, z4)),
            2.0**-7,
        )
        xq, sx = qr.quantize_per_token(x)
        yield (
            f"w8a8 {label}",
            rel_err(
                jax.jit(functools.partial(qk.matmul_w8a8, **split))(xq, sx, wq, sw), qr.matmul_w8a8(xq, sx, wq, sw)
            ),
            2.0**-7,
        )


def check_paged(small: bool):
    b, pages, page_size, kh, n, h = (4, 32, 16, 2, 8, 64) if small else (32, 1024, 16, 8, 32, 128)
    max_pages = pages // b
    keys = jax.random.split(jax.random.key(3), 4)
    k_pages = jax.random.normal(keys[0], (pages, page_size, kh, h), jnp.bfloat16)
    v_pages = jax.random.normal(keys[1], (pages, page_size, kh, h), jnp.bfloat16)
    q = jax.random.normal(keys[2], (b, n, h), jnp.bfloat16)
    table = jax.random.permutation(keys[3], pages).reshape(b, max_pages).astype(jnp.int32)
    lengths = jnp.asarray(np.linspace(1, max_pages * page_size, b).astype(np.int32))
    got = jax.jit(paged_attention)(q, k_pages, v_pages, table, lengths)
    want = paged_attention_reference(q, k_pages, v_pages, table, lengths)
    yield f"paged attention B={b} pages={pages}x{page_size} N={n} K={kh} H={h}", rel_err(got, want), 2.0**-6


CHECKS = {
    "flash": check_flash,
    "flash_mosaic": check_flash_mosaic,
    "flash_mosaic_fused": check_flash_mosaic_fused,
    "linear": check_linear,
    "quantized": check_quantized,
    "paged": check_paged,
}


def _write(path, device, rows, completed) -> None:
    """The JSON record so far: rewritten after every check, so a step cut by its time limit (a
    kernel that hangs) keeps the checks before it, and `completed` says which ran to the end."""
    with open(path, "w") as f:
        record = dict(device=f"{device.platform} {getattr(device, 'device_kind', '')}", jax=jax.__version__)
        json.dump(record | dict(rows=rows, completed=completed), f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--small", action="store_true", help="small shapes (CPU interpret-mode smoke run)")
    p.add_argument("--only", default=",".join(CHECKS))
    p.add_argument("--split-override", metavar="DIR", help="write write_split_override's file into DIR and exit")
    args = p.parse_args(argv)
    if args.split_override:
        print(f"wrote {write_split_override(args.split_override)}")
        return 0
    device = jax.devices()[0]
    print(f"device: {device.platform} {getattr(device, 'device_kind', '')}, jax {jax.__version__}", flush=True)
    rows: list[dict] = []
    completed: list[str] = []  # checks that ran every case without an exception (pass or fail)
    for name in args.only.split(","):
        start = time.perf_counter()
        try:
            for what, err, tol in CHECKS[name](args.small):
                ok = err <= tol
                rows.append(dict(check=what, rel_err=err, tolerance=tol, ok=ok))
                print(f"{'ok  ' if ok else 'FAIL'} {what}: {err:.2e} (tolerance {tol:.1e})", flush=True)
            completed.append(name)
        except Exception as e:  # one failing kernel must not hide the others
            msg = platforms.error_line(e, 400)
            rows.append(dict(check=name, error=msg, ok=False))
            print(f"ERROR {name}: {msg}", flush=True)
            traceback.print_exc(limit=3)
        print(f"  ({name}: {time.perf_counter() - start:.1f}s with compiles)", flush=True)
        if args.out:
            _write(args.out, device, rows, completed)
    return int(not all(r["ok"] for r in rows))


if __name__ == "__main__":
    sys.exit(main())
