"""Document masks for packed rows (`transformer.token_losses(..., segments=...)`): a row holds
several documents, and no token attends across them.

The ground truth is each document alone: placed at the start of a row of its own and run with
`segments=None` (what the model did before packing existed). Causal attention never looks ahead, so
the filler tokens after the document change none of its losses, and its positions start at 0. A
packed row's per-token loss at a position whose input and target are in the same document must
equal that document's own loss there, for every kernel and layout below; and the gradients of the
packed loss summed over those positions must equal the summed gradients of the documents alone.

Tolerances (fp32). A masked score contributes an exact 0 in every kernel, so the packed and the
alone computations add the same nonzero terms, only in a different order (blocked online softmax,
the LSE merge of context parallelism, sums over rows of different lengths, RoPE angles of other
positions: RoPE scores depend only on the distance, so the restart changes them by rounding).
Seen: per-token losses (~5.5) within 1e-7 relative, summed losses within 2e-7, gradients within
6e-7 of their leaf's largest entry. The bounds: 1e-5 relative on losses; gradients 1e-5 relative
plus 2e-5 of their leaf's largest entry (tests/test_context.py's bound: entries built by
cancellation carry the rounding of the large terms). Each comparison also checks that it can
fail: the same packed rows without segment ids (documents attending to the ones before them) are
off by more than 1e-3 (0.25 absolute on the losses). Because RoPE is relative, the restart of the
positions is checked on the positions themselves (`test_segment_positions_restart_at_each_document`).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxsys.config import ConfigError
from jaxsys.models import attention as attention_lib
from jaxsys.models import transformer
from jaxsys.parallel import context, pipeline
from jaxsys.parallel.spmd import per_shard
from tests.helpers import assert_trees_close_leafwise, pipeline_config, program_for, small_config

T = 32  # config.data.seq_len of the tiny test model: rows of T + 1 tokens
# documents of each packed row (lengths in tokens, summing to T + 1; 0: padding to the end)
ROWS = [[9, 14, 10], [20, 13], [5, 17, 6, 0], [33]]
PADDING = {2: 5}  # row -> padding tokens at its end


def _packed_batch(seed: int = 0):
    """tokens, segments [4, T + 1] and the documents [(row, start, length)]."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (len(ROWS), T + 1)).astype(np.int32)
    segments = np.zeros((len(ROWS), T + 1), np.int32)
    docs = []
    for r, lengths in enumerate(ROWS):
        start = 0
        for i, n in enumerate(lengths):
            if n == 0:
                n = PADDING[r]
                assert start + n == T + 1
                break
            segments[r, start : start + n] = i + 1
            docs.append((r, start, n))
            start += n
        assert start == T + 1 or r in PADDING
    return tokens, segments, docs


def _alone_batch(tokens, docs, seed: int = 1):
    """One row per document: the document from position 0, then random filler."""
    rows = np.random.default_rng(seed).integers(0, 256, (len(docs), T + 1)).astype(np.int32)
    for i, (r, start, n) in enumerate(docs):
        rows[i, :n] = tokens[r, start : start + n]
    return rows


def _weights(docs, rows: int):
    """[rows, T] 1 where input and target are in the same document of row r (packed layout)."""
    w = np.zeros((rows, T), np.float32)
    for r, start, n in docs:
        w[r, start : start + n - 1] = 1.0
    return w


def _alone_weights(docs):
    w = np.zeros((len(docs), T), np.float32)
    for i, (_, _, n) in enumerate(docs):
        w[i, : n - 1] = 1.0
    return w


def _to_alone_layout(packed, docs):
    """Per-token values of packed rows [rows, T] moved to the alone layout [docs, T] (0 elsewhere)."""
    out = np.zeros((len(docs), T), np.float32)
    for i, (r, start, n) in enumerate(docs):
        out[i, : n - 1] = packed[r, start : start + n - 1]
    return out


