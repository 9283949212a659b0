"""Attention logit soft-capping (Gemma 2: scaled scores s -> c * tanh(s / c), before the mask and
the softmax) in the serving kernels and the KV caches: kernels/paged_attention's references against
an fp64 NumPy statement; the paged kernels (per-row generic and TPU, quantized; ragged generic and
TPU, quantized; interpret mode) against their references with the cap, with and without a sliding
window; every cache type's `attend` over a short prefill + decode against the flash reference /
`layers.attention` on the contiguous keys.

Inputs have q scaled so that |s| reaches several times c (c = 1 or 2 against scores of standard
deviation ~4): the cap then changes every output by O(1e-1), so a kernel that drops it (or applies
it after the mask, or to the unscaled scores) fails.

Tolerances. Kernel against reference, fp32: the same fp32 scores summed in another order (page by
page, online softmax) as in tests/test_paged_attention.py, rtol 1e-5 + atol 1e-5 (times max|o|
where the outputs are larger than 1). The cap does not widen that: d(c tanh(s / c)) / ds = 1 -
tanh^2 <= 1, so it never amplifies the scores' rounding differences, and tanh is the same XLA op in
both (interpret mode). Reference against fp64 NumPy: fp32 rounding of scores of size ~10, 1e-5.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.analysis import targets
from jaxsys.cache import ContiguousCache, FakeQuant, PagedCache, QuantizedPagedCache, WindowView, kivi
from jaxsys.cache.window import view_pages
from jaxsys.kernels.flash_attention import reference_attention
from jaxsys.kernels.paged_attention import kernel, kernel_quant, quant, ragged
from jaxsys.kernels.paged_attention import reference as paged_ref
from jaxsys.models import layers

CAP = 2.0
TOL = dict(rtol=1e-5, atol=1e-5)


def _numpy_decode(q, keys, values, length, window=None, softcap=None, scale=None):
    """fp64 attention of one query q [N, H] over keys/values [>= length, K, H]: positions
    max(length - window, 0) .. length - 1, scores scale * q.k then c * tanh(s / c)."""
    q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
    n, h = q.shape
    kh = keys.shape[1]
    lo = 0 if window is None else max(length - window, 0)
    scale = h**-0.5 if scale is None else scale
    sc = np.einsum("kgh,skh->kgs", q.reshape(kh, n // kh, h), keys[lo:length]) * scale
    if softcap is not None:
        sc = softcap * np.tanh(sc / softcap)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    return np.einsum("kgs,skh->kgh", p / p.sum(-1, keepdims=True), values[lo:length]).reshape(n, h)


def _differs(a, b, by=1e-1):
    return np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() > by


# ----------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("softcap", [1.0, 2.0])
@pytest.mark.parametrize("window", [None, 5])
def test_contiguous_attention_equals_numpy(softcap, window):
    rng = np.random.default_rng(0)
    b, s, n, kh, h = 3, 16, 4, 2, 16
    q = jnp.asarray(4 * rng.standard_normal((b, n, h)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, kh, h)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, kh, h)), jnp.float32)
    lengths = jnp.asarray([1, 7, 16], jnp.int32)
    got = paged_ref.contiguous_attention(q, k, v, lengths, window=window, softcap=softcap)
    for row in range(b):
        want = _numpy_decode(q[row], k[row], v[row], int(lengths[row]), window, softcap)
        np.testing.assert_allclose(got[row], want, **TOL)
    # the scores reach several times the cap, and the cap matters
    scores = np.einsum("bkgh,bskh->bkgs", np.asarray(q).reshape(b, kh, n // kh, h), np.asarray(k)) / np.sqrt(h)
    assert np.abs(scores).max() > 4 * softcap
    plain = paged_ref.contiguous_attention(q, k, v, lengths, window=window)
    assert _differs(got, plain)
    # None and 0 are no cap
    np.testing.assert_array_equal(paged_ref.contiguous_attention(q, k, v, lengths, window=window, softcap=0), plain)


def test_bad_softcap_is_named():
    args = (jnp.ones((1, 2, 16)), jnp.ones((1, 4, 2, 16)), jnp.ones((1, 4, 2, 16)), jnp.asarray([3]))
    for bad in (-1.0, "50", True, float("inf")):
        with pytest.raises(ValueError, match="softcap"):
            paged_ref.contiguous_attention(*args, softcap=bad)
    pages = (jnp.ones((1, 2, 16)), jnp.ones((2, 4, 2, 16)), jnp.ones((2, 4, 2, 16)), jnp.zeros((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="softcap"):
        kernel.paged_attention(*pages, jnp.asarray([3]), interpret=True, softcap=-2.0)


# ----------------------------------------------------------------------------- the kernels


@pytest.fixture(scope="module")
def paged_case():
    from tests.test_paged_attention import _case

    q, kp, vp, table, lengths = _case(b=4, n=4, k=2, h=128, page_size=8, max_pages=4, lengths=[1, 9, 27, 32])
    return 4 * q, kp, vp, table, lengths


@pytest.mark.parametrize("window", [None, 12])
def test_paged_kernels_equal_their_references(paged_case, window):
    """Per-row kernel (generic and TPU variants) and the quantized one (kivi4, residual 1: both
    pools read) with the cap equal their references with it; the reference equals NumPy."""
    q, kp, vp, table, lengths = paged_case
    want = paged_ref.paged_attention_reference(*paged_case, window=window, softcap=CAP)
    for b in range(4):  # the gathered reference against NumPy over the row's slots
        rows = np.asarray([int(table[b, p // 8]) for p in range(int(lengths[b]))])
        keys, values = kp[rows, np.arange(len(rows)) % 8], vp[rows, np.arange(len(rows)) % 8]
        np.testing.assert_allclose(want[b], _numpy_decode(q[b], keys, values, len(rows), window, CAP), **TOL)
    assert _differs(want, paged_ref.paged_attention_reference(*paged_case, window=window))
    for backend in ("generic", "tpu"):
        got = kernel.paged_attention(*paged_case, backend=backend, interpret=True, window=window, softcap=CAP)
        np.testing.assert_allclose(got, want, **TOL, err_msg=backend)
    qp = quant.quantize_pages(kp, vp, "kivi4", jnp.float32)
    kw = dict(mode="kivi4", residual=1, window=window, softcap=CAP)
    got = kernel_quant.paged_attention_quant(q, kp, vp, qp, table, table, lengths, interpret=True, **kw)
    want_q = quant.paged_attention_quant_reference(q, kp, vp, qp, table, table, lengths, **kw)
    np.testing.assert_allclose(got, want_q, **TOL)
    assert _differs(
        want_q, quant.paged_attention_quant_reference(q, kp, vp, qp, table, table, lengths, **kw | {"softcap": None})
    )


@pytest.fixture(scope="module")
def ragged_cases():
    from tests.test_ragged_paged_attention import _case, _quant_case

    args = _case(n=4, k=2, h=128, page_size=8)
    qargs = _quant_case("int8")
    return (4 * args[0], *args[1:]), (4 * qargs[0], *qargs[1:])


@pytest.mark.parametrize("window", [None, 6])
def test_ragged_kernels_equal_their_references(ragged_cases, window):
    """Ragged kernels (generic and TPU variants over decodes and prefill chunks, and the quantized
    one) with the cap equal their references with it; the reference equals NumPy per query row."""
    args, qargs = ragged_cases
    q, kp, vp, table, cu, lens, ns = args
    want = ragged.ragged_paged_attention_reference(*args, window=window, softcap=CAP)
    for s in range(int(ns)):
        length, q_len = int(lens[s]), int(cu[s + 1] - cu[s])
        rows = np.asarray([int(table[s, p // 8]) for p in range(length)])
        keys, values = kp[rows, np.arange(length) % 8], vp[rows, np.arange(length) % 8]
        for j in range(q_len):
            row, pos = int(cu[s]) + j, length - q_len + j
            np.testing.assert_allclose(want[row], _numpy_decode(q[row], keys, values, pos + 1, window, CAP), **TOL)
    assert _differs(want, ragged.ragged_paged_attention_reference(*args, window=window))
    for backend in ("generic", "tpu"):
        got = ragged.ragged_paged_attention(
            *args, backend=backend, block_q=8, interpret=True, window=window, softcap=CAP
        )
        np.testing.assert_allclose(got, want, **TOL, err_msg=backend)
    kw = dict(mode="int8", residual=0, window=window, softcap=CAP)
    got = ragged.ragged_paged_attention_quant(*qargs, block_q=8, interpret=True, **kw)
    want_q = ragged.ragged_paged_attention_quant_reference(*qargs, **kw)
    np.testing.assert_allclose(got, want_q, **TOL)
    assert _differs(want_q, ragged.ragged_paged_attention_quant_reference(*qargs, **kw | {"softcap": None}))


# ----------------------------------------------------------------------------- the caches

B, N, K, H, PAGE, T, PREFILL = 2, 4, 2, 32, 4, 12, 5
MAX_PAGES = T // PAGE


@pytest.fixture(scope="module")
def seq():
    """q, k, v [B, T, ., H] of two sequences of T tokens, and the causal attention over them
    (flash reference, capped and not)."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(4 * rng.standard_normal((B, T, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32) for _ in range(2))
    want = reference_attention(q, k, v, causal=True, softcap=CAP)
    assert _differs(want, reference_attention(q, k, v, causal=True))
    return q, k, v, want


