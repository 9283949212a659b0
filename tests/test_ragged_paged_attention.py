"""kernels/paged_attention/ragged.py: the ragged paged-attention kernels (interpret mode) against the
reference, the reference against causal attention over each sequence's cache laid out contiguously
(numpy, fp64), the quantized variant against its reference and the per-row quantized reference, bad
input, ahead-of-time compiles (Triton for an abstract / deviceless H100, Mosaic for v5p and v6e) and
the traffic analysis of bench_ragged.py.

The mixes: decodes (q_len 1: a first token, at a page boundary, at the last slot of the cache), a
few queries inside one page, a whole page (a prompt's first chunk: kv_len = q_len), several pages
starting after a page; page tables are slices of a shuffled pool; T has padding rows past
cu_q_lens[num_seqs]; sequence slots past num_seqs hold junk offsets, lengths and tables.

Tolerances. fp32: kernel and reference form the same fp32 scores and softmax in another order
(page by page with an online softmax, against one softmax over the row), and the fp64 numpy
attention differs from both by fp32 rounding: rtol 1e-5 + atol 1e-5 * max|o|. bf16 inputs: all read
the same bf16 values (exact in fp32) and accumulate in fp32; the kernels' dot form (tiles >= 16 in
every dim, page_size 16 below) and the TPU variant round the probabilities P to bf16 before P V
(2^-9 relative each, averaged over the keys), and every result is rounded to bf16 (one ulp = 2^-8
relative, and two fp32 results may straddle a rounding boundary): rtol = atol / max|o| = 2^-7, two
bf16 ulps. The quantized variant dequantizes in fp32 as its reference does (and in the dot form
enters the dots in q's dtype: exact for fp32 q), so fp32 cases keep 1e-5.
"""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.analysis import targets
from jaxsys.kernels.paged_attention import bench_ragged, kernel, quant, ragged
from jaxsys.kernels.paged_attention import reference as ref

RNG = np.random.default_rng(31)


def _close(got, want, dtype, tol=None):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    tol = tol or (1e-5 if dtype == jnp.float32 else 2**-7)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def _mix(page_size):
    """(q_lens, kv_lens) of six sequences over max_pages = 4: a decode of a first token, 3 queries
    inside page 1, a whole page from position 0, a decode at a page boundary, 2 pages + 5 queries
    from position page_size (blocks crossing pages), a decode at the cache's last slot."""
    ps = page_size
    return [1, 3, ps, 1, 2 * ps + 5, 1], [1, ps + 3, ps, 2 * ps + 1, 3 * ps + 5, 4 * ps]


