"""Speculative decoding as a drafter the engine calls (Leviathan et al. 2023; Chen et al. 2023):
a draft proposes k tokens, the target scores them in one pass, and the rejection rule keeps the
output distribution exactly the target's. It composes with any cache: the drafter only adds rows.

The engine (serve/engine.py) gives a running sequence with `spec_k = k` a decode work of 1 + k'
rows (k' = k clamped so that the verified tokens never pass max_new_tokens, and so that the step's
token budget holds: `Scheduler.lookahead`); k = 0 sequences decode one token, and prefill chunks of
other requests share the same step. One engine step is then

  1. `propose`: draft rounds: the draft proposes d_1..d_k' for every speculating sequence, one
     draft step per round batched across sequences (each sequence stops at its own k'), keeping
     its distributions q_i on the device;
  2. one target step (the verify): a speculating sequence's rows are [last, d_1..d_k'] at
     positions p..p+k' with its cache table, so its keys and values are written and the target's
     logits come back at all k' + 1 rows;
  3. `verify`: the rejection rule (`accept`, vmapped over the sequences of one (k', greedy) group)
     gives each sequence n accepted drafts and the next token; it appends d_1..d_n and the next
     token, so its cache length becomes p + n + 1. Slots p + n + 1 .. p + k' hold rejected keys
     and values; the next step writes them again before anything reads them (attention masks by
     position).

For drafted x_1..x_k with draft distributions q_i and target distributions p_i (p_{k+1} after the
last draft): accept x_i while u_i < min(1, p_i(x_i) / q_i(x_i)); at the first rejection i emit a
token from norm(max(p_i - q_i, 0)); if all k are accepted emit a bonus token from p_{k+1}. Greedy
requests (temperature 0) accept while the draft equals the target's argmax and emit argmax p_{n+1},
so they get exactly the plain engine's tokens. Sampled requests use the target's filtered
distribution (sampling.filtered_logits) as p and the draft's, filtered the same way, as q: every
emitted token follows the target's distribution (Leviathan et al., Theorem 1).

Two drafters:
* `DraftModel(program, params)`: a smaller jaxsys model with the same vocabulary, with a
  full-precision cache of its own (paged, or contiguous under a contiguous target) addressed
  through the target's page tables, so its pages are reserved and freed with the target's. It
  prefills the speculating requests' prompt chunks in its first round (no extra step), and catches
  up on tokens it has not seen (the last accepted draft of a fully accepted round, steps where a
  sequence decoded plainly) in the same round.
* `SelfSpeculation(window, sink)` (TriForce / StreamingLLM): the target itself reading a sparse
  view of its own paged cache (jaxsys/cache/window.py: attention sinks + the recent window). No
  second cache: the draft's rows write their keys and values into the sequence's own slots
  p..p+k'-1, which the verify step overwrites. Over a KIVI cache the view reads the sealed pages
  quantized, as the target does.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxsys.cache import ContiguousCache, PagedCache, WindowView, kivi, window
from jaxsys.cache import base as cache_base
from jaxsys.cache.base import ROW, ROWS
from jaxsys.serve import sampling as sampling_lib
from jaxsys.serve.runner import ModelRunner


def accept(p, q, drafted, key, greedy: bool = False):
    """One round's verdict for one sequence: p [k+1, V] target probabilities, q [k, V] draft
    probabilities, drafted [k] tokens -> (n accepted, the next token). Jittable."""
    k = drafted.shape[0]
    idx = jnp.arange(k)
    if greedy:
        ok = drafted == jnp.argmax(p[:k], axis=-1)
    else:
        u = jax.random.uniform(jax.random.fold_in(key, 0), (k,))
        ratio = p[idx, drafted] / jnp.maximum(q[idx, drafted], 1e-30)
        ok = u < jnp.minimum(1.0, ratio)
    n = jnp.argmin(jnp.concatenate([ok, jnp.array([False])]))  # the first rejection (k: none)
    if greedy:
        return n, jnp.argmax(p[n]).astype(jnp.int32)
    residual = jnp.maximum(p[n] - jnp.where(n < k, q[jnp.minimum(n, k - 1)], 0.0), 0.0)
    residual = jnp.where(jnp.sum(residual) > 0, residual, p[n])
    token = jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(residual))
    return n, token.astype(jnp.int32)


@functools.partial(jax.jit, donate_argnums=0)
def _draft_rows(q_buffer, logits, at, dest, seed, n, i, temperature, top_k, top_p):
    """Draft tokens for rows logits[at] [R, V]: argmax where temperature == 0, else a draw from the
    filtered distribution (the draft's i-th proposal of the sequence's n-th token, key
    fold_in(token_key, 1)); their distributions q go to rows `dest` of q_buffer. Returns (tokens,
    q_buffer)."""

    def one(lg, seed, n, i, t, tk, tp):
        scaled = sampling_lib.filtered_logits(lg[None], t, tk, tp)[0]
        key = jax.random.fold_in(jax.random.fold_in(sampling_lib.token_key(seed, n), 1), i)
        drawn = jax.random.categorical(key, scaled)
        token = jnp.where(t > 0, drawn, jnp.argmax(lg)).astype(jnp.int32)
        return token, jax.nn.softmax(scaled)

    tokens, q = jax.vmap(one)(logits[at], seed, n, i, temperature, top_k, top_p)
    return tokens, q_buffer.at[dest].set(q)


@functools.partial(jax.jit, static_argnames=("greedy",))
def _accept_rows(logits, rows, q_buffer, q_rows, drafted, seed, n, temperature, top_k, top_p, greedy: bool):
    """`accept` for S sequences of one k: the target's logits at rows [S, k + 1] (the verify rows),
    q at q_buffer rows [S, k], drafted [S, k] -> (accepted [S], next token [S]); the verdict's key
    is fold_in(token_key, 2)."""

    def one(lg, q, d, seed, n, t, tk, tp):
        p = lg if greedy else jax.nn.softmax(sampling_lib.filtered_logits(lg, t, tk, tp), axis=-1)
        return accept(p, q, d, jax.random.fold_in(sampling_lib.token_key(seed, n), 2), greedy=greedy)

    return jax.vmap(one)(logits[rows], q_buffer[q_rows], drafted, seed, n, temperature, top_k, top_p)


@dataclasses.dataclass
class Drafts:
    """One step's proposals: {request id: drafted tokens}, their distributions q [rows, V] on the
    device and {(request id, i): row of q}."""

    tokens: dict
    q: jax.Array
    q_index: dict


class Drafter:
    """The draft rounds every drafter shares; `_run` (one draft step over rows) is its own."""

    def attach(self, engine) -> None:
        """Check the engine can use this drafter and set up what it needs."""

    def forget(self, request_id) -> None:
        """A request finished or was aborted."""

    def warmup(self, engine) -> None:
        for width in engine.widths():
            rows = [[] for _ in range(engine.shards)]
            self._run(engine, rows, width)

    def _run(self, engine, rows: list, width: int):
        """One draft step on `rows` (per shard: (token, position, request id)) padded to `width`
        rows per shard: the draft's logits [D width, V]."""
        raise NotImplementedError

    def _catch_up(self, engine, w, d: int, rows: list) -> bool:
        """Round 0 of a speculating decode: add the rows the draft has not seen; True if it did
        (then the last of them is the one to sample from)."""
        return False

    def _prefill_rows(self, w) -> list:
        """The draft's own prefill rows for a speculating request's prompt chunk (none by default)."""
        return []

    def propose(self, engine, plans) -> Drafts | None:
        """Draft rounds for the step's speculating decodes (none: nothing drafted; a draft model
        still prefills its prompts)."""
        spec = [(d, w) for d, work in enumerate(plans) for w in work if w.kind == "decode" and w.tokens > 1]
        if not spec:
            prefills = [[row for w in work if w.kind == "prefill" for row in self._prefill_rows(w)] for work in plans]
            if any(prefills):
                self._run(engine, prefills, engine.width(max(len(r) for r in prefills)))
                engine.stats["draft_steps"] += 1
            return None
        drafted = {w.request.id: [] for _, w in spec}
        # q of every drafted token of the step (at most the token budget; the last row takes padding)
        q_buffer = jnp.zeros((engine.budget + 1, engine.program.config.model.vocab_size), jnp.float32)
        q_index, offset = {}, 0
        for i in range(max(w.tokens - 1 for _, w in spec)):
            rows: list = [[] for _ in range(engine.shards)]  # per shard: (token, position, request id)
            samples = []  # (shard, row in shard, work)
            for d, work in enumerate(plans):
                for w in work:
                    req = w.request
                    if i == 0 and w.kind == "prefill":
                        rows[d] += self._prefill_rows(w)
                        continue
                    if w.kind != "decode" or w.tokens - 1 <= i:
                        continue
                    if not (i == 0 and self._catch_up(engine, w, d, rows[d])):
                        rows[d].append((req.generated[-1] if i == 0 else drafted[req.id][-1], w.start + i, req.id))
                    samples.append((d, len(rows[d]) - 1, w))
            width = engine.width(max(len(r) for r in rows))
            logits = self._run(engine, rows, width)
            engine.stats["draft_steps"] += 1
            padded = sampling_lib.pad(samples)
            settings = [engine.sampling[w.request.id] for _, _, w in padded]
            dest = np.full(len(padded), engine.budget, np.int32)
            dest[: len(samples)] = offset + np.arange(len(samples))
            toks, q_buffer = _draft_rows(
                q_buffer,
                logits,
                np.asarray([d * width + r for d, r, _ in padded], np.int32),
                dest,
                np.asarray([s.seed for s in settings], np.int32),
                np.asarray([len(w.request.generated) for _, _, w in padded], np.int32),
                np.full(len(padded), i, np.int32),
                np.asarray([s.temperature for s in settings], np.float32),
                np.asarray([s.top_k for s in settings], np.int32),
                np.asarray([s.top_p for s in settings], np.float32),
            )
            for j, (token, (_, _, w)) in enumerate(zip(np.asarray(toks).tolist(), samples)):
                drafted[w.request.id].append(token)
                q_index[(w.request.id, i)] = offset + j
            offset += len(samples)
        return Drafts(drafted, q_buffer, q_index)

    def verify(self, engine, logits, verify_rows: dict, drafts: Drafts) -> dict:
        """The rejection rule for every speculating sequence, vmapped per (k, greedy) group, the
        group padded to a power of two. Returns {request id: accepted drafts + the next token}."""
        groups: dict = {}
        for rid, (row, w) in verify_rows.items():
            groups.setdefault((w.tokens - 1, engine.sampling[rid].temperature <= 0), []).append(rid)
        out = {}
        for (k, greedy), ids in groups.items():
            padded = sampling_lib.pad(ids)
            rows = np.asarray([verify_rows[rid][0] + np.arange(k + 1) for rid in padded], np.int32)
            q_rows = np.asarray([[drafts.q_index[(rid, i)] for i in range(k)] for rid in padded], np.int32)
            settings = [engine.sampling[rid] for rid in padded]
            tokens = np.asarray([drafts.tokens[rid][:k] for rid in padded], np.int32)
            n, nxt = _accept_rows(
                logits,
                rows,
                drafts.q,
                q_rows,
                tokens,
                np.asarray([s.seed for s in settings], np.int32),
                np.asarray([len(verify_rows[rid][1].request.generated) for rid in padded], np.int32),
                np.asarray([s.temperature for s in settings], np.float32),
                np.asarray([s.top_k for s in settings], np.int32),
                np.asarray([s.top_p for s in settings], np.float32),
                greedy=greedy,
            )
            for rid, a, t in zip(ids, np.asarray(n).tolist(), np.asarray(nxt).tolist()):
                out[rid] = drafts.tokens[rid][:a] + [t]
                w = verify_rows[rid][1]
                for counts in (engine.stats, w.request.stats):
                    counts["rounds"] += 1
                    counts["drafted"] += k
                    counts["accepted"] += a
                self._accepted(w, a, k)
        return out

    def _accepted(self, w, accepted: int, k: int) -> None:
        """What the drafter keeps after a verdict (a draft model: how much of its cache is valid)."""