@functools.partial(jax.jit, static_argnames=("window", "softcap"))
def _attend(cache, q, k, v, positions, window=None, softcap=None):
    return cache.attend(q, k, v, positions, window=window, softcap=softcap)


def _close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(np.abs(want).max(), 1.0))


def _run_rows(cache, seq, first, last, window=None):
    """Decode positions first .. last - 1, one token per row per step -> ([B, last - first, N, H], cache)."""
    q, k, v, _ = seq
    out = []
    for t in range(first, last):
        positions = jnp.full((B, 1), t, jnp.int32)
        step = (q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], positions)
        o, cache = _attend(cache, *step, window=window, softcap=CAP)
        out.append(o[:, 0])
    return jnp.stack(out, axis=1), cache


def _prefill_rows(q, k, v):
    """The first PREFILL tokens of both sequences as B * PREFILL one-token rows."""
    rows = lambda x: x[:, :PREFILL].reshape(B * PREFILL, 1, *x.shape[2:])
    positions = jnp.tile(jnp.arange(PREFILL, dtype=jnp.int32), B)[:, None]
    return rows(q), rows(k), rows(v), positions


def test_contiguous_cache(seq):
    """A prefill of 5 tokens then decodes: the outputs equal the flash reference's rows; with a
    FakeQuant that quantizes nothing (fake_quant_attention's path) too."""
    q, k, v, want = seq
    for fq in (None, FakeQuant(0, None, None, PAGE)):
        zeros = jnp.zeros((B, T, K, H), jnp.float32)
        cache = ContiguousCache(zeros, zeros, None, fq)
        positions = jnp.broadcast_to(jnp.arange(PREFILL, dtype=jnp.int32), (B, PREFILL))
        o, cache = _attend(cache, q[:, :PREFILL], k[:, :PREFILL], v[:, :PREFILL], positions, softcap=CAP)
        _close(o, want[:, :PREFILL])
        decoded, _ = _run_rows(cache, seq, PREFILL, T)
        _close(decoded, want[:, PREFILL:])


