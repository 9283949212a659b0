"""The serving engine: one interface for every way jaxsys serves a model.

    engine = Engine.from_config(program, params)       # or Engine(program, params, num_pages=..., ...)
    engine.submit(request_id, prompt, max_new_tokens, Sampling(...))
    work, sampled = engine.step()                      # until engine.idle
    engine.abort(request_id)
    generate(engine, prompts, max_new_tokens)          # the engine with a few requests, to the end

`generate` (`python -m jaxsys.generate`), the HTTP server, `jaxsys.bench_serve`, speculative
decoding (a drafter the engine calls: serve/speculation.py) and disaggregated serving (two
engines and a page transfer: serve/disagg.py, an `EngineAPI` too) all drive this object.

A step (continuous batching with chunked prefill, Sarathi-Serve): each batch shard's scheduler
(scheduler.py, plain Python) packs decode tokens of running sequences and prefill chunks of new
ones up to a token budget; the drafter, if any, proposes tokens for the speculating decodes; the
device runs one compiled call per row bucket (a power of two >= 8, at most the budget) of
`runner.ModelRunner`, the model's one cached forward; the tokens are sampled on the device
(sampling.py). Row r of a step is one token of some sequence at position p_r with that sequence's
cache table, so decodes and prefill chunks of any lengths share one program; padding rows write a
scratch page no sequence owns. The per-row page tables stay on the device between steps (a step
scatters in the rows that changed), and a decode-only step of the same sequences as the last one
runs from inputs that step left on the device (steady decoding: no rows built or uploaded). With `overlap` (config.serve.overlap) a step is dispatched
before the previous step's sampled tokens are read: they feed its decodes on the device, and the
host applies them (stop ids, finishing, streaming) a step late. A sequence preempted for pages is
recomputed, or with preemption "swap" its pages go to host memory and back.

The cache (jaxsys/cache/, config.serve.cache and kv_quant) is split like the model's activations:
over `tensor` by kv heads, and over the batch axes (data, fsdp, expert) by sequences. Each of the
D batch shards has its own pool (+ 1 scratch page), its own scheduler and token budget; a request
goes to the shard with the least outstanding work, and a step's rows are [D, width], shard d's
rows reading only shard d's pages (page ids are local to a shard). So a pool leaf is [L, D (P + 1),
page_size, ...], split D ways on its page dimension and t ways on K.

    cache        pool per shard                      table per row
    paged        num_pages pages of page_size        the sequence's pages (ceil(max_len / page_size))
    contiguous   max_seqs rows of max_len slots      its row (one "page" of max_len slots)
    kv_quant     as paged, quantized (KIVI), plus a  the quantized pages and the full-precision
                 small full-precision pool           pages (cache/kivi.py's ResidualPages)
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxsys.cache import ContiguousCache, PagedCache, QuantizedPagedCache, kivi
from jaxsys.cache import base as cache_base
from jaxsys.cache.base import ROW, ROWS
from jaxsys.config import CACHE_KINDS, KV_QUANT
from jaxsys.kernels.paged_attention.quant import MODES as KV_QUANT_MODES
from jaxsys.parallel.spmd import per_shard
from jaxsys.serve import sampling as sampling_lib
from jaxsys.serve.runner import ModelRunner, check_servable
from jaxsys.serve.sampling import Sampling
from jaxsys.serve.scheduler import (
    PENDING,
    PREEMPTIONS,
    PagePool,
    PoolExhausted,
    Request,
    Scheduler,
    Work,
    ring_pages,
)

MIN_ROWS = 8
SEQUENCE_VECTORS = ("cu_q_lens", "kv_lens", "num_seqs")  # per shard vectors: [D x n] flat, n per shard
# per-row page tables that stay on the device between steps: a step sends only the rows that changed
RESIDENT_TABLES = ("page_table", "fp_table")
log = logging.getLogger("jaxsys.serve")


def _as_list(tokens) -> list:
    return tokens if isinstance(tokens, list) else [tokens]


def pool_settings(sv) -> dict:
    """config.serve's cache and schedule settings (per batch shard) as the engine's constructor
    takes them."""
    keys = ("page_size", "token_budget", "chunk_size", "max_seqs", "policy", "kv_quant", "kv_residual")
    return {
        "num_pages": sv.pages,
        "cache": sv.get("cache", "paged"),
        "allocation": sv.get("allocation", "on_demand"),
        "prefix_cache": bool(sv.get("prefix_cache", True)),
        "rolling": bool(sv.get("rolling", True)),
        "ragged": bool(sv.get("ragged", True)),
        "decode_steps": int(sv.get("decode_steps", 1)),
        "overlap": bool(sv.get("overlap", False)),
        "preemption": sv.get("preemption", "recompute"),
        **{key: sv[key] for key in keys},
    }


class EngineAPI(abc.ABC):
    """What every engine offers its callers (the server, bench_serve, `generate`)."""

    program: Any  # a jaxsys.program.Program: the caller reads its config (vocabulary, tokenizer source)

    @abc.abstractmethod
    def submit(self, request_id, prompt: list, max_new_tokens: int, sampling: Sampling | None = None) -> Request:
        """Queue a request; ValueError if it can never be served."""

    @abc.abstractmethod
    def step(self) -> tuple[list, dict]:
        """One scheduled step: (the work done, {request id: token, or the tokens a speculative
        decode emitted, sampled this step})."""

    @abc.abstractmethod
    def abort(self, request_id) -> bool:
        """Drop a request wherever it is (waiting or running) and free its pages; False if unknown."""

    @abc.abstractmethod
    def finish(self, request_id, reason: str) -> bool:
        """End a request now with finish_reason `reason` (a stop string matched), pages freed."""

    @abc.abstractmethod
    def warmup(self) -> None:
        """Compile every program a step can run, so that nothing compiles while serving."""

    @property
    @abc.abstractmethod
    def idle(self) -> bool: ...

    @property
    @abc.abstractmethod
    def finished(self) -> list[Request]: ...

    @abc.abstractmethod
    def forget_finished(self) -> None:
        """Drop the engine's references to finished requests (`finished` empties; their pages went
        back when they ended): a long-running server keeps only what it still sends."""

    def run(self, max_steps: int = 100_000) -> list[Request]:
        """Step until every submitted request has finished."""
        for _ in range(max_steps):
            if self.idle:
                break
            self.step()
        return self.finished


class Engine(EngineAPI):
    @classmethod
    def from_config(cls, program, params, max_len: int | None = None, draft=None, **settings) -> "Engine":
        """The engine `program.config.serve` describes: its cache, schedule and, with spec_k >= 1,
        its drafter (draft "self", or a workdir loaded here unless `draft` = (program, params));
        `settings` override the config's (the constructor's names, e.g. overlap=True)."""
        from jaxsys.serve import speculation

        sv = program.config.serve
        drafter = speculation.drafter_from_config(sv, draft) if sv.spec_k >= 1 else None
        kw = {**pool_settings(sv), **settings}
        return cls(program, params, **kw, max_len=max_len, drafter=drafter, k=sv.spec_k)

    def __init__(
        self,
        program,
        params,
        num_pages: int = 0,
        page_size: int = 0,
        token_budget: int = 256,
        chunk_size: int = 64,
        max_seqs: int = 16,
        policy: str = "chunked",
        max_len: int | None = None,
        kv_quant: str = "none",
        kv_residual: int = 0,
        cache: str = "paged",
        drafter=None,
        k: int = 0,
        allocation: str = "on_demand",
        prefix_cache: bool = True,
        ragged: bool = True,
        decode_steps: int = 1,
        overlap: bool = False,
        preemption: str = "recompute",
        rolling: bool = True,
    ):
        """`num_pages`, `token_budget` and `max_seqs` are per batch shard (config.serve). `cache`:
        "paged" (pages of `page_size`; `kv_quant` and `kv_residual`, full-precision pages before the
        open one, choose a quantized cache) or "contiguous" (a row of `max_len` slots, default
        num_pages x page_size, for each of `max_seqs` sequences). `drafter` (serve/speculation.py):
        speculative decoding, `k` tokens drafted per decode step for requests that do not name
        their own. `allocation`: "on_demand" (pages as sequences grow, preempting when the pool runs
        out) or "reserve" (prompt + max_new_tokens at admission). `prefix_cache`: full pages shared
        by the hash chain of their tokens (paged caches; under kv_quant only with kv_residual 0,
        since a sequence reads its residual window's pages in full precision from its own pool).
        `ragged`: a paged cache's steps attend with the ragged kernel (each sequence's rows in
        query blocks over its pages) instead of the one-query kernel row by row. `decode_steps` > 1:
        when every running sequence decodes and nothing waits, up to that many decode steps run in
        one compiled call (multi-step decoding; the same tokens as one step at a time). `overlap`:
        overlapped scheduling: each step is dispatched before the previous step's tokens are read
        (they stay on the device and feed the next step), and `step` returns the previous step's
        tokens; steps with forks, penalties or log-probabilities run synchronously. Not with a
        drafter nor decode_steps > 1 (ValueError). `preemption`: what happens to the cache of a
        sequence preempted for pages (allocation "on_demand"): "recompute" (prefilled again) or
        "swap" (copied to host memory and back when it resumes; not with kv_quant). `rolling`: for a
        model whose every layer is a sliding-window one, each sequence holds only R pages, the window's
        and one step's tokens', used in a ring (`ring_pages`); paged caches without kv_quant, chunked
        policy, no drafter; the prefix cache is off then."""
        config = program.config
        check_servable(config)
        if drafter is not None and (not isinstance(k, int) or k < 1):
            raise ValueError(
                f"k={k!r}: speculative decoding drafts at least one token per step (k >= 1); "
                "build the engine without a drafter for plain decoding"
            )
        if cache not in CACHE_KINDS:
            raise ValueError(f"cache={cache!r}: choose one of {CACHE_KINDS}")
        if kv_quant not in KV_QUANT:
            raise ValueError(f"kv_quant={kv_quant!r}: choose one of {KV_QUANT}")
        if cache == "contiguous" and kv_quant != "none":
            raise ValueError(f"kv_quant={kv_quant!r} quantizes pages: it needs cache='paged', not 'contiguous'")
        if cache == "contiguous":
            max_len = max_len or num_pages * page_size  # config.serve's pool, as a paged cache would hold it
            if not max_len:
                raise ValueError("a contiguous cache needs max_len (the slots of each sequence's row)")
        layout = program.layout
        self.program, self.params = program, params
        self.runner = ModelRunner(program)
        self.shards = layout.size(layout.compute_axes("batch"))
        self.kind, self.kv_quant, self.kv_residual = cache, kv_quant, kv_residual
        if cache == "contiguous":
            num_pages, page_size = max_seqs, max_len
        elif num_pages < 1 or page_size < 1:
            raise ValueError(f"a paged cache needs num_pages >= 1 and page_size >= 1; got {num_pages}, {page_size}")
        self.max_len = max_len or num_pages * page_size
        self.ring = 0
        if rolling and cache == "paged" and kv_quant == "none" and drafter is None and policy == "chunked":
            self.ring = ring_pages(config.model, page_size, chunk_size)
        self.pools = [PagePool(num_pages, page_size, self.ring) for _ in range(self.shards)]
        self.max_pages = math.ceil(self.max_len / page_size)
        self.prefix_cache = (
            prefix_cache and cache == "paged" and (kv_quant == "none" or kv_residual == 0) and not self.ring
        )
        self.ragged = ragged and cache == "paged"
        if not isinstance(decode_steps, int) or decode_steps < 1:
            raise ValueError(f"decode_steps={decode_steps!r} must be an integer >= 1")
        self.decode_steps = decode_steps
        if overlap and (drafter is not None or decode_steps > 1):
            raise ValueError(
                "overlap=True (config.serve.overlap) schedules one step ahead of the sampled tokens; "
                "speculative decoding (spec_k) and multi-step decoding (decode_steps > 1) need them "
                "on the host at once: turn overlap off or set spec_k=0, decode_steps=1"
            )
        self.overlap = overlap
        if preemption not in PREEMPTIONS:
            raise ValueError(f"preemption={preemption!r}: choose one of {PREEMPTIONS}")
        if preemption == "swap" and kv_quant != "none":
            raise ValueError(
                f"preemption='swap' copies a sequence's pages; kv_quant={kv_quant!r} keeps part of its "
                "cache in separate full-precision pages: use preemption='recompute'"
            )
        self.preemption = preemption
        self.swapped: dict = {}  # swap preemption: request id -> (tokens, its pages' contents in host memory)
        self.inflight: _InFlight | None = None  # overlap: the step dispatched, its tokens not read yet
        self.schedulers = [
            Scheduler(
                pool,
                token_budget,
                chunk_size,
                max_seqs,
                policy,
                self.max_len,
                allocation if cache == "paged" else "reserve",
                self.prefix_cache,
                on_preempt=self._preempted,
                on_resume=self._resume,
            )
            for pool in self.pools
        ]
        self.budget = token_budget
        self.sample_slots = self.shards * max_seqs  # sequences that can get a token in one step
        self.scratch = num_pages  # a shard's local id of its scratch page
        self.residual: list[kivi.ResidualPages] = []
        self.fp_scratch = 0
        self.cache = self._empty_cache(num_pages, page_size, token_budget, max_seqs)
        self.shard_of: dict = {}
        self.sampling: dict = {}
        self.forks: dict = {}  # request id -> the requests waiting to share its prefill (fork_of)
        self.failed: list[Request] = []  # requests a failed step ended (finish_reason "error")
        # speculation's counters (zero without a drafter): target and draft steps; rounds (one per
        # speculating sequence and step), drafted and accepted tokens; tokens emitted;
        # self-speculation's slots read by the draft and what the whole cache would have been
        self.stats = dict.fromkeys(
            (
                "target_steps",
                "draft_steps",
                "rounds",
                "drafted",
                "accepted",
                "tokens",
                "draft_read",
                "full_read",
                "loop_steps",  # decode steps run inside multi-step calls
                "table_rows",  # rows of the resident page tables the steps used ...
                "table_rows_sent",  # ... and those sent to the device (changed since the last step)
                "swapped_out",  # swap preemption: tokens of cache copied to host memory
                "swapped_in",  # ... and back
                "steady_steps",  # steps run from the steady inputs on the device (no rows built on the host)
            ),
            0,
        )
        self._tables: dict = {}  # (table, rows) -> (its rows on the host, the same on the device)
        self._steady: _Steady | None = None  # steady decoding: the next step's inputs, on the device
        self.verify_steady = False  # tests: check each steady step's inputs against the rows built on the host
        self.steady = True  # False: every step built on the host (tests that record forward's rows; A/B timing)
        self.k = k
        self.drafter = drafter
        if drafter is not None:
            drafter.attach(self)

    # -- the cache
    def _empty_cache(self, num_pages: int, page_size: int, token_budget: int, max_seqs: int):
        m = self.program.config.model
        sharding = NamedSharding(self.program.mesh, self.program.layout.compute_spec(cache_base.pool_spec(m)))
        zeros = lambda shape, dtype=None: jax.jit(
            lambda: jnp.zeros((m.n_layers, *shape), dtype or jnp.dtype(m.compute_dtype)), out_shardings=sharding
        )()
        if self.kind == "contiguous" or self.kv_quant == "none":
            kind = ContiguousCache if self.kind == "contiguous" else PagedCache
            return kind(*cache_base.empty_pools(self.program, self.shards * (num_pages + 1), page_size))
        if cache_base.latent(m):
            raise ValueError(
                f"kv_quant={self.kv_quant!r} quantizes per-head keys and values; MLA's latent cache "
                "(config.model.mla.cache='latent') has none. Serve it with kv_quant='none', or set "
                "config.model.mla.cache='expanded' to quantize the expanded heads"
            )
        if not isinstance(self.kv_residual, int) or self.kv_residual < 0:
            raise ValueError(f"kv_residual={self.kv_residual!r} must be an integer >= 0 (pages)")
        per_byte = 8 // KV_QUANT_MODES[self.kv_quant][0]
        if m.head_dim % per_byte:
            raise ValueError(
                f"kv_quant={self.kv_quant!r} packs {per_byte} codes per byte along the head dim: "
                f"head_dim={m.head_dim} must be a multiple of {per_byte}"
            )
        n_fp = kivi.fp_pages(max_seqs, token_budget, page_size, self.kv_residual)
        self.residual = [kivi.ResidualPages(n_fp, page_size, self.kv_residual) for _ in range(self.shards)]
        self.fp_scratch = n_fp  # a shard's local id of its full-precision scratch page
        shapes = kivi.layer_shapes(
            self.kv_quant,
            self.shards * (num_pages + 1),
            self.shards * (n_fp + 1),
            page_size,
            m.n_kv_heads,
            cache_base.head_dim(m),
        )
        pools = {name: zeros(shape, dtype) for name, (shape, dtype) in shapes.items()}
        return QuantizedPagedCache(**pools, mode=self.kv_quant, residual=self.kv_residual)

    def tables(self, width: int, ragged: bool = False) -> dict:
        """Empty per-row tables of a step of `width` rows per shard (every row on the scratch page);
        `ragged`: with the per-sequence fields of the ragged kernel (no sequence yet)."""
        out = {"page_table": np.full((self.shards, width, self.max_pages), self.scratch, np.int32)}
        if self.residual:
            out["fp_table"] = np.full((self.shards, width, self.max_pages), self.fp_scratch, np.int32)
        if ragged and self.ragged:
            # a step's works on a shard are its running sequences (at most max_seqs): slots past
            # them would only lengthen the kernel's grid (experiments/chunked_prefill)
            slots = min(width, self.schedulers[0].max_seqs)
            out["seq_table"] = out["page_table"][:, :slots].copy()
            if self.residual:
                out["seq_fp_table"] = out["fp_table"][:, :slots].copy()
            out["cu_q_lens"] = np.zeros((self.shards, slots + 1), np.int32)
            out["kv_lens"] = np.zeros((self.shards, slots), np.int32)
            out["num_seqs"] = np.zeros((self.shards, 1), np.int32)
        return out

    def fill_sequences(self, tables: dict, plans) -> None:
        """The ragged kernel's per-sequence fields: shard d's works in order, each one sequence's
        consecutive rows (q_len = its tokens) ending at cache length start + tokens."""
        if "cu_q_lens" not in tables:
            return
        for d, work in enumerate(plans):
            for j, w in enumerate(work):
                tables["cu_q_lens"][d, j + 1] = tables["cu_q_lens"][d, j] + w.tokens
                tables["kv_lens"][d, j] = w.start + w.tokens
                pages = self.pools[d].table(w.request.id)[: self.max_pages]
                tables["seq_table"][d, j, : len(pages)] = pages
                if self.residual:
                    tables["seq_fp_table"][d, j] = self.residual[d].table(w.request.id, self.max_pages, self.fp_scratch)
            tables["cu_q_lens"][d, len(work) + 1 :] = tables["cu_q_lens"][d, len(work)]
            tables["num_seqs"][d, 0] = len(work)

    def fill_row(self, tables: dict, d: int, r: int, request_id) -> None:
        """Row r of shard d reads and writes the cache of `request_id`."""
        pages = self.pools[d].table(request_id)[: self.max_pages]
        tables["page_table"][d, r, : len(pages)] = pages
        if self.residual:
            tables["fp_table"][d, r] = self.residual[d].table(request_id, self.max_pages, self.fp_scratch)

    def put(self, array, pspec_logical):
        return jax.device_put(
            np.asarray(array), NamedSharding(self.program.mesh, self.program.layout.compute_spec(pspec_logical))
        )

    def with_tables(self, cache, tables: dict, resident: bool = False):
        """`cache` with this step's tables (flattened to [D width, ...]) on the devices; `resident`:
        the page tables as deltas against the device's copy from the last step of this width."""
        flat = {}
        for name, t in tables.items():
            if name in SEQUENCE_VECTORS:
                flat[name] = self.put(t.reshape(-1), ROW)
            elif resident and name in RESIDENT_TABLES:
                flat[name] = self._resident(name, t.reshape(-1, t.shape[-1]))
            else:
                flat[name] = self.put(t.reshape(-1, t.shape[-1]), ROWS)
        return dataclasses.replace(cache, **flat)

    def _resident(self, name: str, table: np.ndarray):
        """`table` [rows, max_pages] on the device: the device's copy from the last step with as
        many rows, the rows that differ scattered into it (their count padded to a power of two:
        one small program per count, compiled in `warmup`); the whole table the first time."""
        key = (name, table.shape[0])
        held = self._tables.get(key)
        self.stats["table_rows"] += table.shape[0]
        if held is None or held[1].is_deleted():
            out = self.put(table, ROWS)
            self.stats["table_rows_sent"] += table.shape[0]
        else:
            out = self._send_rows(held[1], table, np.flatnonzero((held[0] != table).any(axis=1)).tolist())
        self._tables[key] = (table, out)
        return out

    def _send_rows(self, device, table: np.ndarray, changed: list):
        """`device` with rows `changed` of `table` scattered in (their count padded to a power of two)."""
        if not changed:
            return device
        rows = np.asarray(sampling_lib.pad(changed), np.int32)
        self.stats["table_rows_sent"] += len(changed)
        return self._scatter_fn()(device, rows, table[rows])

    def _keep_tables(self, cache) -> None:
        """After a step: its resident tables as the step returned them (the call donated its inputs)."""
        for name in RESIDENT_TABLES:
            a = getattr(cache, name, None)
            if a is not None and (name, a.shape[0]) in self._tables:
                self._tables[(name, a.shape[0])] = (self._tables[(name, a.shape[0])][0], a)

    def _scatter_fn(self):
        if "_scatter" not in self.__dict__:
            rows = NamedSharding(self.program.mesh, self.program.layout.compute_spec(ROWS))
            self._scatter = jax.jit(lambda t, at, new: t.at[at].set(new), donate_argnums=0, out_shardings=rows)
        return self._scatter

    def forward(self, tokens, positions, tables: dict, cache=None, feed=None):
        """One device call on rows [D, width] (shard d's rows first-to-last in block d) through the
        engine's cache (or `cache`, a view of it): the logits [D width, V]; the cache is updated.
        `feed` (overlap): (src [D, width], sampled tokens on the device): rows with src >= 0 take
        token sampled[src] instead of theirs, gathered on the device."""
        view = self.with_tables(self.cache, tables, resident=True) if cache is None else cache
        ids = self.put(tokens.reshape(-1), ROW)
        if feed is not None:
            ids = self._feed_fn()(ids, self.put(feed[0].reshape(-1), ROW), feed[1])
        return self._run(ids, self.put(positions.reshape(-1), ROW), view, keep=cache is None)

    def _run(self, ids, positions, view, keep: bool = True):
        """The runner on device inputs; the cache (and with `keep`, the resident tables) as it returns them."""
        logits, out = self.runner(self.params, ids, positions, view)
        if keep:
            self._keep_tables(out)
        self.cache = self.without_tables(out)
        return logits

    def _feed_fn(self):
        """The device-side gather of pending tokens into a step's token rows (one program per row bucket)."""
        if "_feed" not in self.__dict__:
            row = NamedSharding(self.program.mesh, self.program.layout.compute_spec(ROW))
            self._feed = jax.jit(
                lambda ids, src, prev: jnp.where(src >= 0, prev[jnp.maximum(src, 0)].astype(ids.dtype), ids),
                out_shardings=row,
            )
        return self._feed

    @staticmethod
    def without_tables(cache):
        """The pools of a cache (or a cache view) returned by a step, tables dropped."""
        inner = getattr(cache, "cache", cache)  # a WindowView's own cache
        return dataclasses.replace(inner, **{name: None for name in inner.row_fields})

    def widths(self) -> list[int]:
        """The row buckets (per shard) a step compiles for: powers of two from 8 to the token budget."""
        top = max(self.budget, MIN_ROWS)
        out, w = [], MIN_ROWS
        while w < top:
            out.append(w)
            w *= 2
        return out + [top]

    def width(self, n: int) -> int:
        """The row bucket for n rows (a drafter's catch-up round may exceed the budget: a power of two)."""
        return next((w for w in self.widths() if w >= n), 1 << (n - 1).bit_length())

    def warmup(self) -> None:
        """Compile every row bucket now (steps of padding rows only: they write the scratch page),
        its sampling, and the drafter's programs."""
        for width in self.widths():
            rows = np.zeros((self.shards, width), np.int32)
            for ragged in (False, True) if self.ragged else (False,):
                logits = self.forward(rows, rows, self.tables(width, ragged=ragged))
            for name in RESIDENT_TABLES:  # the scatters of 1, 2, 4, ... changed rows into its tables
                key = (name, self.shards * width)
                if key in self._tables:
                    table, held = self._tables[key]
                    for count in (1 << i for i in range((self.shards * width - 1).bit_length() + 1)):
                        at = np.zeros(count, np.int32)
                        held = self._scatter_fn()(held, at, table[at])
                    self._tables[key] = (table, held)
            if self.decode_steps > 1:  # the multi-step decode loops (padding rows, zero steps)
                for greedy in (True, False):
                    flat = rows.reshape(-1)
                    _, cache = self.runner.decode_loop(
                        self.params,
                        self.put(flat, ROW),
                        self.put(flat, ROW),
                        self.with_tables(self.cache, self.tables(width)),
                        self.put(np.zeros(self.shards, np.int32), ROW),
                        (self.put(flat, ROW), self.put(flat, ROW))
                        + (self.put(np.zeros(flat.shape, np.float32), ROW), self.put(flat, ROW))
                        + (self.put(np.ones(flat.shape, np.float32), ROW),),
                        self.decode_steps,
                        greedy,
                    )
                    self.cache = self.without_tables(cache)
            for setting in (Sampling(), Sampling(temperature=1.0)):  # greedy, drawn
                sample_rows = {0: (0, Request(0, [0], 1))}
                _, sampled = self._sample_device(logits, sample_rows, {0: setting})
                if self.overlap:  # the gather of pending tokens into this bucket's rows
                    self._feed_fn()(self.put(rows.reshape(-1), ROW), self.put(rows.reshape(-1) - 1, ROW), sampled)
                if self.drafter is None and not self.residual:  # two steady steps of no sequence
                    flat = self.put(rows.reshape(-1), ROW)
                    columns = self._sample_columns(sample_rows, {0: setting})[2]
                    empty = np.zeros(0, np.int64)
                    args = (width, (), [], empty, empty, flat, flat, columns, sampled, setting.temperature == 0)
                    self._steady = self._steady_state(*args)
                    self._steady_step([[] for _ in self.schedulers], width)
                    self._steady = None
        if self.preemption == "swap":  # its copies out and back, page counts padded to powers of two
            for d in range(self.shards):
                for count in (1 << i for i in range((self.max_pages - 1).bit_length() + 1)):
                    block = self._to_host(self.export_pages(d, [self.scratch] * count))
                    self.import_pages(d, [self.scratch] * count, self.receive_pages(d, self._from_host(block))[0])
        if self.drafter is not None:
            self.drafter.warmup(self)
        jax.block_until_ready(self.cache)

    # -- weights and memory between uses (RL: the trainer updates the weights; colocated, the
    # trainer and the engine take turns on the devices)
    def set_params(self, params) -> int:
        """Serve `params` from now on: moved into this engine's layout (program.param_shardings) from
        whatever devices and layout they are in (a resharding transfer, e.g. from a trainer on
        another sub-mesh; always a copy, so the trainer may donate its own). Nothing recompiles
        (same shapes). The prefix cache is forgotten (its pages hold keys and values of the old
        weights). Returns the bytes the engine's devices received (`reshard`)."""
        self.params, moved = reshard(params, self.program.param_shardings)
        for pool in self.pools:
            pool.forget_cache()
        return moved

    def sleep(self) -> None:
        """Give the devices back while idle: the KV cache's buffers are freed (the weights stay; a
        colocated trainer frees or offloads its own). `wake` makes an empty cache again."""
        if not self.idle:
            raise ValueError("sleep() needs an idle engine: finish or abort its requests first")
        for a in self.cache.per_layer().values():
            a.delete()
        self.cache = None

    def wake(self) -> None:
        """An empty cache again after `sleep` (the prefix cache is forgotten: its pages are gone)."""
        if self.cache is not None:
            return
        pool = self.pools[0]
        self.pools[:] = [PagePool(pool.num_pages, pool.page_size, pool.ring) for _ in self.pools]
        for scheduler, fresh in zip(self.schedulers, self.pools):
            scheduler.pool = fresh
        max_seqs = self.schedulers[0].max_seqs
        self.cache = self._empty_cache(pool.num_pages, pool.page_size, self.budget, max_seqs)

    # -- requests
    @property
    def idle(self) -> bool:
        return all(s.idle for s in self.schedulers) and not any(self.forks.values()) and self.inflight is None

    @property
    def finished(self) -> list[Request]:
        """Requests that have ended (under overlap, once their last token is read)."""
        return [r for s in self.schedulers for r in s.finished if not r.pending]

    def forget_finished(self) -> None:
        for s in self.schedulers:
            s.finished[:] = [r for r in s.finished if r.pending]  # their last token is still to come
        self.failed.clear()

    def submit(
        self,
        request_id,
        prompt: list,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        k: int | None = None,
        fork_of=None,
    ) -> Request:
        """Queue a request on the batch shard with the least outstanding work; ValueError if it can
        never be served (too long for a shard's pool, tokens outside the vocabulary, a sampling
        setting out of range). `k`: this request's draft length under speculation (None: the
        engine's; 0: plain decoding; requests with penalties decode plainly). `fork_of`: the id of
        a request with the same prompt whose prefill this one shares (n > 1 samples): it gets the
        prompt's cache copied from that request when its prefill ends, and its first token from the
        same logits, drawn with its own sampling."""
        vocab = self.program.config.model.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"request {request_id!r}: token ids outside [0, {vocab})")
        if request_id in self.shard_of:
            raise ValueError(f"request {request_id!r} is already in the engine: give each request its own id")
        k = (self.k if self.drafter is not None else 0) if k is None else k
        if not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"request {request_id!r}: k={k!r} must be an integer >= 0 (0: no speculation)")
        if k and self.drafter is None:
            raise ValueError(f"request {request_id!r}: k={k} needs an engine with a drafter (config.serve.spec_k)")
        sampling = sampling or Sampling()
        sampling.check(f"request {request_id!r}")
        vocab = self.program.config.model.vocab_size
        if any(token >= vocab for token, _ in sampling.logit_bias):
            raise ValueError(f"request {request_id!r}: logit_bias names token ids outside the vocabulary [0, {vocab})")
        if sampling.adjusted:  # the rejection rule would need the adjusted distribution per draft
            k = 0
        request = Request(
            request_id,
            list(prompt),
            max_new_tokens,
            spec_k=int(k),
            stop_ids=tuple(int(t) for t in sampling.stop_ids),
            share_prefix=not sampling.prompt_logprobs,  # every prompt row's logits are needed
        )
        parent = self._forkable(fork_of, request) if fork_of is not None else None
        if parent is not None:
            shard = self.shard_of[parent.id]
            self.schedulers[shard].check(request)
            request.fork_of = parent.id
            self.forks.setdefault(parent.id, []).append(request)
        else:
            load = lambda d: sum(
                len(r.prompt) + r.max_new_tokens for r in self.schedulers[d].waiting + self.schedulers[d].running
            )
            shard = min(range(self.shards), key=load)
            self.schedulers[shard].add(request)  # raises ValueError for a request that can never fit
        self.shard_of[request_id] = shard
        self.sampling[request_id] = sampling
        return request

    def _forkable(self, parent_id, request: Request) -> Request | None:
        """The request `request` may share the prefill of: `parent_id`, waiting or still prefilling
        the same prompt (None when its prefill is over: then `request` prefills on its own)."""
        d = self.shard_of.get(parent_id)
        parent = None if d is None else self._find(d, parent_id)
        if parent is None:
            raise ValueError(f"fork_of={parent_id!r} names no waiting or running request of this engine")
        if parent.prompt != request.prompt:
            raise ValueError(f"request {request.id!r}: fork_of={parent_id!r} has another prompt; a fork shares it")
        return parent if parent.prefilled < len(parent.prompt) else None

    def _find(self, d: int, request_id) -> Request | None:
        s = self.schedulers[d]
        return next((r for r in s.waiting + s.running if r.id == request_id), None)

    def abort(self, request_id) -> bool:
        return self.finish(request_id, "abort")

    def finish(self, request_id, reason: str) -> bool:
        """End a request now, waiting, running or waiting to fork, with finish_reason `reason` (a
        stop string matched: "stop"; "abort" drops it without listing it in `finished`); its pages
        are freed at once. False if the engine does not hold it."""
        d = self.shard_of.get(request_id)
        if d is None:
            return self._finish_in_flight(request_id, reason)
        ended = self.schedulers[d].remove(request_id, reason, keep=reason != "abort")
        if ended is None:  # a fork still waiting for its parent's prefill
            for parent, children in self.forks.items():
                ended = next((r for r in children if r.id == request_id), None)
                if ended is not None:
                    children.remove(ended)
                    ended.finish_reason = reason
                    if reason != "abort":
                        self.schedulers[d].finished.append(ended)
                    break
        if ended is None:
            return False
        self._forget(d, request_id)
        return True

    def _finish_in_flight(self, request_id, reason: str) -> bool:
        """Overlap: a request whose last token is sampled but not yet read (its pages are already
        free) ends now with `reason`; that token is dropped when it arrives."""
        for d, work in enumerate(self.inflight.plans if self.inflight else []):
            for w in work:
                r = w.request
                if r.id == request_id and r.pending and r.finish_reason is None:
                    r.finish_reason = reason
                    if reason == "abort":
                        self.schedulers[d].finished.remove(r)
                    return True
        return False

    def _preempted(self, r: Request) -> None:
        """A scheduler takes `r`'s pages back: drop what the device side holds for it; under swap
        preemption, first copy the cache it has (`r.cached` tokens) to host memory."""
        d = self.shard_of[r.id]
        if self.preemption == "swap" and r.cached:
            pool = self.pools[d]
            block = self.export_pages(d, sampling_lib.pad(pool.table(r.id)[: pool.pages_for(r.cached)]))
            self.swapped[r.id] = (r.cached, self._to_host(block))
            r.swapped = r.cached
            self.stats["swapped_out"] += r.cached
        if self.residual:
            self.residual[d].free(r.id)
        if self.drafter is not None:
            self.drafter.forget(r.id)
        for child in self.forks.pop(r.id, []):  # its forks prefill on their own
            self.schedulers[d].waiting.append(child)
            child.fork_of = None

    def _resume(self, r: Request) -> int:
        """A swapped request has pages again: its cache goes back into them. Returns its tokens."""
        d = self.shard_of[r.id]
        tokens, block = self.swapped.pop(r.id)
        pool = self.pools[d]
        placed, _ = self.receive_pages(d, self._from_host(block))
        self.import_pages(d, sampling_lib.pad(pool.table(r.id)[: pool.pages_for(tokens)]), placed)
        self.stats["swapped_in"] += tokens
        return tokens

    def _to_host(self, block: dict) -> dict:
        """Swap preemption: an `export_pages` block copied to host memory without waiting for it
        (a device_put to the devices' pinned_host memory, asynchronous; the host step loop goes
        on); where the devices have no host memory kind, read into numpy (blocking)."""
        if "_host_memory" not in self.__dict__:
            device = self.program.mesh.devices.flat[0]
            try:
                self._host_memory = "pinned_host" in {m.kind for m in device.addressable_memories()}
            except Exception:  # noqa: BLE001 - backends without memories raise various errors
                self._host_memory = False
        if not self._host_memory:
            return jax.device_get(block)
        return {name: jax.device_put(a, a.sharding.with_memory_kind("pinned_host")) for name, a in block.items()}

    @staticmethod
    def _from_host(block: dict) -> dict:
        """A `_to_host` block back in device memory (numpy blocks as they are: `receive_pages` places them)."""
        back = lambda a: jax.device_put(a, a.sharding.with_memory_kind("device")) if isinstance(a, jax.Array) else a
        return {name: back(a) for name, a in block.items()}

    def _forget(self, d: int, request_id) -> None:
        self.swapped.pop(request_id, None)
        self.sampling.pop(request_id, None)
        self.shard_of.pop(request_id, None)
        if self.residual:
            self.residual[d].free(request_id)
        if self.drafter is not None:
            self.drafter.forget(request_id)
        for child in self.forks.pop(request_id, []):  # its forks prefill on their own
            self.schedulers[d].waiting.append(child)
            child.fork_of = None

    # -- one step
    def step(self) -> tuple[list, dict]:
        """One scheduled step on every shard. A failure inside it fails the step's requests
        (finish_reason "error", `Request.error`, listed in `failed`) and leaves the engine serving
        the others; if the device cache was lost with it, every running request fails."""
        plans = [s.plan() for s in self.schedulers]
        n = max(sum(w.tokens for w in work) for work in plans)
        if self.overlap:
            return self._overlapped(plans, n)
        return self._synchronous(plans, n)

    def _synchronous(self, plans, n: int) -> tuple[list, dict]:
        if n == 0:
            return [], {}
        try:
            return self._step(plans, n)
        except Exception as e:  # noqa: BLE001 - isolate the failure to the step's requests
            log.exception("jaxsys.serve: a step failed; its requests end with finish_reason 'error'")
            self._fail(plans, f"{type(e).__name__}: {e}")
            return [], {}

    # -- overlapped scheduling (serve.overlap): step n + 1 is planned and dispatched while the
    # device runs step n; its decodes read their input tokens from step n's sampled tokens on the
    # device, and step n's tokens are read (stop ids, streaming, finishing) after the dispatch
    def _overlapped(self, plans, n: int) -> tuple[list, dict]:
        """Dispatch this step, then read the step in flight: its (work, tokens) are what returns. A
        step with forks, penalties or log-probabilities runs synchronously after the read."""
        prev, self.inflight = self.inflight, None
        if n and self._overlappable(plans):
            try:
                self.inflight = self._dispatch(plans, n, prev)
            except Exception as e:  # noqa: BLE001 - isolate the failure to the step's requests
                log.exception("jaxsys.serve: a step failed; its requests end with finish_reason 'error'")
                done = self._receive(prev)
                self._fail(plans, f"{type(e).__name__}: {e}")
                return done
            done = self._receive(prev)
            self._commit_pending(self.inflight)
            return done
        work, sampled = self._receive(prev)
        for d, s in enumerate(self.schedulers):  # a stop id read just now ended some of them
            running = {id(r) for r in s.running}
            plans[d] = [w for w in plans[d] if id(w.request) in running]
        more, later = self._synchronous(plans, max(sum(w.tokens for w in work) for work in plans))
        for rid, tokens in later.items():
            sampled[rid] = _as_list(sampled[rid]) + _as_list(tokens) if rid in sampled else tokens
        return work + more, sampled

    def _overlappable(self, plans) -> bool:
        if any(self.forks.values()):
            return False
        settings = [self.sampling[w.request.id] for work in plans for w in work]
        return not any(s.adjusted or s.logprobs is not None or s.prompt_logprobs for s in settings)

    def _dispatch(self, plans, n: int, prev: _InFlight | None) -> _InFlight:
        """Run a step on the device without reading its tokens: decodes whose last token is still
        on the device (pending) take it from `prev`'s sampled tokens there."""
        width = self.width(n)
        steady = self._steady_step(plans, width, prev)
        if steady is not None:
            st, sampled = steady
            sampled.copy_to_host_async()
            return _InFlight(plans, {rid: i for i, rid in enumerate(st.ids[: len(st.requests)])}, sampled)
        self._prepare_residual(plans)
        tokens, positions, tables, sample_rows, _, _, src = self._rows(plans, width, None, prev)
        feed = (src, prev.tokens) if prev is not None and (src >= 0).any() else None
        logits = self.forward(tokens, positions, tables, feed=feed)
        self.stats["target_steps"] += 1
        if not sample_rows:
            self._steady = None
            return _InFlight(plans, {}, None)
        ids, sampled = self._sample_device(logits, sample_rows)
        sampled.copy_to_host_async()  # on its way while the host plans the next step
        self._settle(plans, width, positions, sample_rows, sampled)
        return _InFlight(plans, {rid: i for i, rid in enumerate(ids[: len(sample_rows)])}, sampled)

    def _commit_pending(self, step: _InFlight) -> None:
        """The dispatched step's effect on the schedule, its sampled tokens not yet known: each
        sampling request holds one pending token (a request that reaches max_new_tokens has ended:
        its pages are free, it lists as finished once the token is read)."""
        sampled = dict.fromkeys(step.slots, PENDING)
        for d, (scheduler, work) in enumerate(zip(self.schedulers, step.plans)):
            running = {id(r) for r in scheduler.running}
            live = [w for w in work if id(w.request) in running]  # not ended by the read meanwhile
            for req in scheduler.commit(live, sampled):
                self._forget(d, req.id)
            for w in live:
                if w.kind == "decode":
                    w.request.stats["decode_steps"] += 1
                if self.residual and not w.request.ended:
                    self.residual[d].advance(w.request.id, w.request.cached)

    def _receive(self, step: _InFlight | None) -> tuple[list, dict]:
        """Read a dispatched step's tokens and apply them: (its work, {request id: token}) for the
        requests that keep theirs (an abort or a stop string meanwhile drops it); a stop id ends
        its request now (the step dispatched since computed one token for it in vain)."""
        if step is None:
            return [], {}
        work = [w for plan in step.plans for w in plan]
        if step.tokens is None:
            return work, {}
        try:
            values = np.asarray(step.tokens).tolist()
        except Exception as e:  # noqa: BLE001 - the step failed on the device: its requests end
            log.exception("jaxsys.serve: a step failed; its requests end with finish_reason 'error'")
            self._fail([list(plan) for plan in step.plans], f"{type(e).__name__}: {e}")
            return [], {}
        out = {}
        for d, plan in enumerate(step.plans):
            for w in plan:
                r = w.request
                if r.id not in step.slots or not r.pending:
                    continue
                kept, ended = self.schedulers[d].receive(r, values[step.slots[r.id]])
                if kept:
                    out[r.id] = values[step.slots[r.id]]
                if ended:
                    self._forget(d, r.id)
        self.stats["tokens"] += len(out)
        return work, out

    def _fail(self, plans, message: str) -> None:
        self._steady = None
        lost = any(getattr(a, "is_deleted", lambda: False)() for a in self.cache.per_layer().values())
        if lost:  # the step's call had taken (donated) the cache: start from an empty one
            for d, s in enumerate(self.schedulers):
                plans[d] = [Work(r, "decode", 0, 0) for r in s.running]
            pool = self.pools[0]
            self.cache = self._empty_cache(pool.num_pages, pool.page_size, self.budget, self.schedulers[0].max_seqs)
        for d, work in enumerate(plans):
            for w in work:
                r = self.schedulers[d].remove(w.request.id, "error", keep=True)
                if r is not None:
                    r.error = message
                    self.failed.append(r)
                    self._forget(d, r.id)

    def _step(self, plans, n: int) -> tuple[list, dict]:
        steps = self._loop_steps(plans)
        if steps > 1:
            self._steady = None  # the loop moves every sequence several positions on
            return self._decode_loop(plans, n, steps)
        width = self.width(n)
        steady = self._steady_step(plans, width)
        if steady is not None:
            st, dev = steady
            sampled = dict(zip(st.ids, np.asarray(dev)[: len(st.requests)].tolist()))
            logprobs, forked = {}, []
        else:
            sampled, logprobs, forked = self._built_step(plans, width)
        for d, (scheduler, work) in enumerate(zip(self.schedulers, plans)):
            before = {w.request.id: len(w.request.generated) for w in work}
            for req in scheduler.commit(work, sampled):
                self._forget(d, req.id)
            for w in work:
                req = w.request
                self._record(req, before[req.id], logprobs.get(req.id), sampled)
                if w.kind == "decode":
                    req.stats["decode_steps"] += 1
                if self.residual and not req.done:  # give back the pages no later row reads
                    self.residual[d].advance(req.id, req.cached)
        for d, child in forked:
            child.append([sampled[child.id]])
            self._record(child, 0, logprobs.get(child.id), sampled)
            if child.done:
                self.schedulers[d].remove(child.id, child.finish_reason, keep=True)
                self._forget(d, child.id)
        self.stats["tokens"] += sum(len(v) if isinstance(v, list) else 1 for v in sampled.values())
        return [w for work in plans for w in work], sampled

    def _built_step(self, plans, width: int) -> tuple[dict, dict, list]:
        """A step whose rows the host builds (any mix of prefill, decode and drafts): (sampled
        tokens, log-probabilities, forks started). A decode-only step leaves its successor's inputs
        on the device (`_settle`)."""
        self._prepare_residual(plans)
        drafts = self.drafter.propose(self, plans) if self.drafter is not None else None
        tokens, positions, tables, sample_rows, verify_rows, prompt_rows, _ = self._rows(plans, width, drafts)
        logits = self.forward(tokens, positions, tables)
        self.stats["target_steps"] += 1
        sampled, dev = {}, None
        if sample_rows:
            ids, dev = self._sample_device(logits, sample_rows)
            sampled = dict(zip(ids[: len(sample_rows)], np.asarray(dev).tolist()))
        self._settle(plans, width, positions, sample_rows, dev)
        rows = {rid: [row] for rid, (row, _) in sample_rows.items()}
        if verify_rows:
            verified = self.drafter.verify(self, logits, verify_rows, drafts)
            sampled.update(verified)
            rows.update({rid: [verify_rows[rid][0] + i for i in range(len(out))] for rid, out in verified.items()})
        if prompt_rows:
            self._prompt_logprobs(logits, prompt_rows)
        return sampled, self._logprobs(logits, rows, sampled), self._fork(plans, sampled)

    # -- steady decoding: a decode-only step of the same sequences in the same rows as the last
    # step takes its inputs from that step on the device (tokens: its sampled ones; positions and
    # sampling counts + 1), and sends only the page-table rows of sequences that took a page. The
    # host neither builds rows nor uploads per-row arrays (issue 31).
    def _settle(self, plans, width: int, positions: np.ndarray, sample_rows: dict, sampled) -> None:
        """After a step built on the host: if it was decode-only (one token per sequence, sampling
        without penalties or log-probabilities, no drafter nor kv_quant), keep its successor's
        inputs on the device; else none."""
        self._steady = None
        works = [w for work in plans for w in work]
        if not self.steady or sampled is None or self.drafter is not None or self.residual or not works:
            return
        if any(w.kind != "decode" or w.tokens != 1 for w in works) or any(self.forks.values()):
            return
        settings = [self.sampling[w.request.id] for w in works]
        if any(s.adjusted or s.logprobs is not None for s in settings):
            return
        ids, _, columns = self._sample_columns(sample_rows)
        active = np.zeros(positions.size, np.int32)
        active[columns[0]] = 1
        self._steady = self._steady_state(
            width,
            tuple(w.request for w in works),
            ids,
            columns[0][: len(works)].astype(np.int64),
            np.asarray([w.start + 1 for w in works], np.int64),
            self.put(positions.reshape(-1), ROW),
            self.put(active, ROW),
            columns,
            sampled,
            all(s.temperature == 0 for s in settings),
        )

    def _steady_state(self, width, requests, ids, rows, next_positions, positions, active, columns, sampled, greedy):
        """A `_Steady` whose inputs follow a step that sampled `sampled` (device) at positions
        `positions` (device [D width]) with `columns` (host: rows, seed, count, temperature, top_k,
        top_p per sampling slot)."""
        rep = NamedSharding(self.program.mesh, jax.sharding.PartitionSpec())
        cols = tuple(jax.device_put(c, rep) for c in columns)
        tokens, positions, counts = self._advance_fn()(sampled, cols[0], positions, cols[2], active)
        return _Steady(
            width,
            requests,
            tuple(map(id, requests)),
            ids,
            rows,
            next_positions,
            tokens,
            positions,
            active,
            (cols[0], cols[1], counts, *cols[3:]),
            greedy,
        )

    def _advance_fn(self):
        """The next steady step's inputs from this step's, on the device (one program per row bucket)."""
        if "_advance" not in self.__dict__:
            row = NamedSharding(self.program.mesh, self.program.layout.compute_spec(ROW))
            rep = NamedSharding(self.program.mesh, jax.sharding.PartitionSpec())
            self._advance = jax.jit(
                lambda sampled, at, positions, counts, active: (
                    jnp.zeros(positions.shape, jnp.int32).at[at].set(sampled.astype(jnp.int32)),
                    positions + active,
                    counts + 1,
                ),
                out_shardings=(row, row, rep),
            )
        return self._advance

    def _steady_step(self, plans, width: int, prev: _InFlight | None = None):
        """Run this step from the steady inputs if its plan is the last step's sequences, each
        decoding one token, in the same rows: (the state, the sampled tokens on the device), the
        state advanced to the next step; else None (the step is built on the host)."""
        st = self._steady
        if st is None or st.width != width:
            return None
        works = [w for work in plans for w in work]
        if len(works) != len(st.requests) or any(w.kind != "decode" or w.tokens != 1 for w in works):
            return None
        if tuple(id(w.request) for w in works) != st.keys:
            return None
        key = ("page_table", self.shards * width)
        held = self._tables.get(key)
        if held is None or held[1].is_deleted():
            return None
        table, device = held
        # a sequence's table row changes only when it takes a page: at a page's first position
        page_size = self.pools[0].page_size
        changed = []
        for i in np.flatnonzero(st.positions_host % page_size == 0).tolist():
            row = int(st.rows[i])
            pages = self.pools[row // width].table(st.requests[i].id)[: self.max_pages]
            if not np.array_equal(table[row, : len(pages)], pages):
                table[row, : len(pages)] = pages
                changed.append(row)
        self.stats["table_rows"] += table.shape[0]
        device = self._send_rows(device, table, changed)
        self._tables[key] = (table, device)
        if self.verify_steady and st.requests:  # (warmup runs sequence-less steps)
            self._verify_steady(st, plans, width, prev, table)
        logits = self._run(st.tokens, st.positions, dataclasses.replace(self.cache, page_table=device))
        if st.requests:
            self.stats["target_steps"] += 1
            self.stats["steady_steps"] += 1
        if st.greedy:
            sampled = sampling_lib.greedy_at(logits, st.sample[0])
        else:
            sampled = sampling_lib.sample_at(logits, *st.sample)
        st.tokens, st.positions, counts = self._advance_fn()(
            sampled, st.sample[0], st.positions, st.sample[2], st.active
        )
        st.sample = (*st.sample[:2], counts, *st.sample[3:])
        st.positions_host = st.positions_host + 1
        return st, sampled

    def _verify_steady(self, st, plans, width: int, prev, table: np.ndarray) -> None:
        """The steady inputs equal the rows the host would build for this step (tests)."""
        tokens, positions, tables, sample_rows, _, _, src = self._rows(plans, width, None, prev)
        flat = src.reshape(-1) < 0
        assert np.array_equal(np.asarray(st.tokens)[flat], tokens.reshape(-1)[flat]), "steady tokens"
        assert np.array_equal(np.asarray(st.positions), positions.reshape(-1)), "steady positions"
        assert np.array_equal(table, tables["page_table"].reshape(table.shape)), "steady page table"
        reqs = [sample_rows[rid][1] for rid in st.ids]
        assert np.asarray(st.sample[0]).tolist() == [sample_rows[rid][0] for rid in st.ids], "steady rows"
        assert np.asarray(st.sample[2]).tolist() == [len(r.generated) + r.pending for r in reqs], "steady counts"

    def _prepare_residual(self, plans) -> None:
        if self.residual:  # kv_quant: the full-precision pages the rows of this step (and its drafts) use
            for d, work in enumerate(plans):
                for w in work:
                    self.residual[d].prepare(w.request.id, w.start, w.tokens)

    def _rows(self, plans, width: int, drafts=None, prev: _InFlight | None = None) -> tuple:
        """A step's rows [D, width]: (tokens, positions, tables, sample_rows {request id: (row,
        request)}, verify_rows {request id: (first row, work)} of speculative decodes, prompt_rows
        [(row, next prompt token, request)] wanting prompt log-probabilities, src: for each row
        whose token is a pending one (overlap), its index in `prev`'s sampled tokens, else -1)."""
        tokens = np.zeros((self.shards, width), np.int32)
        positions = np.zeros((self.shards, width), np.int32)
        src = np.full((self.shards, width), -1, np.int32)
        # the ragged kernel where a sequence has several rows (a prefill chunk, a speculative
        # verify); a decode-only step reads each sequence's pages once anyway, row by row, and the
        # ragged kernel would pad every decode to a query block
        tables = self.tables(width, ragged=any(w.tokens > 1 for work in plans for w in work))
        self.fill_sequences(tables, plans)
        sample_rows, verify_rows, prompt_rows = {}, {}, []
        for d, work in enumerate(plans):
            r = 0
            for w in work:
                req = w.request
                for i in range(w.tokens):
                    pos = w.start + i
                    if w.kind == "prefill":
                        tokens[d, r] = req.prefix[pos]
                        # each prompt row once: not again when a preemption recomputes it, and
                        # the rows a preemption during prefill cut off when they come
                        todo = max(len(req.prompt_logprobs) - 1, 0) <= pos < len(req.prompt) - 1
                        if self.sampling[req.id].prompt_logprobs and todo:
                            prompt_rows.append((d * width + r, req.prompt[pos + 1], req))
                    elif i == 0 and req.pending:  # sampled by the step in flight, still on the device
                        src[d, r] = prev.slots[req.id]
                    else:  # the last token, then under speculation the drafted ones
                        tokens[d, r] = req.generated[-1] if i == 0 else drafts.tokens[req.id][i - 1]
                    positions[d, r] = pos
                    self.fill_row(tables, d, r, req.id)
                    r += 1
                if w.kind == "decode" and w.tokens > 1:
                    verify_rows[req.id] = (d * width + r - w.tokens, w)
                elif w.kind == "decode" or w.start + w.tokens == len(req.prefix):
                    sample_rows[req.id] = (d * width + r - 1, req)
                    for child in self.forks.get(req.id, []) if w.kind == "prefill" else []:
                        sample_rows[child.id] = (d * width + r - 1, child)  # its first token, same logits
        return tokens, positions, tables, sample_rows, verify_rows, prompt_rows, src

    def _loop_steps(self, plans) -> int:
        """How many decode steps this step can run in one call: `decode_steps` when every running
        sequence decodes one token (no prefill, no draft, no log-probabilities or penalties, nothing
        waiting), at most the fewest tokens any of them has left, and only if their pages can
        grow that far now (else 1)."""
        if self.decode_steps == 1 or any(s.waiting for s in self.schedulers) or any(self.forks.values()):
            return 1
        works = [w for work in plans for w in work]
        if any(w.kind != "decode" or w.tokens != 1 for w in works):
            return 1
        if any(self.sampling[w.request.id].logprobs is not None or self.sampling[w.request.id].adjusted for w in works):
            return 1
        steps = min([self.decode_steps] + [w.request.max_new_tokens - len(w.request.generated) for w in works])
        if steps < 2:
            return 1
        for d, work in enumerate(plans):
            for w in work:
                try:
                    self.pools[d].reserve(w.request.id, w.start + steps)
                except PoolExhausted:
                    self._steady = None  # tables grew away from a page's first position: rebuild them
                    return 1
        return steps

    def _decode_loop(self, plans, n: int, steps: int) -> tuple[list, dict]:
        """`steps` decode steps of every running sequence in one compiled call (multi-step decoding):
        each sequence gets `steps` tokens, cut at a stop id, exactly the tokens single steps give."""
        if self.residual:
            for d, work in enumerate(plans):
                for w in work:
                    self.residual[d].prepare(w.request.id, w.start, steps)
        width = self.width(n)
        tokens = np.zeros((self.shards, width), np.int32)
        positions = np.zeros((self.shards, width), np.int32)
        tables = self.tables(width)
        rows = {}
        for d, work in enumerate(plans):
            for r, w in enumerate(work):
                tokens[d, r], positions[d, r] = w.request.generated[-1], w.start
                self.fill_row(tables, d, r, w.request.id)
                rows[w.request.id] = (d * width + r, w.request)
        ids = [None] * (self.shards * width)
        for rid, (row, _) in rows.items():
            ids[row] = rid
        default = Sampling()
        settings = [self.sampling[rid] if rid is not None else default for rid in ids]
        generated = [len(rows[rid][1].generated) if rid is not None else 0 for rid in ids]
        columns = (
            np.asarray([s.seed for s in settings], np.int32),
            np.asarray(generated, np.int32),
            np.asarray([s.temperature for s in settings], np.float32),
            np.asarray([s.top_k for s in settings], np.int32),
            np.asarray([s.top_p for s in settings], np.float32),
        )
        greedy = all(self.sampling[rid].temperature == 0 for rid in rows)
        cache = self.with_tables(self.cache, tables)
        out, cache = self.runner.decode_loop(
            self.params,
            self.put(tokens.reshape(-1), ROW),
            self.put(positions.reshape(-1), ROW),
            cache,
            self.put(np.full(self.shards, steps, np.int32), ROW),  # one per batch shard
            tuple(self.put(c, ROW) for c in columns),
            self.decode_steps,
            greedy,
        )
        self.cache = self.without_tables(cache)
        out = np.asarray(out)[:steps]
        sampled = {rid: out[:, row].tolist() for rid, (row, _) in rows.items()}
        self.stats["target_steps"] += 1
        self.stats["loop_steps"] += steps
        for d, (scheduler, work) in enumerate(zip(self.schedulers, plans)):
            before = {w.request.id: len(w.request.generated) for w in work}
            for req in scheduler.commit(work, sampled):
                self._forget(d, req.id)
            for w in work:
                self._record(w.request, before[w.request.id], None, sampled)
                w.request.stats["decode_steps"] += 1
                if self.residual and not w.request.done:
                    self.residual[d].advance(w.request.id, w.request.cached)
        self.stats["tokens"] += sum(len(v) for v in sampled.values())
        return [w for work in plans for w in work], sampled

    def _record(self, req: Request, before: int, logprobs, sampled: dict) -> None:
        """What a request kept of this step's tokens (a stop id cuts a speculative run): `sampled`
        says exactly those; their log-probabilities go with them."""
        if req.id not in sampled:
            return
        kept = len(req.generated) - before
        if isinstance(sampled[req.id], list):
            sampled[req.id] = req.generated[before:]
        if logprobs is not None:
            chosen, top = logprobs
            req.logprobs += chosen[:kept]
            req.top_logprobs += top[:kept]

    def sample(self, logits, sample_rows: dict, settings_of: dict | None = None) -> dict:
        """{request id: token} for `sample_rows` {request id: (row of logits, request)} with their
        Sampling (`settings_of`, default the requests' own), in one call padded to `sample_slots`
        rows, so that it compiles once per row bucket (in `warmup`), not once per number of
        sequences. Rows with penalties, a logit bias or min_p go through `sampling.sample_adjusted`
        (their seen tokens and biased ids padded to powers of two)."""
        ids, tokens = self._sample_device(logits, sample_rows, settings_of)
        return dict(zip(ids[: len(sample_rows)], np.asarray(tokens).tolist()))

    def _sample_columns(self, sample_rows: dict, settings_of: dict | None = None) -> tuple[list, list, tuple]:
        """(request ids padded to `sample_slots`, their Sampling, and per slot: row, seed, count,
        temperature, top_k, top_p) of a sampling call."""
        settings_of = self.sampling if settings_of is None else settings_of
        ids = sampling_lib.pad(list(sample_rows), max(self.sample_slots, len(sample_rows)))
        settings = [settings_of[rid] for rid in ids]
        columns = (
            np.asarray([sample_rows[rid][0] for rid in ids], np.int32),
            np.asarray([s.seed for s in settings], np.int32),
            # the key of the request's next token (counting one sampled and still in flight)
            np.asarray([len(sample_rows[rid][1].generated) + sample_rows[rid][1].pending for rid in ids], np.int32),
            np.asarray([s.temperature for s in settings], np.float32),
            np.asarray([s.top_k for s in settings], np.int32),
            np.asarray([s.top_p for s in settings], np.float32),
        )
        return ids, settings, columns

    def _sample_device(self, logits, sample_rows: dict, settings_of: dict | None = None) -> tuple[list, Any]:
        """`sample`'s call, its tokens left on the device: (the padded request ids, tokens [slots])."""
        ids, settings, columns = self._sample_columns(sample_rows, settings_of)
        args = (logits, *columns)
        if all(s.temperature == 0 and not s.adjusted for s in settings):
            tokens = sampling_lib.greedy_at(logits, args[1])
        elif not any(s.adjusted for s in settings):
            tokens = sampling_lib.sample_at(*args)
        else:
            seen = [
                (sample_rows[rid][1].prompt + sample_rows[rid][1].generated) if s.penalized else []
                for rid, s in zip(ids, settings)
            ]
            width = max(16, 1 << (max(len(h) for h in seen) - 1).bit_length())
            history = np.full((len(ids), width), -1, np.int32)
            generated = np.zeros((len(ids), width), bool)
            for i, (rid, h) in enumerate(zip(ids, seen)):
                history[i, : len(h)] = h
                generated[i, len(sample_rows[rid][1].prompt) : len(h)] = True
            penalties = [
                np.asarray([getattr(s, name) for s in settings], np.float32)
                for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
            ]
            bias_width = max(1, 1 << (max(len(s.logit_bias) for s in settings) - 1).bit_length())
            bias_ids = np.full((len(ids), bias_width), -1, np.int32)
            bias_values = np.zeros((len(ids), bias_width), np.float32)
            for i, s in enumerate(settings):
                for j, (token, bias) in enumerate(s.logit_bias):
                    bias_ids[i, j], bias_values[i, j] = token, bias
            min_p = np.asarray([s.min_p for s in settings], np.float32)
            tokens = sampling_lib.sample_adjusted(*args, min_p, history, generated, *penalties, bias_ids, bias_values)
        return ids, tokens

    def _logprobs(self, logits, rows: dict, sampled: dict) -> dict:
        """{request id: (log-probabilities of its sampled tokens, their top alternatives)} for the
        requests that asked (Sampling.logprobs), from the step's logits."""
        want = [rid for rid in rows if self.sampling[rid].logprobs is not None]
        if not want:
            return {}
        flat = [(rid, row, token) for rid in want for row, token in zip(rows[rid], _as_list(sampled[rid]))]
        chosen, alternatives = sampling_lib.logprobs_of_rows(
            logits,
            [row for _, row, _ in flat],
            [token for _, _, token in flat],
            [self.sampling[rid].logprobs or 0 for rid, _, _ in flat],
        )
        out: dict = {rid: ([], []) for rid in want}
        for (rid, _, _), lp, alts in zip(flat, chosen, alternatives):
            out[rid][0].append(lp)
            out[rid][1].append(alts)
        return out

    def _prompt_logprobs(self, logits, prompt_rows: list) -> None:
        """Each prompt token's log-probability given the tokens before it, and the top
        Sampling.logprobs alternatives there, for the prefill rows of requests that asked (the
        first prompt token has neither: None)."""
        chosen, alternatives = sampling_lib.logprobs_of_rows(
            logits,
            [row for row, _, _ in prompt_rows],
            [token for _, token, _ in prompt_rows],
            [self.sampling[req.id].logprobs or 0 for _, _, req in prompt_rows],
        )
        for (_, _, req), lp, alts in zip(prompt_rows, chosen, alternatives):
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)
                req.prompt_top_logprobs.append(None)
            req.prompt_logprobs.append(lp)
            req.prompt_top_logprobs.append(alts)

    def _fork(self, plans, sampled: dict) -> list:
        """The forks whose parent's prefill ended in this step: each gets pages (or, when its shard
        has no room, goes to the queue to prefill on its own), a copy of the parent's prompt cache
        and, with it, the parent's prompt log-probabilities. Returns [(shard, fork)] to commit."""
        out = []
        for d, work in enumerate(plans):
            for w in work:
                parent = w.request
                if w.kind != "prefill" or w.start + w.tokens != len(parent.prefix) or parent.id not in self.forks:
                    continue
                for child in self.forks.pop(parent.id):
                    s = self.schedulers[d]
                    if len(s.running) >= s.max_seqs or child.id not in sampled:
                        child.fork_of = None
                        s.waiting.append(child)
                        continue
                    tokens = len(child.prompt) + (child.max_new_tokens if s.allocation == "reserve" else 1)
                    try:
                        s.pool.reserve(child.id, tokens)
                    except PoolExhausted:
                        child.fork_of = None
                        s.waiting.append(child)
                        continue
                    self._copy_prompt(d, parent, child)
                    child.prefilled = len(child.prompt)
                    child.prompt_logprobs = list(parent.prompt_logprobs)
                    child.prompt_top_logprobs = list(parent.prompt_top_logprobs)
                    s.running.append(child)
                    out.append((d, child))
        return out

    def _copy_prompt(self, d: int, parent: Request, child: Request) -> None:
        """Copy the cache of `parent`'s prompt into `child`'s pages (shard d): the PagePool pages
        of every leaf, and under kv_quant the full-precision pages the child's next row needs."""
        n = self.pools[d].pages_for(len(parent.prompt))
        src_q, dst_q = self.pools[d].table(parent.id)[:n], self.pools[d].table(child.id)[:n]
        src = {name: src_q for name in self.cache.per_layer()}
        dst = {name: dst_q for name in self.cache.per_layer()}
        if self.residual:
            self.residual[d].prepare(child.id, len(child.prompt), 1)
            held, mine = self.residual[d].pages(parent.id), self.residual[d].pages(child.id)
            logical = sorted(set(held) & set(mine))
            for name in ("k", "v"):
                src[name], dst[name] = [held[i] for i in logical], [mine[i] for i in logical]
        self.copy_pages(d, src, dst)

    # -- a sequence's pages out of one engine and into another (disaggregated serving, serve/disagg.py).
    # Generic over the pools: every pool leaf is [L, D B, ...], its page dimension at axis 1 in D
    # blocks of B pages split over the batch axes (one block per batch shard, its last page scratch).
    # `pages`: one list of local page ids for every leaf, or a dict like the pools of such lists
    # (leaves with their own page ids, as a quantized cache's two pools).
    def request_pages(self, request_id) -> dict:
        """A running request's pages: {pool leaf: int32 indices along its page dimension (axis 1,
        global: shard d's local id i is d (pool size + 1) + i)}. Without kv_quant every leaf gets
        the PagePool's pages (every page reserved for the request, written or not). Under kv_quant
        the quantized leaves get them (only pages [0, n_quant) of the next position hold sealed
        data) and "k", "v" the full-precision pages the request holds, in logical order:
        `self.residual[d].pages(id)` maps them to logical pages."""
        d = self.shard_of[request_id]
        quant = np.asarray(self.pools[d].table(request_id), np.int32) + d * (self.scratch + 1)
        pools = self.cache.per_layer()
        if not self.residual:
            return {name: quant for name in pools}
        own = self.residual[d].pages(request_id)
        fp = np.asarray([own[i] for i in sorted(own)], np.int32) + d * (self.fp_scratch + 1)
        return {name: fp if name in ("k", "v") else quant for name in pools}

    def _leaf_pages(self, pages) -> dict:
        pools = self.cache.per_layer()
        if isinstance(pages, (list, np.ndarray)) and all(np.ndim(p) == 0 for p in pages):
            return {name: [int(p) for p in pages] for name in pools}
        return {name: [int(i) for i in pages[name]] for name in pools}

    def _page_fn(self, kind: str, shard: int, counts: dict):
        fns = self.__dict__.setdefault("_page_fns", {})
        pools = self.cache.per_layer()
        key = (kind, shard, tuple(sorted(counts.items())), tuple(pools))
        if key in fns:
            return fns[key]
        mesh = self.program.mesh
        specs = {name: a.sharding.spec for name, a in pools.items()}
        id_specs = {name: self.program.layout.compute_spec(ROW) for name in pools}
        if kind == "export":  # each shard gathers its ids; keep block `shard`, its page dimension whole
            local = lambda pools, ids: {name: jnp.take(a, ids[name], axis=1) for name, a in pools.items()}
            gather = per_shard(local, mesh, (specs, id_specs), specs)
            whole = {name: NamedSharding(mesh, _pages_unsplit(a.sharding.spec, a.ndim)) for name, a in pools.items()}
            fn = jax.jit(
                lambda pools, ids: {
                    name: a[:, shard * counts[name] : (shard + 1) * counts[name]]
                    for name, a in gather(pools, ids).items()
                },
                out_shardings=whole,
            )
        elif kind == "copy":  # each shard copies its pages `ids` to its pages `to` (the others: scratch to scratch)
            local = lambda pools, ids, to: {name: a.at[:, to[name]].set(a[:, ids[name]]) for name, a in pools.items()}
            fn = jax.jit(per_shard(local, mesh, (specs, id_specs, id_specs), specs), donate_argnums=0)
        else:  # import: each shard writes its block of x into its ids (the other shards: zeros to scratch)
            local = lambda pools, x, ids: {
                name: a.at[:, ids[name]].set(x[name].astype(a.dtype)) for name, a in pools.items()
            }
            fn = jax.jit(per_shard(local, mesh, (specs, specs, id_specs), specs), donate_argnums=0)
        fns[key] = fn
        return fn

    def _page_ids(self, shard: int, pages) -> tuple[dict, dict]:
        """Per leaf: ids [D n] (block `shard` = its pages, the other blocks that leaf's scratch page), and n."""
        pools = self.cache.per_layer()
        pages = self._leaf_pages(pages)
        ids = {}
        for name, a in pools.items():
            scratch = a.shape[1] // self.shards - 1
            out = np.full((self.shards, len(pages[name])), scratch, np.int32)
            out[shard] = pages[name]
            ids[name] = self.put(out.reshape(-1), ROW)
        return ids, {name: len(p) for name, p in pages.items()}

    def export_pages(self, shard: int, pages) -> dict:
        """Cache pages `pages` (local ids in batch shard `shard`'s pool) of every pool leaf: a dict
        like the pools of leaves [L, len(pages), ...] on this mesh (page dimension unsplit)."""
        ids, counts = self._page_ids(shard, pages)
        return self._page_fn("export", shard, counts)(self.cache.per_layer(), ids)

    def receive_pages(self, shard: int, block: dict) -> tuple:
        """Move `block` (an `export_pages` result, on any devices) onto the devices of batch shard
        `shard` of this mesh, each device receiving its share (its kv heads) once: one device_put
        per destination device, zeros made in place on the other shards' devices. Returns (the
        dict, leaves [L, D n, ...] sharded like the pools; the bytes moved between devices)."""
        moved = 0
        pools = self.cache.per_layer()

        def leaf(b, c):
            nonlocal moved
            n = b.shape[1]
            shape = (b.shape[0], self.shards * n, *b.shape[2:])
            sharding = NamedSharding(self.program.mesh, c.sharding.spec)
            pieces = []
            for dev, idx in sharding.devices_indices_map(shape).items():
                local = tuple(len(range(*s.indices(dim))) for s, dim in zip(idx, shape))
                if n and (idx[1].start or 0) // n == shard:
                    piece = jax.device_put(b[(idx[0], slice(None), *idx[2:])], dev)
                    moved += piece.nbytes
                else:
                    piece = jnp.zeros(local, c.dtype, device=dev)
                pieces.append(piece)
            return jax.make_array_from_single_device_arrays(shape, sharding, pieces)

        placed = {name: leaf(block[name], pools[name]) for name in pools}
        return placed, moved

    def copy_pages(self, shard: int, src: dict, dst: dict) -> None:
        """Copy pages within batch shard `shard`: per pool leaf, local ids src[leaf] to dst[leaf]."""
        ids, counts = self._page_ids(shard, src)
        to, _ = self._page_ids(shard, dst)
        self.cache = self.cache.with_layers(self._page_fn("copy", shard, counts)(self.cache.per_layer(), ids, to))

    def import_pages(self, shard: int, pages, placed: dict) -> None:
        """Write a `receive_pages` result into cache pages `pages` (local ids of batch shard `shard`)."""
        ids, counts = self._page_ids(shard, pages)
        self.cache = self.cache.with_layers(self._page_fn("import", shard, counts)(self.cache.per_layer(), placed, ids))