class DraftModel(Drafter):
    def __init__(self, program, params):
        self.program, self.params = program, params
        self.runner = ModelRunner(program)
        self.cache = None
        self.drafted_len: dict = {}  # tokens in the draft's cache per sequence

    def attach(self, engine) -> None:
        vt, vd = engine.program.config.model.vocab_size, self.program.config.model.vocab_size
        if vt != vd:
            raise ValueError(
                f"the draft's vocabulary ({vd} tokens) differs from the target's ({vt}): "
                "speculative decoding needs the same vocabulary"
            )
        layout = self.program.layout
        shards = layout.size(layout.compute_axes("batch"))
        if shards != engine.shards:
            raise ValueError(
                f"the draft runs on {shards} batch shards, the target on {engine.shards}: build both "
                "on the same mesh layout"
            )
        # its own full-precision cache, addressed by the target's page ids
        pool = engine.pools[0]
        kind = ContiguousCache if engine.kind == "contiguous" else PagedCache
        self.cache = kind(*cache_base.empty_pools(self.program, engine.shards * (pool.num_pages + 1), pool.page_size))

    def forget(self, request_id) -> None:
        self.drafted_len.pop(request_id, None)

    def _put(self, array, logical):
        return jax.device_put(
            np.asarray(array), NamedSharding(self.program.mesh, self.program.layout.compute_spec(logical))
        )

    def _run(self, engine, rows, width):
        tokens = np.zeros((engine.shards, width), np.int32)
        positions = np.zeros((engine.shards, width), np.int32)
        table = np.full((engine.shards, width, engine.max_pages), engine.scratch, np.int32)
        for d, shard_rows in enumerate(rows):
            for r, (token, pos, rid) in enumerate(shard_rows):
                tokens[d, r], positions[d, r] = token, pos
                pages = engine.pools[d].table(rid)[: engine.max_pages]
                table[d, r, : len(pages)] = pages
        cache = dataclasses.replace(self.cache, page_table=self._put(table.reshape(-1, engine.max_pages), ROWS))
        logits, out = self.runner(
            self.params, self._put(tokens.reshape(-1), ROW), self._put(positions.reshape(-1), ROW), cache
        )
        self.cache = dataclasses.replace(out, page_table=None)
        return logits

    def _prefill_rows(self, w) -> list:
        req = w.request
        if req.spec_k <= 0:
            return []
        self.drafted_len[req.id] = w.start + w.tokens
        return [(req.prefix[pos], pos, req.id) for pos in range(w.start, w.start + w.tokens)]

    def _catch_up(self, engine, w, d, rows) -> bool:
        """Round 0: the tokens the draft's cache lacks, up to and including the last one."""
        req = w.request
        sequence = req.prompt + req.generated
        rows += [(sequence[pos], pos, req.id) for pos in range(self.drafted_len.get(req.id, 0), w.start + 1)]
        self.drafted_len[req.id] = w.start + 1
        return True

    def _accepted(self, w, accepted: int, k: int) -> None:
        # its cache holds p .. p + k - 1; keep the accepted part
        self.drafted_len[w.request.id] = w.start + 1 + min(accepted, k - 1)