def _page_ids(count, seed):
    """B sequences' MAX_PAGES page ids, shuffled over a pool of count pages (the last one spare)."""
    return jnp.asarray(np.random.default_rng(seed).permutation(count - 1)[: B * MAX_PAGES].reshape(B, MAX_PAGES))


def _ragged_fields(table):
    """The per-sequence fields of a prefill step of PREFILL rows per sequence."""
    return dict(
        seq_table=table,
        cu_q_lens=jnp.arange(B + 1, dtype=jnp.int32) * PREFILL,
        kv_lens=jnp.full((B,), PREFILL, jnp.int32),
        num_seqs=jnp.asarray([B], jnp.int32),
    )


@pytest.mark.parametrize("window", [None, 3])
def test_paged_cache(seq, window):
    """The prefill through the ragged kernel (rows grouped by sequence), then decodes through the
    per-row kernel: the rows equal layers.attention over the contiguous keys (with the window too)."""
    q, k, v, _ = seq
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    want = layers.attention(q, k, v, q_positions=positions, window=window, softcap=CAP)
    pool = B * MAX_PAGES + 1
    table = _page_ids(pool, 1)
    zeros = jnp.zeros((pool, PAGE, K, H), jnp.float32)
    cache = PagedCache(zeros, zeros, jnp.repeat(table, PREFILL, axis=0), **_ragged_fields(table))
    o, cache = _attend(cache, *_prefill_rows(q, k, v), window=window, softcap=CAP)
    _close(o.reshape(B, PREFILL, N, H), want[:, :PREFILL])
    decoded, _ = _run_rows(PagedCache(cache.k, cache.v, table), seq, PREFILL, T, window)
    _close(decoded, want[:, PREFILL:])