@dataclasses.dataclass
class _InFlight:
    """Overlap: a step on the device whose sampled tokens the host has not read."""

    plans: list  # per batch shard, the step's work
    slots: dict  # request id -> its token's index in `tokens`
    tokens: Any  # the sampled tokens [slots] on the device (None: the step sampled nothing)


@dataclasses.dataclass
class _Steady:
    """Steady decoding: the inputs of the next step of `requests` (a decode each, in the rows of the
    last step), on the device, advanced there after every step."""

    width: int
    requests: tuple  # the sequences, in plan order (held: their ids cannot be reused meanwhile)
    keys: tuple  # id() of each
    ids: list  # request ids per sampling slot (padded to the engine's slots)
    rows: np.ndarray  # host: each sequence's flat row
    positions_host: np.ndarray  # host: the position each sequence writes in the next step
    tokens: Any  # device [D width]: the next step's input tokens (this step's sampled ones)
    positions: Any  # device [D width]
    active: Any  # device [D width]: 1 on the sequences' rows
    sample: tuple  # device, per slot: (row, seed, count, temperature, top_k, top_p)
    greedy: bool


def _overlap(a: tuple, b: tuple, shape: tuple) -> int:
    """Elements two shards' index tuples (slices per dimension) have in common."""
    n = 1
    for sa, sb, dim in zip(a, b, shape):
        (a0, a1, _), (b0, b1, _) = sa.indices(dim), sb.indices(dim)
        n *= max(0, min(a1, b1) - max(a0, b0))
    return n


