"""GPTQ post-training weight quantization into the formats of kernels/quantized_matmul/reference.py.

Frantar, Ashkboos, Hoefler, Alistarh 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers" (arXiv:2210.17323), Algorithm 1, with the reference code's
conventions (github.com/IST-DASLab/gptq, `GPTQ.fasterquant`).

Convention. The paper and its code write a layer's weight as W[out, in] and round one *input
column* at a time. jaxsys stores a dense layer as W[K, N] with y = x @ W (K = input, contracted;
N = output channels), so here GPTQ rounds one *row* k of W at a time and pushes the error onto the
rows k' > k not yet rounded. Everything else transposes one for one: the paper's column update
W[:, F] -= err (Hinv[q, F]) is our W[F, :] -= outer(Hinv[q, F], err).

Objective. For calibration inputs X[M, K] of the layer, GPTQ minimises ||X W - X Q||_F^2 over the
quantized Q, row by row (the Optimal Brain Quantizer update), with the Hessian of that objective
H = 2 X^T X / M (+ dampening). `hessian` accumulates the raw sum X^T X and the row count over
calibration batches; `quantize` forms 2 H / count itself (the scale of H does not change the
result, only the relative dampening sees it, and that is relative to mean(diag H)).

The algorithm (`quantize`), as the reference code does it:
  1. inputs never active in calibration (H[i, i] == 0) get H[i, i] = 1 and w[i, :] = 0;
  2. dampening: H += damp * mean(diag H) * I;
  3. U = the upper Cholesky factor of H^-1 (H^-1 = U^T U): row k of U is row k of the inverse
     Hessian of the rows k.. not yet rounded, divided by sqrt of its diagonal entry, so that the
     sequential OBQ updates need no matrix downdates;
  4. rows are processed in blocks of `block_size` ("lazy batch updates"): inside a block each row k
     is rounded, err = (w_k - dequant(q_k)) / U[k, k], and the rows of the block after k get
     -= outer(U[k, k+1:], err); once the block is done, all later rows get the block's errors in
     one matmul, W[i2:] -= U[i1:i2, i2:]^T @ Err. This is the same arithmetic as the naive
     row-by-row update (up to float rounding), reordered for speed.

Quantization grids (exactly reference.quantize_w8 / quantize_w4's):
  "w8"  int8 codes in [-127, 127] with one fp32 scale per output channel. As in the reference code
        (per-channel quantizer, no groups), the scales are computed once, up front, from the
        original weights (reference.quantize_w8); GPTQ then only chooses the codes.
  "w4"  groups of G consecutive k, one scale (and zero point) per (group, channel). Default GPTQ
        ("non-static groups"): a group's scale and zero are computed when the loop reaches the
        group's first row, from the *current* weights of the group's G rows, i.e. after all the
        error updates of the rows already rounded (reference.quantize_w4 on those rows). Note:
        the reference implementation reads them from its block-stale copy of W, which lacks the
        updates from rows earlier in the same block when G < block_size; we use the fully updated
        rows (what Algorithm 1 means), so the result does not depend on block_size at all.
  act_order=True (the reference code's --act-order with --static-groups): rows are rounded in
        order of decreasing H[k, k] (the most active inputs first), and, so that the stored format
        stays one scale per G consecutive *original* k, all group scales and zeros are computed up
        front from the original weights (static groups, the same as RTN's); only the codes change.
        Without act_order the rows go in their natural order (the default, and the paper's setup).

The weights are read as float32 (the reference quantizers' precision); the error propagation runs
in float64. Each row's codes are computed in float32 exactly as the reference quantizers compute
theirs (round half to even, clip), and the scales / zeros come from the reference functions
themselves, so with a diagonal H (no error feedback) GPTQ returns RTN's codes, scales and zeros bit
for bit, and `reference.dequantize_w4(reference.pack_int4(q), s, z)` (or q * s for w8) reproduces
the quantized weights GPTQ propagated errors against.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxsys.kernels.quantized_matmul import reference as qref

__all__ = ["FORMATS", "hessian", "quantize", "quantize_detailed", "GPTQResult"]

FORMATS = ("w8", "w4")


class GPTQResult(NamedTuple):
    """`quantize_detailed`'s answer. q, s, z: as `quantize`. dequantized: float32 [K, N], the
    quantized weights GPTQ computed each row's error against (equal to dequantizing q, s, z with
    the reference functions). loss: sum over rows of ||err_k||^2 = sum ((w_k - dequant q_k) /
    U[k, k])^2, which equals tr(dW^T H' dW) for dW = W - dequantized (W with dead rows zeroed) and
    H' = 2 X^T X / M + damp * mean(diag) * I: the proxy objective GPTQ attains. perm: the order the
    rows were rounded in (None for the natural order)."""

    q: np.ndarray
    s: np.ndarray
    z: np.ndarray | None
    dequantized: np.ndarray
    loss: float
    perm: np.ndarray | None


def hessian(x, previous=None):
    """Accumulate the (unscaled) GPTQ Hessian of one layer's calibration inputs.

    x: activations into the layer, [..., K] (all leading dimensions are rows). previous: None, or
    the (H, count) this function returned for earlier batches. Returns (H, count): H = sum over
    all rows seen of x_m^T x_m, float64 [K, K], and count = the number of rows. `quantize` takes
    these two as they are and forms 2 H / count."""
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"hessian takes activations [..., K] with K > 0; got shape {x.shape}")
    x2 = x.reshape(-1, x.shape[-1]).astype(np.float64)
    h = x2.T @ x2
    count = x2.shape[0]
    if previous is not None:
        try:
            h_prev, count_prev = previous
        except (TypeError, ValueError):
            raise ValueError("hessian's `previous` must be the (H, count) pair it returned") from None
        h_prev = np.asarray(h_prev, np.float64)
        if h_prev.shape != h.shape:
            raise ValueError(
                f"hessian: these activations have K={x.shape[-1]} but the running Hessian is {h_prev.shape}"
            )
        h = h + h_prev
        count += int(count_prev)
    return h, count


def quantize(
    w,
    h,
    n_rows,
    fmt: str,
    group_size: int = 128,
    zero_point: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
):
    """GPTQ of one layer's weight w[K, N] (y = x @ w) against h = sum x^T x over n_rows calibration
    rows (`hessian`'s two results). fmt "w8" or "w4" (group_size G in reference.GROUP_SIZES
    dividing K, zero_point for the asymmetric 4-bit grid). damp: the dampening, relative to
    mean(diag H). block_size: rows per lazy batch update (speed only). act_order: round the
    most active inputs first, with static groups (see the module docstring).

    Returns (q, s, z) in the reference formats: q int8 [K, N] ([-127, 127] for w8, [-8, 7] or
    [0, 15] for w4); s float32 [N] (w8) or [K / G, N] (w4); z int8 [K / G, N] (w4 with zero_point)
    or None."""
    r = quantize_detailed(w, h, n_rows, fmt, group_size, zero_point, damp, block_size, act_order)
    return r.q, r.s, r.z


def _validate(w, h, n_rows, fmt, group_size, damp, block_size):
    if fmt not in FORMATS:
        raise ValueError(f"GPTQ format {fmt!r} is not supported: choose one of {FORMATS}")
    if w.ndim != 2:
        raise ValueError(f"GPTQ quantizes a 2-D weight w[K, N]; got shape {w.shape}")
    k, n = w.shape
    if k == 0 or n == 0:
        raise ValueError(f"GPTQ needs a non-empty weight; got shape {w.shape}")
    if h.shape != (k, k):
        raise ValueError(f"the Hessian must be [K, K] = [{k}, {k}] for w{w.shape}; got {h.shape}")
    if fmt == "w4":
        if group_size not in qref.GROUP_SIZES:
            raise ValueError(f"group_size={group_size}: choose one of {qref.GROUP_SIZES}")
        if k % group_size:
            raise ValueError(
                f"K={k} is not a multiple of group_size={group_size}: pick a group size "
                "that divides the input dimension"
            )
    if not (isinstance(n_rows, (int, np.integer)) and n_rows > 0):
        raise ValueError(f"n_rows (calibration rows behind the Hessian) must be a positive integer; got {n_rows!r}")
    if not (isinstance(block_size, (int, np.integer)) and block_size > 0):
        raise ValueError(f"block_size must be a positive integer; got {block_size!r}")
    if not (np.isfinite(damp) and damp >= 0):
        raise ValueError(f"damp must be a finite number >= 0; got {damp!r}")
    if not np.all(np.isfinite(w)):
        raise ValueError("the weight holds non-finite values")
    if not np.all(np.isfinite(h)):
        raise ValueError("the Hessian holds non-finite values")


def _inverse_cholesky_upper(h):
    """U upper triangular with H^-1 = U^T U (torch.linalg.cholesky(cholesky_inverse(...), upper))."""
    try:
        lower = np.linalg.cholesky(h)
        eye = np.eye(h.shape[0])
        lower_inv = np.linalg.solve(lower, eye)  # L^-1 (a dense solve: O(K^3) once per layer)
        h_inv = lower_inv.T @ lower_inv  # H^-1 = L^-T L^-1
        h_inv = (h_inv + h_inv.T) / 2
        return np.linalg.cholesky(h_inv).T
    except np.linalg.LinAlgError:
        raise ValueError("the dampened Hessian is not positive definite: raise `damp`") from None


def _group_params(rows, group_size, zero_point):
    """Scale and zero [N] (float32) of one group of rows, computed by the reference quantizer."""
    _, s, z = qref.quantize_w4(jnp.asarray(rows, jnp.float32), group_size, zero_point)
    s = np.asarray(s, np.float32)[0]
    z = None if z is None else np.asarray(z, np.float32)[0]
    return s, z


def _round_row(w_row, fmt, s, z):
    """Codes (float32 holding integers) and dequantized values (float32) of one row, exactly as the
    reference quantizers compute them for the given scale and zero."""
    w32 = w_row.astype(np.float32)
    if fmt == "w8":
        q = np.clip(np.round(w32 / s), -127, 127)
    elif z is not None:
        q = np.clip(np.round(w32 / s) + z, 0, 15)
    else:
        q = np.clip(np.round(w32 / s), -8, 7)
    q = q.astype(np.int8).astype(np.float32)  # integers (no -0.0), as the stored codes
    return q, (q if z is None else q - z) * s


def quantize_detailed(
    w,
    h,
    n_rows,
    fmt: str,
    group_size: int = 128,
    zero_point: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
) -> GPTQResult:
    """`quantize`, also returning the quantized weights it tracked, the proxy loss and the row
    order (`GPTQResult`)."""
    w = np.asarray(w)
    h = np.asarray(h)
    _validate(w, h, n_rows, fmt, group_size, damp, block_size)
    k_dim, n = w.shape
    w32 = w.astype(np.float32)
    weights = w32.astype(np.float64)
    hess = h.astype(np.float64) * (2.0 / n_rows)

    if fmt == "w8":  # per-channel scales, once, from the original weights (before the dead rows)
        scales = np.asarray(qref.quantize_w8(jnp.asarray(w32))[1], np.float32)
    dead = np.diag(hess) == 0
    hess[dead, dead] = 1.0
    weights[dead] = 0.0

    static = fmt == "w4" and act_order
    if static:  # static groups: every group's scale/zero from the (dead-zeroed) original weights
        _, s_all, z_all = qref.quantize_w4(jnp.asarray(weights.astype(np.float32)), group_size, zero_point)
        s_all = np.asarray(s_all, np.float32)
        z_all = None if z_all is None else np.asarray(z_all, np.float32)

    perm = None
    if act_order:
        perm = np.argsort(-np.diag(hess), kind="stable")
        weights = weights[perm]
        hess = hess[perm][:, perm]

    hess[np.diag_indices(k_dim)] += damp * np.mean(np.diag(hess))
    u = _inverse_cholesky_upper(hess)

    codes = np.zeros((k_dim, n), np.float32)
    deq = np.zeros((k_dim, n), np.float32)
    if fmt == "w4":
        groups = k_dim // group_size
        s_out = s_all if static else np.zeros((groups, n), np.float32)
        z_out = (z_all if static else np.zeros((groups, n), np.float32)) if zero_point else None
    loss = 0.0
    s_row = z_row = None
    if fmt == "w8":
        s_row = scales

    for i1 in range(0, k_dim, block_size):
        i2 = min(i1 + block_size, k_dim)
        w_blk = weights[i1:i2].copy()  # the block's rows, kept current within the block
        err_blk = np.zeros((i2 - i1, n))
        u_blk = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            k = i1 + i
            if fmt == "w4":
                if static:
                    g = perm[k] // group_size
                    s_row, z_row = s_all[g], None if z_all is None else z_all[g]
                elif k % group_size == 0:
                    # the group's current rows: those in this block are up to date in w_blk; rows
                    # past the block still miss this block's updates from rows i1..k-1: add them.
                    rows = w_blk[i : i + group_size]
                    if k + group_size > i2:
                        rest = weights[i2 : k + group_size] - u[i1:k, i2 : k + group_size].T @ err_blk[:i]
                        rows = np.concatenate([rows, rest])
                    s_row, z_row = _group_params(rows, group_size, zero_point)
                    s_out[k // group_size] = s_row
                    if zero_point:
                        z_out[k // group_size] = z_row
            q_row, d_row = _round_row(w_blk[i], fmt, s_row, z_row)
            codes[k], deq[k] = q_row, d_row
            err = (w_blk[i] - d_row.astype(np.float64)) / u_blk[i, i]
            loss += float(err @ err)
            w_blk[i + 1 :] -= np.outer(u_blk[i, i + 1 :], err)
            err_blk[i] = err
        weights[i2:] -= u[i1:i2, i2:].T @ err_blk  # the lazy batch update of all later rows

    if perm is not None:
        inverse = np.argsort(perm)
        codes, deq = codes[inverse], deq[inverse]
    q = codes.astype(np.int8)
    if fmt == "w8":
        return GPTQResult(q, scales, None, deq, loss, perm)
    return GPTQResult(q, s_out, None if z_out is None else z_out.astype(np.int8), deq, loss, perm)