def _losses_fn(program, with_segments: bool):
    """jit(params, tokens[, segments]) -> per-token losses [B, T] in global order."""
    layout, m, specs = program.layout, program.config.model, program.specs
    seq = context.SeqLayout.of(layout, m)
    batch = layout.compute_axes("batch") or None
    seq_axes = layout.compute_axes("seq") or None
    out_spec = P(batch, seq_axes)

    def local(params, tokens, segments=None):
        losses, _ = transformer.token_losses(params, tokens, m, layout, specs, segments=segments)
        where = jnp.broadcast_to(context.positions(T, seq), losses.shape)  # global position of each
        return losses, where

    in_specs = (program.param_pspecs, program.batch_pspec) + ((program.batch_pspec,) if with_segments else ())
    f = jax.jit(per_shard(local, program.mesh, in_specs, (out_spec, out_spec)))

    def call(params, *args):
        losses, where = (np.asarray(a) for a in f(params, *args))
        out = np.zeros_like(losses)
        np.put_along_axis(out, where, losses, axis=1)
        return out

    return call


_alone: dict = {}


def _alone_losses(params, docs, tokens):
    """Each document's own per-token losses [docs, T] on one device, reference attention. Computed
    once: every config here initialises the same parameters (one seed, one model shape)."""
    if "losses" not in _alone:
        program = program_for(small_config({}))
        _alone["losses"] = _losses_fn(program, False)(params, _alone_batch(tokens, docs))
    return _alone["losses"]


LAYOUTS = {
    "one_device": ({}, {}),
    "seq2_ring_zigzag": (dict(seq=2), dict(context_parallel="ring", context_load_balance=True)),
    "seq2_ring_contiguous": (dict(seq=2), dict(context_parallel="ring", context_load_balance=False)),
    "seq2_allgather_zigzag": (dict(seq=2), dict(context_parallel="allgather", context_load_balance=True)),
    "seq2_tokenring_zigzag": (dict(seq=2), dict(context_parallel="tokenring", context_load_balance=True)),
}
IMPLS = {"reference": {}, "pallas": dict(attention_impl="pallas", attention_block=16)}
CASES = [(lay, impl) for lay in LAYOUTS for impl in IMPLS if impl == "reference" or "tokenring" not in lay]


@pytest.mark.parametrize("layout,impl", CASES)
def test_packed_losses_equal_each_document_alone(layout, impl):
    mesh, model = LAYOUTS[layout]
    program = program_for(small_config(mesh, **model, **IMPLS[impl]))
    params = jax.tree.map(np.asarray, program.init().params)
    tokens, segments, docs = _packed_batch()
    want = _alone_losses(params, docs, tokens)
    packed_fn = _losses_fn(program, True)
    got = _to_alone_layout(packed_fn(params, tokens, segments), docs)
    mask = _alone_weights(docs) > 0
    np.testing.assert_allclose(got[mask], want[mask], rtol=1e-5, atol=0)
    # the check can fail: without the segment ids every later document sees the earlier ones
    unmasked = _to_alone_layout(_losses_fn(program, False)(params, tokens), docs)
    assert np.abs(unmasked[mask] - want[mask]).max() > 1e-3