class SelfSpeculation(Drafter):
    def __init__(self, window: int = 64, sink: int = 4):
        if window < 1 or sink < 0:
            raise ValueError(f"self-speculation needs window >= 1 and sink >= 0; got window={window}, sink={sink}")
        self.window, self.sink = window, sink

    def attach(self, engine) -> None:
        if engine.kind != "paged":
            raise ValueError(
                f"self-speculation reads a window of the target's pages: it needs cache='paged', not {engine.kind!r}"
            )
        self.sink_pages = math.ceil(self.sink / engine.pools[0].page_size)

    def _run(self, engine, rows, width):
        tokens = np.zeros((engine.shards, width), np.int32)
        positions = np.zeros((engine.shards, width), np.int32)
        tables = engine.tables(width)
        read_table = tables["page_table"].copy()
        read_lengths = np.ones((engine.shards, width), np.int32)
        quantized = bool(engine.residual)
        read_fp = tables["fp_table"].copy() if quantized else None
        read_quant = np.zeros((engine.shards, width), np.int32) if quantized else None
        page_size = engine.pools[0].page_size
        for d, shard_rows in enumerate(rows):
            for r, (token, pos, rid) in enumerate(shard_rows):
                tokens[d, r], positions[d, r] = token, pos
                engine.fill_row(tables, d, r, rid)
                view, length = window.view_pages(pos + 1, page_size, self.sink_pages, self.window)
                read_table[d, r, : len(view)] = tables["page_table"][d, r, view]
                read_lengths[d, r] = length
                if quantized:
                    read_fp[d, r, : len(view)] = tables["fp_table"][d, r, view]
                    sealed = kivi.n_quant(pos + 1, page_size, engine.kv_residual)
                    read_quant[d, r] = window.sealed_in_view(view, sealed)
                engine.stats["draft_read"] += length
                engine.stats["full_read"] += pos + 1
        flat = lambda a: None if a is None else engine.put(a.reshape(-1, a.shape[-1]), ROWS)
        view_cache = WindowView(
            engine.with_tables(engine.cache, tables),
            flat(read_table),
            engine.put(read_lengths.reshape(-1), ROW),
            flat(read_fp),
            None if read_quant is None else engine.put(read_quant.reshape(-1), ROW),
        )
        return engine.forward(tokens, positions, tables, cache=view_cache)


def make_drafter(draft, window: int = 64, sink: int = 4) -> Drafter:
    """ "self" (self-speculation over `sink` + `window` tokens of the cache) or (program, params) of
    a model with the target's vocabulary."""
    if isinstance(draft, str):
        if draft != "self":
            raise ValueError(f"draft={draft!r}: 'self' or (program, params) of a draft model")
        return SelfSpeculation(window, sink)
    program, params = draft
    return DraftModel(program, params)


def drafter_from_config(sv, draft=None) -> Drafter:
    """The drafter config.serve names (spec_window, spec_sink; draft "self" or a workdir, loaded
    here unless `draft` = (program, params) is given)."""
    if draft is None:
        if sv.draft == "self":
            draft = "self"
        else:
            from jaxsys.checkpoint import load
            from jaxsys.serve.runner import check_servable

            d_program, d_params, _ = load(sv.draft, check=check_servable)
            draft = (d_program, d_params)
    return make_drafter(draft, sv.spec_window, sv.spec_sink)