def test_quantized_paged_cache(seq):
    """kivi4 with no residual pages (pages sealed as they fill): the prefill through the ragged
    kernel, decodes through the per-row one, equal kivi.fake_quant_attention over the contiguous
    keys, which with nothing quantized is layers.attention."""
    q, k, v, _ = seq
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    fq = FakeQuant.of_mode("kivi4", PAGE, 0)
    want = kivi.fake_quant_attention(q, k, v, positions, fq, softcap=CAP)
    assert _differs(want, kivi.fake_quant_attention(q, k, v, positions, fq))
    plain = kivi.fake_quant_attention(q, k, v, positions, FakeQuant(0, None, None, PAGE), softcap=CAP)
    _close(plain, layers.attention(q, k, v, q_positions=positions, softcap=CAP))
    pool = B * MAX_PAGES + 1
    tq, tf = _page_ids(pool, 2), _page_ids(pool, 3)
    shapes = kivi.layer_shapes("kivi4", pool, pool, PAGE, K, H)
    arrays = {name: jnp.zeros(shape, dtype or jnp.float32) for name, (shape, dtype) in shapes.items()}
    ragged_fields = _ragged_fields(tq)
    cache = QuantizedPagedCache(
        **arrays,
        page_table=jnp.repeat(tq, PREFILL, axis=0),
        fp_table=jnp.repeat(tf, PREFILL, axis=0),
        seq_fp_table=tf,
        **ragged_fields,
        mode="kivi4",
        residual=0,
    )
    o, cache = _attend(cache, *_prefill_rows(q, k, v), softcap=CAP)
    _close(o.reshape(B, PREFILL, N, H), want[:, :PREFILL])
    cache = QuantizedPagedCache(
        **{name: getattr(cache, name) for name in arrays}, page_table=tq, fp_table=tf, mode="kivi4", residual=0
    )
    decoded, _ = _run_rows(cache, seq, PREFILL, T)
    _close(decoded, want[:, PREFILL:])


def test_window_view(seq):
    """Self-speculation's read view (1 sink page + the pages of the last 2 tokens) over a paged cache:
    each decode equals layers.attention over the view's positions only."""
    q, k, v, _ = seq
    pool = B * MAX_PAGES + 1
    table = _page_ids(pool, 4)
    zeros = jnp.zeros((pool, PAGE, K, H), jnp.float32)
    cache = PagedCache(zeros, zeros, jnp.repeat(table, PREFILL, axis=0), **_ragged_fields(table))
    _, cache = _attend(cache, *_prefill_rows(q, k, v), softcap=CAP)
    cache = PagedCache(cache.k, cache.v, table)
    sparse = 0
    for t in range(PREFILL, T):
        pages, n = view_pages(t + 1, PAGE, 1, 2)
        read = np.zeros((B, MAX_PAGES), np.int32)
        read[:, : len(pages)] = np.asarray(table)[:, pages]
        view = WindowView(cache, jnp.asarray(read), jnp.full((B,), n, jnp.int32))
        o, view = _run_rows(view, seq, t, t + 1)
        cache = view.cache
        kept = np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in pages])[:n]  # the view's positions
        want = layers.attention(
            q[:, t : t + 1], k[:, kept], v[:, kept], q_positions=jnp.full((B, 1), n - 1), softcap=CAP
        )
        _close(o, want)  # o [B, 1, N, H]: the one step
        sparse += n < t + 1
    assert sparse == 3  # lengths 10, 11, 12 skip page 1