def test_one_document_per_row_equals_no_segments():
    """segments all 1 (one document filling each row) gives the losses of segments=None."""
    program = program_for(small_config({}))
    params = jax.tree.map(np.asarray, program.init().params)
    tokens, _, _ = _packed_batch()
    ones = np.ones_like(tokens)
    got = _losses_fn(program, True)(params, tokens, ones)
    want = _losses_fn(program, False)(params, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ------------------------------------------------------------------------------------------ gradients


def _objective_fn(program, with_segments: bool):
    """jit(params, tokens, weights[, segments]) -> (sum of weights * per-token losses, gradients)."""
    layout, m, specs = program.layout, program.config.model, program.specs
    seq = context.SeqLayout.of(layout, m)
    batch = layout.compute_axes("batch") or None

    def local(params, tokens, weights, segments=None):
        losses, _ = transformer.token_losses(params, tokens, m, layout, specs, segments=segments)
        w = context.shard_sequence(weights, seq)
        return jnp.sum(losses * w)[None]

    in_specs = (program.param_pspecs, program.batch_pspec, P(batch, None))
    in_specs += (program.batch_pspec,) if with_segments else ()
    shards = per_shard(local, program.mesh, in_specs, P(layout.batch_axes or None))
    return jax.jit(jax.value_and_grad(lambda params, *args: jnp.sum(shards(params, *args))))


def _numpy(tree):
    return jax.tree.map(np.asarray, tree)


def _largest_relative_gap(got, want) -> float:
    """max over leaves of max |got - want| / max |want|."""
    gaps = jax.tree.map(lambda a, b: float(np.abs(a - b).max() / np.abs(b).max()), got, want)
    return max(jax.tree.leaves(gaps))


GRAD_CASES = ["one_device/reference", "one_device/pallas", "seq2_ring_zigzag/reference"]
GRAD_CASES += [pytest.param("seq2_allgather_zigzag/reference", marks=pytest.mark.slow)]  # CI time
GRAD_CASES += ["seq2_tokenring_zigzag/reference"]
GRAD_CASES += [pytest.param("seq2_ring_zigzag/pallas", marks=pytest.mark.slow)]  # ~60 s: the custom ring backward


@pytest.mark.parametrize("case", GRAD_CASES)
def test_packed_gradients_equal_the_sum_over_documents(case):
    layout, impl = case.split("/")
    mesh, model = LAYOUTS[layout]
    program = program_for(small_config(mesh, **model, **IMPLS[impl]))
    params = jax.tree.map(np.asarray, program.init().params)
    tokens, segments, docs = _packed_batch()
    one = program_for(small_config({}))
    want_loss, want_grads = _numpy(_objective_fn(one, False)(params, _alone_batch(tokens, docs), _alone_weights(docs)))
    weights = _weights(docs, len(ROWS))
    loss, grads = _numpy(_objective_fn(program, True)(params, tokens, weights, segments))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_trees_close_leafwise(grads, want_grads, rtol=1e-5, atol=lambda w: 2e-5 * np.abs(w).max())
    # the check can fail: the gradients without segment ids differ by far more than the tolerance
    _, unmasked = _numpy(_objective_fn(program, False)(params, tokens, weights))
    assert _largest_relative_gap(unmasked, want_grads) > 1e-3


# ------------------------------------------------------------------------------------------ pipeline

ALLGATHER = dict(context_parallel="allgather")


def _pipeline_objective(program, with_segments: bool):
    """The pipeline executor (parallel/pipeline.py) on packed rows as program._pipeline runs it,
    the micro-batches carrying their segment ids, positions and loss weights as extras:
    jit(params, tokens, weights, segments) -> (weighted loss, gradients summed over the shards)."""
    m, layout, specs = program.config.model, program.layout, program.specs
    prog = program.pipeline_train
    batch = layout.compute_axes("batch") or None
    seq = context.SeqLayout.of(layout, m)

    def local(params, tokens, weights, segments):
        weights = context.shard_sequence(weights, seq)
        if with_segments:
            inputs, targets, positions, segs = transformer.split_tokens(tokens, m, layout, segments)
        else:
            inputs, targets, positions = transformer.split_tokens(tokens, m, layout)
            segs = None
        split = lambda a: a.reshape(prog.m, a.shape[0] // prog.m, *a.shape[1:])
        extras = {"weights": split(weights)}
        if with_segments:
            extras.update(segments=split(segs), positions=split(positions))

        def stack(w, x, extra):
            pos = extra.get("positions", positions)
            y, _ = transformer.layer_stack(w, x, pos, m, layout, specs, segments=extra.get("segments"))
            return y, jnp.zeros((), jnp.float32), {}

        def loss(sh, h, t, extra):
            return jnp.sum(transformer.output_loss(sh, h, t, m, layout, specs) * extra["weights"])

        fns = pipeline.StageFns(
            embed=lambda sh, ids: transformer.embed(sh, ids, m, layout, specs),
            stack=stack,
            norm=lambda sh, y: transformer.final_norm(sh, y, m, layout, specs),
            loss=loss,
        )
        value, grads, _ = pipeline.run(fns, params, split(inputs), split(targets), prog, extras)
        # as zero.reduce_gradient would: summed over the batch shards (here `seq`), and leaves
        # replicated over `pipe` (embedding, head) summed there too
        total = lambda tree, axes: jax.tree.map(lambda a: jax.lax.psum(a, axes), tree) if axes else tree
        grads = {k: total(g, layout.batch_axes + (() if k == "layers" else ("pipe",))) for k, g in grads.items()}
        return total(value, layout.batch_axes), grads

    in_specs = (program.param_pspecs, program.batch_pspec, P(batch, None), program.batch_pspec)
    f = per_shard(local, program.mesh, in_specs, (P(), program.param_pspecs))
    return jax.jit(f)


PIPELINE_LAYOUTS = {"pipe2": (dict(pipe=2), {}), "pipe2_seq2_allgather": (dict(pipe=2, seq=2), ALLGATHER)}


@pytest.mark.parametrize("layout", ["pipe2", pytest.param("pipe2_seq2_allgather", marks=pytest.mark.slow)])
def test_pipeline_packed_loss_and_gradients_equal_the_documents_alone(layout):
    """1F1B over 2 micro-batches of 2 rows on pipe=2 (and with all-gather context parallelism,
    the CP variant a pipeline takes on CPU): the pipeline gives its loss as a weighted sum (the
    executor returns no per-token losses), so the loss and every gradient are compared, each a
    sum over the documents' in-document positions."""
    mesh, model = PIPELINE_LAYOUTS[layout]
    config = pipeline_config(mesh, "1f1b", microbatches=2, **model)
    config.train.batch_size = len(ROWS)
    program = program_for(config)
    params = jax.tree.map(np.asarray, program.init().params)
    tokens, segments, docs = _packed_batch()
    one_config = pipeline_config({}, microbatches=1)
    one = program_for(one_config)
    want_loss, want_grads = _numpy(_objective_fn(one, False)(params, _alone_batch(tokens, docs), _alone_weights(docs)))
    weights = _weights(docs, len(ROWS))
    loss, grads = _numpy(_pipeline_objective(program, True)(params, tokens, weights, segments))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_trees_close_leafwise(grads, want_grads, rtol=1e-5, atol=lambda w: 2e-5 * np.abs(w).max())
    # the check can fail: the same pipeline without the segment ids
    unmasked_loss, unmasked = _numpy(_pipeline_objective(program, False)(params, tokens, weights, segments))
    assert abs(unmasked_loss - want_loss) > 1e-3 * abs(want_loss)
    assert _largest_relative_gap(unmasked, want_grads) > 1e-3


# ------------------------------------------------------------------------------------------ attention


def _qkv_and_segments(b=2, t=T, n=4, kh=2, h=16, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, t, n, h), (b, t, kh, h), (b, t, kh, h)))
    segments = np.zeros((b, t), np.int32)
    segments[0] = np.repeat([1, 2, 3], [7, 13, 12])
    segments[1] = np.repeat([1, 2, 0], [20, 9, 3])
    return q, k, v, jnp.asarray(segments)