def _layout(q_lens, kv_lens, page_size, max_pages, slots, pad, spare=3):
    """cu_q_lens [S + 1], kv_lens [S], a page table [S, max_pages] of distinct ids from a shuffled
    pool of S * max_pages + spare pages, T; slots past len(q_lens) hold junk."""
    ns = len(q_lens)
    t = int(sum(q_lens)) + pad
    cu = np.full(slots + 1, t + 7, np.int32)  # junk past num_seqs (ignored)
    cu[: ns + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    lens = np.full(slots, 10**6, np.int32)
    lens[:ns] = kv_lens
    pool = slots * max_pages + spare
    table = RNG.permutation(pool)[: slots * max_pages].reshape(slots, max_pages).astype(np.int32)
    return cu, lens, table, t, pool


def _case(n=4, k=2, h=32, page_size=8, max_pages=4, slots=8, pad=5, dtype=jnp.float32, mix=None):
    q_lens, kv_lens = mix or _mix(page_size)
    cu, lens, table, t, pool = _layout(q_lens, kv_lens, page_size, max_pages, slots, pad)
    q = jnp.asarray(RNG.standard_normal((t, n, h)), dtype)
    kp = jnp.asarray(RNG.standard_normal((pool, page_size, k, h)), dtype)
    vp = jnp.asarray(RNG.standard_normal((pool, page_size, k, h)), dtype)
    return q, kp, vp, jnp.asarray(table), jnp.asarray(cu), jnp.asarray(lens), jnp.int32(len(q_lens))


def _contiguous(q, kp, vp, table, cu, lens, num_seqs, scale=None):
    """Independent fp64 numpy: each sequence's kv_len tokens copied from its pages slot by slot into a
    contiguous [kv_len, K, H] cache, causal attention of its q_len queries (positions kv_len - q_len
    ..), padding rows 0."""
    q, kp, vp = (np.asarray(a, np.float64) for a in (q, kp, vp))
    table, cu, lens = np.asarray(table), np.asarray(cu), np.asarray(lens)
    t, n, h = q.shape
    page_size, k = kp.shape[1], kp.shape[2]
    scale = h**-0.5 if scale is None else scale
    out = np.zeros_like(q)
    for s in range(int(num_seqs)):
        length, q_len = int(lens[s]), int(cu[s + 1] - cu[s])
        kc = np.stack([kp[table[s, p // page_size], p % page_size] for p in range(length)])  # [L, K, H]
        vc = np.stack([vp[table[s, p // page_size], p % page_size] for p in range(length)])
        for j in range(q_len):
            row, pos = cu[s] + j, length - q_len + j
            qi = q[row].reshape(k, n // k, h)
            sc = np.einsum("kgh,skh->kgs", qi, kc[: pos + 1]) * scale
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[row] = np.einsum("kgs,skh->kgh", p, vc[: pos + 1]).reshape(n, h)
    return out


# ----------------------------------------------------------------------------- numerics (interpret)


@pytest.mark.parametrize(
    "group,dtype,page_size,block_q",
    [
        (1, jnp.float32, 8, 16),
        (2, jnp.float32, 8, 4),
        (3, jnp.float32, 16, 8),  # G = 3 padded to 4; dot form (R = 32, page 16, H 32)
        (4, jnp.float32, 16, 16),  # dot form
        (1, jnp.float32, 16, 1),  # one query per item: the per-row split, broadcast form
        (2, jnp.bfloat16, 16, 16),  # dot form, P rounded to bf16
        (4, jnp.bfloat16, 8, 8),
    ],
)
def test_kernel_equals_reference_and_contiguous_attention(group, dtype, page_size, block_q):
    k = 2
    args = _case(n=k * group, k=k, page_size=page_size, dtype=dtype)
    got = jax.jit(lambda *a: ragged.ragged_paged_attention(*a, block_q=block_q, interpret=True))(*args)
    assert got.shape == args[0].shape and got.dtype == dtype
    want = ragged.ragged_paged_attention_reference(*args)
    _close(got, want, dtype)
    contiguous = _contiguous(*args)
    _close(want, contiguous, dtype)
    _close(got, contiguous, dtype)
    padding = int(args[4][int(args[6])])
    assert not np.asarray(got[padding:], np.float32).any()  # padding rows are 0


@pytest.mark.parametrize("row_block", [1, 4, 16])
def test_item_tiles_split_over_programs_equal_the_reference(row_block):
    """MLA's latent cache: all heads on one kv head (K = 1, G = 8) and the item tile's R = block_q x
    Gp = 32 rows split over R / row_block programs (each reading the pages, its rows' positions
    offset by its place in the tile), equal to the whole tile's reference; row_block 16 the dot form."""
    args = _case(n=8, k=1, page_size=16)
    got = jax.jit(lambda *a: ragged.ragged_paged_attention(*a, block_q=4, row_block=row_block, interpret=True))(*args)
    _close(got, ragged.ragged_paged_attention_reference(*args), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_dim_in_power_of_two_parts_equals_the_reference(dtype):
    """H = 80 = 64 + 16 (MLA's latent rows are 576 = 512 + 64): scores summed over the parts, P V
    and the output part by part, in the dot form (tiles >= 16) and split over row blocks."""
    args = _case(n=8, k=1, h=80, page_size=16, dtype=dtype)
    got = jax.jit(lambda *a: ragged.ragged_paged_attention(*a, block_q=4, row_block=16, interpret=True))(*args)
    _close(got, ragged.ragged_paged_attention_reference(*args), dtype)


def test_row_block_keeps_small_tiles_whole_and_splits_large_ones():
    assert ragged.row_block(128, 128) == 128  # 16K elements: whole
    assert ragged.row_block(256, 1024) == 16  # MLA's latent: 16 heads x 16 tokens x 1024
    assert ragged.row_block(8, 4096) == 8  # fewer rows than the dot form's 16: whole
    with pytest.raises(ValueError, match="row_block must be a power of two"):
        ragged.ragged_paged_attention(*_case(n=8, k=1, page_size=16), row_block=3)


def test_reference_really_is_causal_and_ragged():
    """The contiguous check can fail: without the causal mask inside a chunk (every query seeing
    the whole kv_len) the answer differs, and so does shifting one sequence's queries by one row."""
    q, kp, vp, table, cu, lens, ns = _case()
    want = _contiguous(q, kp, vp, table, cu, lens, ns)
    got = np.asarray(ragged.ragged_paged_attention_reference(q, kp, vp, table, cu, lens, ns))
    full = np.asarray(
        ref.paged_attention_reference(
            q[: int(cu[int(ns)])],
            kp,
            vp,
            table[np.repeat(np.arange(int(ns)), np.diff(np.asarray(cu)[: int(ns) + 1]))],
            jnp.asarray(np.repeat(np.asarray(lens)[: int(ns)], np.diff(np.asarray(cu)[: int(ns) + 1]))),
        )
    )
    assert not np.allclose(full, want[: full.shape[0]], atol=1e-3)
    _close(got, want, jnp.float32)
    shifted = np.asarray(cu).copy()
    shifted[2] += 1  # sequence 1 takes one more row, sequence 2 one fewer
    assert not np.allclose(_contiguous(q, kp, vp, table, shifted, lens, ns), want, atol=1e-3)


def test_decodes_only_equal_the_one_query_kernel():
    """All q_len = 1 and no padding: the ragged kernel is kernel.paged_attention with the
    sequences' tables and kv_lens."""
    b, ps = 5, 8
    kv_lens = [1, ps, 2 * ps + 3, 4 * ps, 5]
    q, kp, vp, table, cu, lens, ns = _case(n=8, k=2, page_size=ps, slots=b, pad=0, mix=([1] * b, kv_lens))
    got = ragged.ragged_paged_attention(q, kp, vp, table, cu, lens, ns, interpret=True)
    want = kernel.paged_attention(q, kp, vp, table, lens, interpret=True)
    _close(got, want, jnp.float32)


@pytest.mark.parametrize("backend", ["generic", "tpu"])
def test_nothing_outside_the_causal_windows_is_read(backend):
    """Table entries past a sequence's ceil(kv_len / page_size) pages, the slots past kv_len of its
    last page, padding query rows and everything of the sequence slots past num_seqs may hold
    anything: NaN there leaves the output bit for bit unchanged (and padding rows 0)."""
    ps, max_pages = 16, 4
    q, kp, vp, table, cu, lens, ns = _case(n=4, k=2, h=128 if backend == "tpu" else 32, page_size=ps)
    ns_, cu_np, lens_np, tab = int(ns), np.asarray(cu), np.asarray(lens), np.asarray(table).copy()
    used = np.zeros_like(tab, bool)
    used[:ns_] = np.arange(max_pages)[None, :] < -(-lens_np[:ns_] // ps)[:, None]
    dead = next(p for p in range(kp.shape[0]) if p not in tab[used])  # a spare page
    tab[~used] = dead
    kp_nan, vp_nan = kp.at[dead].set(jnp.nan), vp.at[dead].set(jnp.nan)
    for s in range(ns_):  # the open page's slots past kv_len
        length = int(lens_np[s])
        if length % ps:
            page = tab[s, length // ps]
            kp_nan, vp_nan = kp_nan.at[page, length % ps :].set(jnp.nan), vp_nan.at[page, length % ps :].set(jnp.nan)
    q_nan = q.at[int(cu_np[ns_]) :].set(jnp.nan)
    run = lambda *a: ragged.ragged_paged_attention(*a, backend=backend, block_q=8, interpret=True)
    want = run(q, kp, vp, table, cu, lens, ns)
    got = run(q_nan, kp_nan, vp_nan, jnp.asarray(tab), cu, lens, ns)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.asarray(got[int(cu_np[ns_]) :]).any()


def test_no_sequences_scale_and_a_one_element_num_seqs():
    q, kp, vp, table, cu, lens, _ = _case()
    assert not np.asarray(ragged.ragged_paged_attention(q, kp, vp, table, cu, lens, jnp.int32(0))).any()
    args = (q, kp, vp, table, cu, lens, jnp.asarray([4], jnp.int32))
    _close(
        ragged.ragged_paged_attention(*args, scale=0.3),
        _contiguous(*args[:6], 4, scale=0.3),
        jnp.float32,
    )


@pytest.mark.parametrize(
    "group,dtype,h", [(1, jnp.float32, 128), (4, jnp.float32, 128), (2, jnp.bfloat16, 128), (2, jnp.float32, 32)]
)
def test_tpu_variant_in_interpret_mode_equals_reference(group, dtype, h):
    """ragged_tpu.py's grid (W, K, max_pages), scalar-prefetched tables and item metadata, run by
    the Pallas interpreter (its Mosaic compile is tested below; nothing runs on a TPU here). H = 32:
    the all-kv-heads-per-program layout (lane blocks of K * H)."""
    ps = 16
    args = _case(n=2 * group, k=2, h=h, page_size=ps, slots=7, pad=3, dtype=dtype)
    got = ragged.ragged_paged_attention(*args, backend="tpu", block_q=8, interpret=True)
    assert got.shape == args[0].shape and got.dtype == dtype
    _close(got, ragged.ragged_paged_attention_reference(*args), dtype)


def test_schedule_items_and_rows():
    """Work items by hand for q_lens [1, 5, 0-padding] with block_q 4: seq 0 one item, seq 1 two
    (rows 4 and 1), then dead items; each row's item and row."""
    cu = jnp.asarray([0, 1, 6, 99], jnp.int32)
    kv = jnp.asarray([3, 9, 5], jnp.int32)
    sch = ragged.schedule(cu, kv, jnp.int32(2), 8, 4)
    w = ragged.num_items(8, 3, 4)
    assert w == 4 and sch.seq.shape == (w,)
    np.testing.assert_array_equal(sch.rows, [1, 4, 1, 0])
    np.testing.assert_array_equal(sch.seq[:3], [0, 1, 1])
    np.testing.assert_array_equal(sch.pos[:3], [2, 4, 8])
    np.testing.assert_array_equal(sch.q0[:3], [0, 1, 5])
    np.testing.assert_array_equal(sch.tok_item[:6], [0, 1, 1, 1, 1, 2])
    np.testing.assert_array_equal(sch.tok_row[:6], [0, 0, 1, 2, 3, 0])
    np.testing.assert_array_equal(sch.tok_pos[:6], [2, 4, 5, 6, 7, 8])
    np.testing.assert_array_equal(sch.tok_live, [True] * 6 + [False] * 2)


def test_bad_input_is_named():
    q, kp, vp, table, cu, lens, ns = _case()
    rpa = lambda *a, **kw: ragged.ragged_paged_attention(*a, interpret=True, **kw)
    with pytest.raises(ValueError, match="multiple of the number of kv heads"):
        rpa(q[:, :3], kp, vp, table, cu, lens, ns)
    with pytest.raises(ValueError, match=r"cu_q_lens must have shape \[S \+ 1\]"):
        rpa(q, kp, vp, table, cu[:-1], lens, ns)
    with pytest.raises(ValueError, match=r"kv_lens must have shape \[S\]"):
        rpa(q, kp, vp, table, cu, lens[:-1], ns)
    with pytest.raises(ValueError, match=r"num_seqs must lie in \[0, S\]"):
        rpa(q, kp, vp, table, cu, lens, jnp.int32(9))
    with pytest.raises(ValueError, match="num_seqs must be an int32 scalar"):
        rpa(q, kp, vp, table, cu, lens, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="block_q must be a power of two"):
        rpa(q, kp, vp, table, cu, lens, ns, block_q=6)
    with pytest.raises(ValueError, match="q_len >= 1"):
        rpa(q, kp, vp, table, cu.at[2].set(cu[1]), lens, ns)
    with pytest.raises(ValueError, match=r"end \(at num_seqs=6\) <= T"):
        rpa(q[:30], kp, vp, table, cu, lens, ns)
    with pytest.raises(ValueError, match=r"kv_lens must lie in \[q_len, max_pages \* page_size\]"):
        rpa(q, kp, vp, table, cu, lens.at[4].set(3), ns)
    with pytest.raises(ValueError, match=r"kv_lens must lie in"):
        rpa(q, kp, vp, table, cu, lens.at[0].set(33), ns)
    with pytest.raises(ValueError, match="must be integer"):
        rpa(q, kp, vp, table.astype(jnp.float32), cu, lens, ns)
    with pytest.raises(ValueError, match="head dims differ"):
        rpa(q[..., :16], kp, vp, table, cu, lens, ns)
    with pytest.raises(ValueError, match="backend must be"):
        ragged.ragged_paged_attention(q, kp, vp, table, cu, lens, ns, backend="cuda")
    odd = _case(page_size=6)
    with pytest.raises(ValueError, match="powers of two"):
        jax.jit(lambda *a: ragged.ragged_paged_attention(*a, backend="generic", interpret=False)).trace(*odd)


# ----------------------------------------------------------------------------- the quantized variant


def _quant_case(mode, n=4, k=2, h=32, page_size=8, max_pages=4, slots=8, pad=5, dtype=jnp.float32):
    """The mix of `_case` over a shuffled quantized pool and a shuffled full-precision pool."""
    q_lens, kv_lens = _mix(page_size)
    cu, lens, tq, t, pool = _layout(q_lens, kv_lens, page_size, max_pages, slots, pad)
    tf = RNG.permutation(pool)[: slots * max_pages].reshape(slots, max_pages).astype(np.int32)
    kf, vf = (jnp.asarray(RNG.standard_normal((pool, page_size, k, h)), dtype) for _ in range(2))
    kq, vq = (jnp.asarray(RNG.standard_normal((pool, page_size, k, h)), jnp.float32) for _ in range(2))
    qp = quant.quantize_pages(kq, vq, mode, dtype)
    q = jnp.asarray(RNG.standard_normal((t, n, h)), dtype)
    return q, kf, vf, qp, jnp.asarray(tq), jnp.asarray(tf), jnp.asarray(cu), jnp.asarray(lens), jnp.int32(len(q_lens))


def _per_row_quant_reference(args, mode, residual, quant_pages=None):
    """kernel_quant's per-row semantics (quant.paged_attention_quant_reference): each query row a
    row of its own with its sequence's tables and length position + 1 (the engine's rows today)."""
    q, kf, vf, qp, tq, tf, cu, lens, ns = args
    sch = ragged.schedule(cu, lens, ns, q.shape[0], 1)
    live = int(cu[int(ns)])
    rows = np.asarray(sch.tok_seq)[:live]
    per_row = None if quant_pages is None else quant_pages[rows]
    return quant.paged_attention_quant_reference(
        q[:live],
        kf,
        vf,
        qp,
        tq[rows],
        tf[rows],
        sch.tok_pos[:live] + 1,
        mode=mode,
        residual=residual,
        quant_pages=per_row,
    )


@pytest.mark.parametrize("mode", ["int8", "kivi4", "kivi2"])
@pytest.mark.parametrize("residual,block_q,page_size", [(0, 16, 8), (1, 4, 8), (0, 16, 16)])
def test_quant_kernel_equals_its_reference_and_the_per_row_semantics(mode, residual, block_q, page_size):
    """Default counts: the query at position p reads page i quantized iff i < n_quant(p + 1), so
    blocks crossing a page boundary mix the pools per row. page_size 16, block_q 16: the dot form
    (kivi2's parts are H / 4 = 8 wide: broadcast form there)."""
    args = _quant_case(mode, page_size=page_size)
    kw = dict(mode=mode, residual=residual)
    want = ragged.ragged_paged_attention_quant_reference(*args, **kw)
    got = jax.jit(lambda *a: ragged.ragged_paged_attention_quant(*a, block_q=block_q, interpret=True, **kw))(*args)
    assert got.shape == args[0].shape
    _close(got, want, jnp.float32)
    live = int(args[6][int(args[8])])
    _close(want[:live], _per_row_quant_reference(args, mode, residual), jnp.float32)
    assert not np.asarray(got[live:]).any()
    # the pools really are mixed: all-full-precision (explicit 0 pages) differs
    other = ragged.ragged_paged_attention_quant_reference(*args, mode=mode, quant_pages=jnp.zeros(8, jnp.int32))
    assert not np.allclose(np.asarray(other), np.asarray(want), atol=1e-3)


def test_quant_kernel_with_explicit_quant_pages():
    """quant_pages [S]: every query of s reads pages [0, quant_pages[s]) quantized."""
    mode = "kivi4"
    args = _quant_case(mode)
    nq = jnp.asarray([0, 1, 0, 2, 3, 4, 9, 9], jnp.int32)
    want = ragged.ragged_paged_attention_quant_reference(*args, mode=mode, quant_pages=nq)
    got = ragged.ragged_paged_attention_quant(*args, mode=mode, quant_pages=nq, block_q=4, interpret=True)
    _close(got, want, jnp.float32)
    live = int(args[6][int(args[8])])
    _close(want[:live], _per_row_quant_reference(args, mode, 0, nq), jnp.float32)


def test_quant_kernel_bf16_and_the_default_platform_choice():
    args = _quant_case("kivi4", page_size=16, dtype=jnp.bfloat16)
    want = ragged.ragged_paged_attention_quant_reference(*args, mode="kivi4", residual=1)
    got = jax.jit(lambda *a: ragged.ragged_paged_attention_quant(*a, mode="kivi4", residual=1))(*args)
    _close(got, want, jnp.bfloat16)


def test_quant_kernel_never_reads_outside_its_windows():
    """Quantized-table entries at or past the sequence's largest count (its last query's) and
    full-precision entries before its smallest (its first query's) or past its pages may hold
    anything: pointing them at NaN pages leaves the output bit for bit unchanged."""
    mode, residual, ps = "kivi2", 1, 8
    q, kf, vf, qp, tq, tf, cu, lens, ns = _quant_case(mode)
    ns_, cu_np, lens_np = int(ns), np.asarray(cu), np.asarray(lens)
    q_lens = np.diff(cu_np[: ns_ + 1])
    idx = np.arange(tq.shape[1])[None, :]
    nq_hi = np.maximum(lens_np[:ns_] // ps - residual, 0)
    nq_lo = np.maximum((lens_np[:ns_] - q_lens + 1) // ps - residual, 0)
    pages = -(-lens_np[:ns_] // ps)
    read_q = np.asarray(tq)[:ns_][idx < nq_hi[:, None]]
    read_f = np.asarray(tf)[:ns_][(idx >= nq_lo[:, None]) & (idx < pages[:, None])]
    bad_q = next(p for p in range(kf.shape[0]) if p not in read_q)
    bad_f = next(p for p in range(kf.shape[0]) if p not in read_f)
    tq2, tf2 = np.full_like(np.asarray(tq), bad_q), np.full_like(np.asarray(tf), bad_f)
    tq2[:ns_] = np.where(idx < nq_hi[:, None], np.asarray(tq)[:ns_], bad_q)
    tf2[:ns_] = np.where((idx >= nq_lo[:, None]) & (idx < pages[:, None]), np.asarray(tf)[:ns_], bad_f)
    qp2 = {name: a.at[bad_q].set(jnp.nan) if name not in ("kq", "vq") else a for name, a in qp.items()}
    run = lambda *a: ragged.ragged_paged_attention_quant(*a, mode=mode, residual=residual, block_q=8, interpret=True)
    want = run(q, kf, vf, qp, tq, tf, cu, lens, ns)
    got = run(
        q, kf.at[bad_f].set(jnp.nan), vf.at[bad_f].set(jnp.nan), qp2, jnp.asarray(tq2), jnp.asarray(tf2), cu, lens, ns
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------------------------------------- GPU (Triton), ahead of time


def _abstract(dtype, n, k, h=128, page_size=16, t=64, s=8, max_pages=8, pages=64, sharding=None):
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    return (
        S((t, n, h), dtype),
        S((pages, page_size, k, h), dtype),
        S((pages, page_size, k, h), dtype),
        S((s, max_pages), jnp.int32),
        S((s + 1,), jnp.int32),
        S((s,), jnp.int32),
        S((), jnp.int32),
    )


def _abstract_quant(mode, sharding=None, **kw):
    a = _abstract(jnp.bfloat16, 8, 2, sharding=sharding, **kw)
    pages, page_size, k, h = a[1].shape
    qp = {
        name: jax.ShapeDtypeStruct(shape, jnp.uint8 if name in ("kq", "vq") else jnp.bfloat16, sharding=sharding)
        for name, shape in quant.page_shapes(mode, pages, page_size, k, h).items()
    }
    return (a[0], a[1], a[2], qp, a[3], a[3], a[4], a[5], a[6])


def _lower_for_h100(fn, args) -> str:
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n,k,block_q", [(8, 2, 16), (8, 8, 4), (12, 4, 32)])
def test_lowers_through_triton_for_a_gpu_ahead_of_time(n, k, block_q, dtype):
    """interpret=False lowered for an abstract H100 (platform "cuda"): Pallas's Triton lowering
    accepts the kernel (dot form for (8, 2, 16) and (12, 4, 32): G = 3 padded to 4; broadcast form
    for block_q 4, G 1), and the Mosaic branch is not lowered."""
    fn = lambda *a: ragged.ragged_paged_attention(*a, block_q=block_q, interpret=False)
    text = _lower_for_h100(fn, _abstract(dtype, n, k))
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "tpu_custom_call" not in text


@pytest.mark.parametrize("mode", ["int8", "kivi4", "kivi2"])
@pytest.mark.parametrize("explicit", [False, True])
def test_quant_lowers_through_triton_for_a_gpu_ahead_of_time(mode, explicit):
    def fn(q, kf, vf, qp, tq, tf, cu, lens, ns):
        nq = jnp.zeros(tq.shape[:1], jnp.int32) if explicit else None
        return ragged.ragged_paged_attention_quant(
            q, kf, vf, qp, tq, tf, cu, lens, ns, mode=mode, residual=1, quant_pages=nq, interpret=False
        )

    assert _lower_for_h100(fn, _abstract_quant(mode)).count("__gpu$xla.gpu.triton") == 1


@pytest.mark.skipif(not targets.has_cuda_plugin(), reason="needs jax-cuda13-plugin (.[gpu-aot])")
def test_compiles_to_sass_for_an_h100_deviceless():
    """Deviceless XLA:GPU compile (docs/gpu_aot_findings.md): Triton's passes and ptxas run for
    sm_90a on the dot form (bf16, fp32), the broadcast form (page 8) and kivi4. Nothing runs."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(targets.devices(targets.parse("h100-1"))), ("x",))
    sh = NamedSharding(mesh, P())
    shard = lambda f, n: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(),) * n, out_specs=P(), check_vma=False))
    rpa = lambda *a: ragged.ragged_paged_attention(*a, interpret=False)
    for args in (
        _abstract(jnp.bfloat16, 8, 2, sharding=sh),
        _abstract(jnp.float32, 6, 3, h=64, sharding=sh),
        _abstract(jnp.bfloat16, 8, 2, h=64, page_size=8, sharding=sh),
        # MLA's latent rows: 16 heads on one kv head, H = 576 (512 + 64 parts); whole 256-row tiles
        # at H = 1024 asked 640 KB of shared memory (232 KB on an H100), 16-row programs compile
        _abstract(jnp.bfloat16, 16, 1, h=576, sharding=sh),
        _abstract(jnp.bfloat16, 16, 1, h=1024, sharding=sh),
    ):
        assert "__gpu$xla.gpu.triton" in shard(rpa, 7).lower(*args).compile().as_text()
    quant_fn = lambda *a: ragged.ragged_paged_attention_quant(*a, mode="kivi4", residual=1, interpret=False)
    assert "__gpu$xla.gpu.triton" in shard(quant_fn, 9).lower(*_abstract_quant("kivi4", sh)).compile().as_text()


# ----------------------------------------------------------------------------- TPU compiler (ahead of time)


@pytest.mark.skipif(not targets.has_libtpu(), reason="needs libtpu (bash scripts/bootstrap --test)")
@pytest.mark.parametrize("target", ["v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "n,k,page_size,h,block_q",
    [
        (8, 2, 16, 128, 16),
        (32, 8, 64, 128, 16),
        (8, 1, 16, 64, 32),
        (12, 4, 32, 64, 8),
        (8, 2, 128, 256, 16),
        (16, 1, 16, 576, 16),  # MLA's latent rows: 16 heads on one kv head, 512 + 64 wide
    ],
)
def test_tpu_variant_compiles_with_mosaic(target, n, k, page_size, h, block_q, dtype):
    """interpret=False lowered for a v5p / v6e slice inside a shard_map (every operand replicated:
    the kernel cannot be partitioned automatically): Mosaic accepts the scalar-prefetch grid, the
    (R, H) query blocks and the (page_size, H or K * H) page blocks, and the compiled program holds
    its custom call. Nothing runs: there is no TPU here."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxsys.kernels.tpu_compile_grid import tpu_mesh

    mesh = tpu_mesh(target)
    args = _abstract(dtype, n, k, h=h, page_size=page_size, t=96, sharding=NamedSharding(mesh, P()))
    f = jax.jit(
        jax.shard_map(
            lambda *a: ragged.ragged_paged_attention(*a, block_q=block_q, interpret=False),
            mesh=mesh,
            in_specs=(P(),) * 7,
            out_specs=P(),
            check_vma=False,
        )
    )
    with targets.quiet_libtpu():
        text = f.lower(*args).compile().as_text()
    assert "tpu_custom_call" in text


# ----------------------------------------------------------------------------- bench_ragged.py's traffic analysis


def test_traffic_analysis_by_hand():
    """One decode at kv_len 64 (page 16: 4 pages), one chunk of 32 queries at positions 32..63:
    per row the chunk reads 16 x 3 + 16 x 4 = 112 pages, in blocks of 16 it reads 3 + 4 = 7; plus
    the decode's 4 each way."""
    t = bench_ragged.kv_traffic([1, 32], [64, 64], page_size=16, block_q=16, kv_heads=2, head_dim=8, itemsize=2)
    assert t["per_row_pages"] == 116 and t["ragged_pages"] == 11
    assert t["per_row_bytes"] == 116 * 2 * 16 * 8 * 2 * 2
    assert t["ratio"] == pytest.approx(116 / 11)


def test_bench_prints_the_traffic_of_the_default_mix():
    """32 decodes at kv_len 1024 and chunks of 256 at positions 0.. and 768..: per row 2048 + 2176
    + 14464 = 18688 pages per kv head, block_q 16: 2048 + 136 + 904 = 3088 (ratio 6.05)."""
    t = bench_ragged.kv_traffic(
        *bench_ragged.mixed_step(), page_size=16, block_q=16, kv_heads=1, head_dim=1, itemsize=1
    )
    assert (t["per_row_pages"], t["ragged_pages"]) == (18688, 3088)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench_ragged.main(["--traffic-only"]) == 0
    assert "6.05" in out.getvalue()