def reshard(params, shardings) -> tuple:
    """(`params` copied into `shardings`, bytes received): a resharding transfer from any devices
    and layout. A destination shard receives what the source's shard on its own device does not
    hold already: all of it from disjoint devices, the missing part when the devices coincide
    (jaxsys/analysis/rl.py has the formula)."""
    moved = 0

    def place(a, sharding):
        nonlocal moved
        out = jax.device_put(a, sharding, may_alias=False)
        held = {s.device: s.index for s in a.addressable_shards} if isinstance(a, jax.Array) else {}
        for shard in out.addressable_shards:
            have = held.get(shard.device)
            kept = 0 if have is None else _overlap(have, shard.index, a.shape)
            moved += shard.data.nbytes - kept * out.dtype.itemsize
        return out

    return jax.tree.map(place, params, shardings), moved


def _pages_unsplit(spec, ndim: int):
    """`spec` (of a pool leaf) with its page dimension (axis 1) not split."""
    from jax.sharding import PartitionSpec

    entries = list(spec) + [None] * (ndim - len(spec))
    entries[1] = None
    return PartitionSpec(*entries)


def generate(
    engine: EngineAPI, prompts: list, max_new_tokens: int, sampling: Sampling | None = None, on_token=None
) -> list[list[int]]:
    """Continue each prompt (a list of token ids) by `max_new_tokens` tokens on `engine` (the
    engine with these requests only; it must be idle). `on_token(i, tokens)` sees each prompt i's
    new tokens as they come (streaming). Returns the new tokens per prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not engine.idle:
        raise ValueError("generate runs on an idle engine (its requests would mix with the ones in flight)")
    sampling = sampling or Sampling()
    sampling.check()
    keys = [("generate", i) for i in range(len(prompts))]
    for key, prompt in zip(keys, prompts):
        engine.submit(key, list(prompt), max_new_tokens, dataclasses.replace(sampling))
    out: dict = {key: [] for key in keys}
    while not engine.idle:
        _, sampled = engine.step()
        for key, tokens in sampled.items():
            if key in out:
                new = tokens if isinstance(tokens, list) else [tokens]
                out[key] += new
                if on_token is not None:
                    on_token(key[1], new)
    return [out[key] for key in keys]