def _junk_outside(x, segments, doc: int, seed: int):
    """x with every position outside document `doc` replaced by large finite junk."""
    junk = jnp.asarray(10 * np.random.default_rng(seed).standard_normal(x.shape), x.dtype)
    return jnp.where((segments == doc)[:, :, None, None], x, junk)


def _attention_fn(mesh_axes: dict, impl: str, variant: str = "ring", balance: bool = True):
    config = small_config(mesh_axes, attention_impl=impl, attention_block=16, context_parallel=variant)
    config.model.context_load_balance = balance
    program = program_for(config)
    layout, m = program.layout, program.config.model
    seq = context.SeqLayout.of(layout, m)
    spec = P(None, layout.compute_axes("seq") or None)

    def local(q, k, v, segments):  # the inputs are already in this device's chunk order
        return attention_lib.softmax_attention(q, k, v, m, seq, segments)

    f = jax.jit(per_shard(local, program.mesh, (spec, spec, spec, spec), spec))
    order = np.asarray(context.chunk_table(seq.size, seq.balance)).reshape(-1) if seq.axes else np.zeros(1, int)
    tc = T // len(order)
    perm = np.concatenate([np.arange(c * tc, (c + 1) * tc) for c in order])  # device order -> global

    def call(q, k, v, segments):
        out = f(*(jnp.take(a, perm, axis=1) for a in (q, k, v, segments)))
        return np.asarray(out)[:, np.argsort(perm)]

    return call


