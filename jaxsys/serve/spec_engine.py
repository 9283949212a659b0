"""Speculative decoding inside the continuous-batching engine, with a per-sequence k.

`SpeculativeEngine` is an `Engine` whose decode steps verify drafted tokens. The scheduler gives a
running sequence with `spec_k = k` a decode work of 1 + k' rows (k' = k clamped so that the
verified tokens never pass max_new_tokens, and so that the step's token budget holds:
`Scheduler.lookahead`); k = 0 sequences decode one token, and prefill chunks of other requests
share the same step, as in the plain engine. One engine step is then

  1. draft rounds: the draft proposes d_1..d_k' for every speculating sequence, one draft step per
     round batched across sequences (each sequence stops at its own k'), keeping its
     distributions q_i on the device;
  2. one target step (the verify): a speculating sequence's rows are [last, d_1..d_k'] at
     positions p..p+k' with its page table, so its keys and values are written and the target's
     logits come back at all k' + 1 rows; plain decodes and prefill chunks are rows as before;
  3. `speculative.accept` (the rejection rule, vmapped over the sequences of one (k', greedy)
     group) gives each sequence n accepted drafts and the next token; it appends d_1..d_n and the
     next token, so its cache length becomes p + n + 1. Slots p + n + 1 .. p + k' hold rejected
     keys and values; the next step writes them again before anything reads them (attention
     masks by position).

Greedy requests (temperature 0) accept while the draft equals the target's argmax, so they get
exactly the plain engine's tokens. Sampled requests use the target's filtered distribution (the
same temperature / top-k / top-p as `decode.sample`) as p and the draft's, filtered the same way,
as q: every emitted token follows the target's distribution (Leviathan et al., Theorem 1), though
the draws differ from the plain engine's.

Two draft sources:
* a smaller jaxsys model with the same vocabulary (`draft=(program, params)`): an `Engine` of its
  own (its own paged cache) addressed through the target's page tables, so its pages are
  reserved and freed with the target's. It runs the prefill chunks of the speculating requests in
  its first round (no extra step), and catches up on tokens it has not seen (the last accepted
  draft of a fully accepted round, steps where a sequence decoded plainly) in the same round.
* self-speculation (`draft="self"`, TriForce / StreamingLLM): the draft is the target itself
  reading a sparse view of its own paged cache, the first `sink` tokens (attention sinks) and the
  last `window` tokens. No second cache: the draft's rows write their keys and values into the
  sequence's own slots p..p+k'-1, which the verify step overwrites. The view is a second page
  table of the same pages (the sink pages, then the window's pages) with its own lengths
  (`transformer._paged_attention`'s read_table / read_lengths), so the paged kernel reads only
  those pages; sink and window are therefore whole pages (sink rounded up, the window's first
  page rounded down). A sequence shorter than sink + window reads its whole cache, and then the
  draft is the target (every draft accepted).

Not done: the quantized-cache variant of self-speculation (TriForce's other draft: the target
over a KIVI-quantized copy of its cache, reading ~4-8x fewer bytes). It fits here as a third draft
source (a quantized cache beside the full one, written by the verify step), once the KIVI cache
exists in the engine.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.serve import decode, speculative
from jaxsys.serve.engine import Engine, Sampling, _pad, pool_settings


def _base_key(seed, n):
    """The key of a sequence's n-th token (as the plain engine's); drafts and the verdict fold
    1 and 2 into it, so the three streams are disjoint."""
    return jax.random.fold_in(jax.random.key(seed), n)


@functools.partial(jax.jit, donate_argnums=0)
def _draft_rows(q_buffer, logits, at, dest, seed, n, i, temperature, top_k, top_p):
    """Draft tokens for rows logits[at] [R, V]: argmax where temperature == 0, else a draw from the
    filtered distribution (the draft's i-th proposal of the sequence's n-th token); their
    distributions q go to rows `dest` of q_buffer. Returns (tokens, q_buffer)."""

    def one(lg, seed, n, i, t, tk, tp):
        scaled = decode.filtered_logits(lg[None], t, tk, tp)[0]
        key = jax.random.fold_in(jax.random.fold_in(_base_key(seed, n), 1), i)
        drawn = jax.random.categorical(key, scaled)
        token = jnp.where(t > 0, drawn, jnp.argmax(lg)).astype(jnp.int32)
        return token, jax.nn.softmax(scaled)

    tokens, q = jax.vmap(one)(logits[at], seed, n, i, temperature, top_k, top_p)
    return tokens, q_buffer.at[dest].set(q)


@functools.partial(jax.jit, static_argnames=("greedy",))
def _accept_rows(logits, rows, q_buffer, q_rows, drafted, seed, n, temperature, top_k, top_p, greedy: bool):
    """`speculative.accept` for S sequences of one k: the target's logits at rows [S, k + 1] (the
    verify rows), q at q_buffer rows [S, k], drafted [S, k] -> (accepted [S], next token [S])."""

    def one(lg, q, d, seed, n, t, tk, tp):
        p = lg if greedy else jax.nn.softmax(decode.filtered_logits(lg, t, tk, tp), axis=-1)
        return speculative.accept(p, q, d, jax.random.fold_in(_base_key(seed, n), 2), greedy=greedy)

    return jax.vmap(one)(logits[rows], q_buffer[q_rows], drafted, seed, n, temperature, top_k, top_p)


def sparse_view(pages: list, length: int, page_size: int, sink_pages: int, window: int):
    """The pages a self-speculation draft row reads, and how many of their slots: the first
    `sink_pages` pages and the pages holding the last `window` of `length` tokens (the window's
    first page whole). The whole cache when the two overlap."""
    first = max(length - window, 0) // page_size
    if first <= sink_pages:
        return pages[: math.ceil(length / page_size)], length
    view = pages[:sink_pages] + pages[first : math.ceil(length / page_size)]
    return view, sink_pages * page_size + length - first * page_size


def engine_from_config(program, params, max_len: int | None = None) -> Engine:
    """The engine `program.config.serve` describes: a SpeculativeEngine when serve.spec_k >= 1
    (the server's and bench_serve's constructor), else a plain Engine."""
    if program.config.serve.spec_k >= 1:
        return SpeculativeEngine.from_config(program, params, max_len)
    return Engine.from_config(program, params, max_len)


class SpeculativeEngine(Engine):
    @classmethod
    def from_config(cls, program, params, max_len: int | None = None, draft=None) -> "SpeculativeEngine":
        """The engine `program.config.serve` describes: spec_k, and draft "self" or a workdir
        (loaded here unless `draft` = (program, params) is given)."""
        sv = program.config.serve
        if sv.spec_k < 1 or sv.draft == "none":
            raise ValueError(
                f"config.serve.spec_k={sv.spec_k}, config.serve.draft={sv.draft!r}: the speculative "
                "engine needs spec_k >= 1 and a draft ('self' or a workdir); use Engine otherwise"
            )
        if sv.get("kv_quant", "none") != "none":
            raise ValueError(
                f"config.serve.kv_quant={sv.kv_quant!r}: speculative decoding runs on the full-precision "
                "cache only (set kv_quant='none' or spec_k=0)"
            )
        if draft is None:
            if sv.draft == "self":
                draft = "self"
            else:
                from jaxsys import generate

                d_program, d_params, _ = generate.load_program(sv.draft)
                draft = (d_program, d_params)
        return cls(
            program,
            params,
            **pool_settings(sv),
            max_len=max_len,
            k=sv.spec_k,
            draft=draft,
            window=sv.spec_window,
            sink=sv.spec_sink,
        )

    def __init__(
        self,
        program,
        params,
        num_pages: int,
        page_size: int,
        token_budget: int,
        chunk_size: int,
        max_seqs: int,
        policy: str = "chunked",
        max_len: int | None = None,
        *,
        k: int,
        draft,
        window: int = 64,
        sink: int = 4,
    ):
        """`k`: tokens drafted per decode step for requests that do not name their own (>= 1).
        `draft`: "self" (self-speculation over `sink` + `window` tokens of the cache) or
        (program, params) of a model with the target's vocabulary."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(
                f"k={k!r}: speculative decoding drafts at least one token per step (k >= 1); "
                "use Engine for plain decoding"
            )
        super().__init__(program, params, num_pages, page_size, token_budget, chunk_size, max_seqs, policy, max_len)
        self.k = k
        self.drafter = None
        if isinstance(draft, str):
            if draft != "self":
                raise ValueError(f"draft={draft!r}: 'self' or (program, params) of a draft model")
            if window < 1 or sink < 0:
                raise ValueError(f"self-speculation needs window >= 1 and sink >= 0; got window={window}, sink={sink}")
            self.window, self.sink_pages = window, math.ceil(sink / page_size)
            self._sparse_step = self._compile_sparse()
        else:
            d_program, d_params = draft
            vt, vd = program.config.model.vocab_size, d_program.config.model.vocab_size
            if vt != vd:
                raise ValueError(
                    f"the draft's vocabulary ({vd} tokens) differs from the target's ({vt}): "
                    "speculative decoding needs the same vocabulary"
                )
            self.drafter = Engine(
                d_program, d_params, num_pages, page_size, token_budget, chunk_size, max_seqs, policy, self.max_len
            )
            if self.drafter.shards != self.shards:
                raise ValueError(
                    f"the draft runs on {self.drafter.shards} batch shards, the target on "
                    f"{self.shards}: build both on the same mesh layout"
                )
        self.drafted_len: dict = {}  # small draft: tokens in its cache per sequence
        # totals: target and draft steps; speculative rounds (one per speculating sequence and
        # step), drafted and accepted tokens; tokens emitted; self-speculation's slots read by the
        # draft and what the whole cache would have been
        self.stats = {
            "target_steps": 0,
            "draft_steps": 0,
            "rounds": 0,
            "drafted": 0,
            "accepted": 0,
            "tokens": 0,
            "draft_read": 0,
            "full_read": 0,
        }
        self.per_request: dict = {}  # request id -> its own rounds, drafted, accepted, decode steps

    # -- the self-speculation draft step: the target's own step reading a second page table
    def _compile_sparse(self):
        p = self.program
        rows, table = self.rows_pspec, self.table_pspec

        def local(params, tokens, positions, table, read_table, read_lengths, k, v):
            return self._local(params, tokens, positions, table, k, v, read_table=read_table, read_lengths=read_lengths)

        fn = jax.shard_map(
            local,
            mesh=p.mesh,
            in_specs=(p.param_pspecs, rows, rows, table, table, rows, self.cache_pspec, self.cache_pspec),
            out_specs=(table, self.cache_pspec, self.cache_pspec),
            check_vma=False,
        )
        return jax.jit(fn, donate_argnums=(6, 7))

    def _run_sparse(self, tokens, positions, table, read_table, read_lengths):
        logits, k, v = self._sparse_step(
            self.params,
            self._put(tokens, self.rows_pspec),
            self._put(positions, self.rows_pspec),
            self._put(table, self.table_pspec),
            self._put(read_table, self.table_pspec),
            self._put(read_lengths, self.rows_pspec),
            *self.cache,
        )
        self.cache = (k, v)
        return logits

    def warmup(self) -> None:
        """Compile every row bucket of the target's step and of the draft's (padding rows only)."""
        super().warmup()
        if self.drafter is not None:
            self.drafter.warmup()
            return
        for width in self.widths():
            rows = np.zeros(self.shards * width, np.int32)
            table = np.full((self.shards * width, self.max_pages), self.scratch, np.int32)
            self._run_sparse(rows, rows, table, table, np.ones_like(rows))
        jax.block_until_ready(self.cache)

    def _width(self, n: int) -> int:
        """The row bucket of a draft step (a catch-up round may exceed the budget: a power of two)."""
        return next((w for w in self.widths() if w >= n), 1 << (n - 1).bit_length())

    # -- requests
    def submit(
        self, request_id, prompt: list, max_new_tokens: int, sampling: Sampling | None = None, k: int | None = None
    ):
        """As `Engine.submit`, with this request's own k (None: the engine's; 0: plain decoding)."""
        k = self.k if k is None else k
        if not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"request {request_id!r}: k={k!r} must be an integer >= 0 (0: no speculation)")
        request = super().submit(request_id, prompt, max_new_tokens, sampling)
        request.spec_k = int(k)
        self.per_request[request_id] = {"rounds": 0, "drafted": 0, "accepted": 0, "decode_steps": 0}
        return request

    # -- one step
    def _draft(self, plans, spec):
        """Draft rounds for the speculating decodes `spec` [(shard, work)]. Returns {request id:
        drafted tokens}, the stacked draft distributions q [rows, V] and {(request id, i): row}."""
        drafted = {w.request.id: [] for _, w in spec}
        # q of every drafted token of the step (at most the token budget; the last row takes padding)
        q_buffer = jnp.zeros((self.budget + 1, self.program.config.model.vocab_size), jnp.float32)
        q_index, offset = {}, 0
        for i in range(max(w.tokens - 1 for _, w in spec)):
            rows = [[] for _ in range(self.shards)]  # per shard: (token, position, pages)
            samples = []  # (shard, row in shard, work)
            for d, work in enumerate(plans):
                for w in work:
                    req = w.request
                    pages = self.pools[d].table(req.id)[: self.max_pages]
                    if self.drafter is not None and i == 0 and w.kind == "prefill" and req.spec_k > 0:
                        rows[d] += [(req.prompt[pos], pos, pages) for pos in range(w.start, w.start + w.tokens)]
                        self.drafted_len[req.id] = w.start + w.tokens  # the draft's own prefill
                        continue
                    if w.kind != "decode" or w.tokens - 1 <= i:
                        continue
                    if i == 0 and self.drafter is not None:  # catch up on unseen tokens, then the last
                        sequence = req.prompt + req.generated
                        rows[d] += [
                            (sequence[pos], pos, pages) for pos in range(self.drafted_len.get(req.id, 0), w.start + 1)
                        ]
                        self.drafted_len[req.id] = w.start + 1
                    else:
                        rows[d].append((req.generated[-1] if i == 0 else drafted[req.id][-1], w.start + i, pages))
                    samples.append((d, len(rows[d]) - 1, w))
            width = self._width(max(len(r) for r in rows))
            tokens = np.zeros((self.shards, width), np.int32)
            positions = np.zeros((self.shards, width), np.int32)
            table = np.full((self.shards, width, self.max_pages), self.scratch, np.int32)
            read_table, read_lengths = table.copy(), np.ones((self.shards, width), np.int32)
            for d, shard_rows in enumerate(rows):
                for r, (token, pos, pages) in enumerate(shard_rows):
                    tokens[d, r], positions[d, r] = token, pos
                    table[d, r, : len(pages)] = pages
                    if self.drafter is None:
                        view, length = sparse_view(
                            pages, pos + 1, self.pools[d].page_size, self.sink_pages, self.window
                        )
                        read_table[d, r, : len(view)] = view
                        read_lengths[d, r] = length
                        self.stats["draft_read"] += length
                        self.stats["full_read"] += pos + 1
            args = (tokens.reshape(-1), positions.reshape(-1), table.reshape(-1, self.max_pages))
            if self.drafter is None:
                logits = self._run_sparse(*args, read_table.reshape(-1, self.max_pages), read_lengths.reshape(-1))
            else:
                logits = self.drafter._run(*args)
            self.stats["draft_steps"] += 1
            padded = _pad(samples)
            settings = [self.sampling[w.request.id] for _, _, w in padded]
            dest = np.full(len(padded), self.budget, np.int32)
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
        return drafted, q_buffer, q_index

    def step(self) -> tuple[list, dict]:
        """Run one scheduled step on every shard: draft rounds, then one target step. Returns (the
        work done, {request id: the token sampled, or the list of tokens a speculating decode
        emitted})."""
        plans = [s.plan() for s in self.schedulers]
        n = max(sum(w.tokens for w in work) for work in plans)
        if n == 0:
            return [], {}
        spec = [(d, w) for d, work in enumerate(plans) for w in work if w.kind == "decode" and w.tokens > 1]
        drafted = q_all = q_index = None
        if spec:
            drafted, q_all, q_index = self._draft(plans, spec)
        elif self.drafter is not None:  # no speculating decode: the draft still prefills its prompts
            self._draft_prefill(plans)
        width = next(w for w in self.widths() if w >= n)
        tokens = np.zeros((self.shards, width), np.int32)
        positions = np.zeros((self.shards, width), np.int32)
        table = np.full((self.shards, width, self.max_pages), self.scratch, np.int32)
        sample_rows, verify_rows = {}, {}
        for d, work in enumerate(plans):
            r = 0
            for w in work:
                req = w.request
                pages = self.pools[d].table(req.id)[: self.max_pages]
                for i in range(w.tokens):
                    if w.kind == "prefill":
                        tokens[d, r] = req.prompt[w.start + i]
                    else:
                        tokens[d, r] = req.generated[-1] if i == 0 else drafted[req.id][i - 1]
                    positions[d, r] = w.start + i
                    table[d, r, : len(pages)] = pages
                    r += 1
                if w.kind == "decode" and w.tokens > 1:
                    verify_rows[req.id] = (d * width + r - w.tokens, w)
                elif w.kind == "decode" or w.start + w.tokens == len(req.prompt):
                    sample_rows[req.id] = (d * width + r - 1, req)
        logits = self._run(tokens.reshape(-1), positions.reshape(-1), table.reshape(-1, self.max_pages))
        self.stats["target_steps"] += 1
        # as Engine.step: one call for every sequence that gets one token
        sampled = self._sample(logits, sample_rows, self.sampling) if sample_rows else {}
        sampled.update(self._verify(logits, verify_rows, drafted, q_all, q_index) if verify_rows else {})
        for scheduler, work in zip(self.schedulers, plans):
            for req in scheduler.commit(work, sampled):
                self.sampling.pop(req.id, None)
                self.shard_of.pop(req.id, None)
                self.drafted_len.pop(req.id, None)
        for work in plans:
            for w in work:
                if w.kind == "decode":
                    self.per_request[w.request.id]["decode_steps"] += 1
        self.steps += 1
        self.stats["tokens"] += sum(len(v) if isinstance(v, list) else 1 for v in sampled.values())
        return [w for work in plans for w in work], sampled

    def _draft_prefill(self, plans):
        """The draft's prefill of the speculating requests' chunks in a step without speculating
        decodes (one draft step; nothing sampled)."""
        rows = [
            [
                (w.request.prompt[pos], pos, self.pools[d].table(w.request.id)[: self.max_pages])
                for w in work
                if w.kind == "prefill" and w.request.spec_k > 0
                for pos in range(w.start, w.start + w.tokens)
            ]
            for d, work in enumerate(plans)
        ]
        if not any(rows):
            return
        width = self._width(max(len(r) for r in rows))
        tokens = np.zeros((self.shards, width), np.int32)
        positions = np.zeros((self.shards, width), np.int32)
        table = np.full((self.shards, width, self.max_pages), self.scratch, np.int32)
        for d, shard_rows in enumerate(rows):
            for r, (token, pos, pages) in enumerate(shard_rows):
                tokens[d, r], positions[d, r] = token, pos
                table[d, r, : len(pages)] = pages
        self.drafter._run(tokens.reshape(-1), positions.reshape(-1), table.reshape(-1, self.max_pages))
        self.stats["draft_steps"] += 1
        for work in plans:
            for w in work:
                if w.kind == "prefill" and w.request.spec_k > 0:
                    self.drafted_len[w.request.id] = w.start + w.tokens

    def _verify(self, logits, verify_rows, drafted, q_all, q_index) -> dict:
        """The rejection rule for every speculating sequence, vmapped per (k, greedy) group, the
        group padded to a power of two. Returns {request id: accepted drafts + the next token}."""
        groups: dict = {}
        for rid, (row, w) in verify_rows.items():
            groups.setdefault((w.tokens - 1, self.sampling[rid].temperature <= 0), []).append(rid)
        out = {}
        for (k, greedy), ids in groups.items():
            padded = _pad(ids)
            rows = np.asarray([verify_rows[rid][0] + np.arange(k + 1) for rid in padded], np.int32)
            q_rows = np.asarray([[q_index[(rid, i)] for i in range(k)] for rid in padded], np.int32)
            settings = [self.sampling[rid] for rid in padded]
            tokens = np.asarray([drafted[rid][:k] for rid in padded], np.int32)
            n, nxt = _accept_rows(
                logits,
                rows,
                q_all,
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
                out[rid] = drafted[rid][:a] + [t]
                for counts in (self.stats, self.per_request[rid]):
                    counts["rounds"] += 1
                    counts["drafted"] += k
                    counts["accepted"] += a
                if self.drafter is not None:  # its cache holds p .. p + k - 1; keep the accepted part
                    self.drafted_len[rid] = verify_rows[rid][1].start + 1 + min(a, k - 1)
        return out