# ----------------------------------------------------------------------------- compilers (ahead of time)


@pytest.mark.skipif(not targets.has_libtpu(), reason="needs libtpu (bash scripts/bootstrap --test)")
@pytest.mark.parametrize("h", [128, 64])
def test_capped_tpu_kernels_compile_with_mosaic(h):
    """The per-row and ragged TPU variants with the cap and a window, interpret=False, lowered for
    a v5p slice (H = 128: a kv head per program; 64: all heads per program): Mosaic accepts the
    tanh and the program holds its custom call. Nothing runs."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxsys.kernels.tpu_compile_grid import tpu_mesh
    from tests.test_ragged_paged_attention import _abstract

    mesh = tpu_mesh("v5p:2x2x1")
    sh = NamedSharding(mesh, P())
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    kw = dict(interpret=False, softcap=50.0, window=40)
    shard = lambda f, n: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(),) * n, out_specs=P(), check_vma=False))
    paged_args = (
        S((8, 8, h), jnp.bfloat16),
        S((64, 16, 2, h), jnp.bfloat16),
        S((64, 16, 2, h), jnp.bfloat16),
        S((8, 8), jnp.int32),
        S((8,), jnp.int32),
    )
    ragged_args = _abstract(jnp.bfloat16, 8, 2, h=h, t=96, sharding=sh)
    with targets.quiet_libtpu():
        for fn, args in (
            (lambda *a: kernel.paged_attention(*a, **kw), paged_args),
            (lambda *a: ragged.ragged_paged_attention(*a, block_q=16, **kw), ragged_args),
        ):
            assert "tpu_custom_call" in shard(fn, len(args)).lower(*args).compile().as_text()


@pytest.mark.skipif(not targets.has_cuda_plugin(), reason="needs jax-cuda13-plugin (.[gpu-aot])")
def test_capped_kernels_compile_to_sass_for_an_h100_deviceless():
    """The generic kernels with the cap (per-row, quantized per-row, ragged in its dot form,
    quantized ragged), interpret=False, through a deviceless XLA:GPU compile for sm_90a: Triton
    lowers the tanh and ptxas accepts the result. Nothing runs: numerics on a GPU are unchecked."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.test_ragged_paged_attention import _abstract, _abstract_quant

    mesh = Mesh(np.array(targets.devices(targets.parse("h100-1"))), ("x",))
    sh = NamedSharding(mesh, P())
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    shard = lambda f, n: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(),) * n, out_specs=P(), check_vma=False))
    cap = dict(interpret=False, softcap=50.0)
    quant_kw = dict(mode="kivi4", residual=1, **cap)
    pool = (S((64, 16, 2, 128), jnp.bfloat16),) * 2
    qp = {
        name: S(shape, jnp.uint8 if name in ("kq", "vq") else jnp.bfloat16)
        for name, shape in quant.page_shapes("kivi4", 64, 16, 2, 128).items()
    }
    table, lengths = S((4, 8), jnp.int32), S((4,), jnp.int32)
    cases = (
        (lambda *a: kernel.paged_attention(*a, **cap), (S((4, 8, 128), jnp.bfloat16), *pool, table, lengths)),
        (
            lambda *a: kernel_quant.paged_attention_quant(*a, **quant_kw),
            (S((4, 8, 128), jnp.bfloat16), *pool, qp, table, table, lengths),
        ),
        (lambda *a: ragged.ragged_paged_attention(*a, **cap), _abstract(jnp.bfloat16, 8, 2, sharding=sh)),
        (lambda *a: ragged.ragged_paged_attention_quant(*a, **quant_kw), _abstract_quant("kivi4", sh)),
    )
    for fn, args in cases:
        assert "__gpu$xla.gpu.triton" in shard(fn, len(args)).lower(*args).compile().as_text()