ATTENTION_CASES = {
    "reference": ({}, "reference", "ring"),
    "pallas": ({}, "pallas", "ring"),
    "seq2_ring": (dict(seq=2), "reference", "ring"),
    "seq2_ring_pallas": (dict(seq=2), "pallas", "ring"),
    "seq2_allgather": (dict(seq=2), "reference", "allgather"),
    "seq2_tokenring": (dict(seq=2), "reference", "tokenring"),
}


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_other_documents_keys_and_values_do_not_change_the_output(name):
    """Replacing every key and value outside a document by junk leaves that document's outputs
    exactly as they were: its attention weights on other documents are exactly 0. Without the
    segment ids the same junk changes them."""
    mesh_axes, impl, variant = ATTENTION_CASES[name]
    attend = _attention_fn(mesh_axes, impl, variant)
    q, k, v, segments = _qkv_and_segments()
    base = attend(q, k, v, segments)
    for doc in (1, 2):
        k2, v2 = _junk_outside(k, segments, doc, 10 + doc), _junk_outside(v, segments, doc, 20 + doc)
        got = attend(q, k2, v2, segments)
        rows = np.asarray(segments == doc)
        np.testing.assert_array_equal(got[rows], base[rows])
    one = jnp.ones_like(segments)  # one document per row: the junk now counts
    assert np.abs(attend(q, k2, v2, one)[rows] - attend(q, k, v, one)[rows]).max() > 1e-2


def test_linear_attention_layers_refuse_segments_by_name():
    program = program_for(small_config({}, layer_pattern="linear,softmax", linear_chunk=8))
    tokens, segments, _ = _packed_batch()
    with pytest.raises(ConfigError, match=r"config\.data\.packing.*config\.model\.layer_pattern='linear,softmax'"):
        _losses_fn(program, True)(program.init().params, tokens, segments)


def test_segment_positions_restart_at_each_document():
    segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    got = transformer.segment_positions(segments)
    chex.assert_trees_all_equal(np.asarray(got), np.array([[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]))
    # split_tokens cuts them like the tokens: zigzag chunks on seq=2 hold the right positions
    program = program_for(small_config(dict(seq=2)))
    tokens, segs, _ = _packed_batch()
    m, layout = program.config.model, program.layout

    def local(tokens, segments):
        _, _, positions, seg = transformer.split_tokens(tokens, m, layout, segments)
        return positions, seg

    spec = P(None, "seq")
    f = jax.jit(per_shard(local, program.mesh, (P(), P()), (spec, spec)))
    positions, seg = (np.asarray(a) for a in f(tokens, segs))
    perm = np.concatenate([np.arange(c * 8, (c + 1) * 8) for c in (0, 3, 1, 2)])  # devices' chunks
    want = np.asarray(transformer.segment_positions(jnp.asarray(segs[:, :-1])))
    np.testing.assert_array_equal(positions, want[:, perm])
    np.testing.assert_array_equal(seg, segs[:, :-1][:, perm])
