"""The serving engine: continuous batching with chunked prefill over a paged KV cache.

Each step the scheduler (scheduler.py, plain Python) packs decode tokens of running sequences and
prefill chunks of new ones up to a token budget; the device step is one compiled function per
row bucket (a power of two >= 8, at most the budget). A step's tokens are rows: row r is one
token of some sequence at position p_r with that sequence's page table, so decodes and prefill
chunks of any lengths share one program (`transformer._paged_attention`: every row's key and
value are written to its slot, then each row attends to its sequence's slots up to p_r). Padding
rows write to a scratch page no sequence owns.

The cache is split like the model's activations: over `tensor` by kv heads, and over the batch
axes (data, fsdp, expert) by sequences. Each of the D batch shards has its own page pool of P
pages (+ 1 scratch page) and its own scheduler with its own token budget; a request goes to the
shard with the least outstanding work, and a step's rows are [D, width], shard d's rows reading
only shard d's pages (page ids are local to a shard). So the device pool is
[L, D (P + 1), page_size, K, H], split D ways on its page dimension and t ways on K.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxsys.models import transformer
from jaxsys.serve import decode
from jaxsys.serve.scheduler import PagePool, Request, Scheduler

MIN_ROWS = 8

# per sequence: its own settings, and a key folded from its seed and its token index
_sample_rows = jax.jit(jax.vmap(lambda logits, seed, n, t, k, p: decode.sample(
    logits[None], jax.random.fold_in(jax.random.key(seed), n), t, k, p)[0]))


@dataclasses.dataclass
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


class Engine:
    @classmethod
    def from_config(cls, program, params, max_len: int | None = None) -> "Engine":
        """The engine `program.config.serve` describes."""
        sv = program.config.serve
        return cls(program, params, sv.pages, sv.page_size, sv.token_budget, sv.chunk_size, sv.max_seqs,
                   sv.policy, max_len)

    def __init__(self, program, params, num_pages: int, page_size: int, token_budget: int, chunk_size: int,
                 max_seqs: int, policy: str = "chunked", max_len: int | None = None):
        """`num_pages`, `token_budget` and `max_seqs` are per batch shard (config.serve)."""
        config = program.config
        decode.check_servable(config)
        layout = program.layout
        self.program, self.params = program, params
        self.shards = layout.size(layout.compute_axes("batch"))
        self.pools = [PagePool(num_pages, page_size) for _ in range(self.shards)]
        self.max_len = max_len or num_pages * page_size
        self.max_pages = math.ceil(self.max_len / page_size)
        self.schedulers = [Scheduler(pool, token_budget, chunk_size, max_seqs, policy, self.max_len)
                           for pool in self.pools]
        self.budget = token_budget
        self.shard_of: dict = {}
        self.sampling: dict = {}
        m = config.model
        self.cache_pspec = layout.compute_spec(("layers", "batch", None, "kv_heads", None))
        self.rows_pspec = layout.compute_spec(("batch",))
        self.table_pspec = layout.compute_spec(("batch", None))
        shape = (m.n_layers, self.shards * (num_pages + 1), page_size, m.n_kv_heads, m.head_dim)
        sharding = NamedSharding(program.mesh, self.cache_pspec)
        zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(m.compute_dtype)), out_shardings=sharding)
        self.cache = (zeros(), zeros())
        self.scratch = num_pages  # a shard's local id of its scratch page
        self._step = self._compile()
        self.steps = 0

    @property
    def idle(self) -> bool:
        return all(s.idle for s in self.schedulers)

    @property
    def finished(self) -> list[Request]:
        return [r for s in self.schedulers for r in s.finished]

    # -- the device step
    def _local(self, params, tokens, positions, table, k, v):
        m, layout, specs = self.program.config.model, self.program.layout, self.program.specs
        x = transformer.embed(params, tokens[:, None], m, layout, specs)
        kv = {"k": k, "v": v, "page_table": table}
        x, _, kv = transformer.layer_stack(params["layers"], x, positions[:, None], m, layout, specs, kv=kv)
        h = transformer.final_norm(params, x, m, layout, specs)
        logits = transformer.output_logits(params, h, m, layout, specs)[:, 0].astype(jnp.float32)
        axes = layout.compute_axes("vocab")
        logits = jax.lax.all_gather(logits, axes, axis=-1, tiled=True) if axes else logits
        return logits, kv["k"], kv["v"]

    def _compile(self):
        p = self.program
        rows, table = self.rows_pspec, self.table_pspec
        fn = jax.shard_map(self._local, mesh=p.mesh,
                           in_specs=(p.param_pspecs, rows, rows, table, self.cache_pspec, self.cache_pspec),
                           out_specs=(table, self.cache_pspec, self.cache_pspec), check_vma=False)
        return jax.jit(fn, donate_argnums=(4, 5))

    def widths(self) -> list[int]:
        """The row buckets (per shard) a step compiles for: powers of two from 8 to the token budget."""
        top = max(self.budget, MIN_ROWS)
        out, w = [], MIN_ROWS
        while w < top:
            out.append(w)
            w *= 2
        return out + [top]

    def _put(self, array, pspec):
        return jax.device_put(array, NamedSharding(self.program.mesh, pspec))

    def _run(self, tokens, positions, table):
        """One device step on rows [D * width] (shard d's rows first-to-last in block d)."""
        logits, k, v = self._step(self.params, self._put(tokens, self.rows_pspec),
                                  self._put(positions, self.rows_pspec), self._put(table, self.table_pspec),
                                  *self.cache)
        self.cache = (k, v)
        return logits

    def warmup(self) -> None:
        """Compile every row bucket now (steps of padding rows only: they write the scratch page)."""
        for width in self.widths():
            rows = np.zeros(self.shards * width, np.int32)
            self._run(rows, rows, np.full((self.shards * width, self.max_pages), self.scratch, np.int32))
        jax.block_until_ready(self.cache)

    # -- requests
    def submit(self, request_id, prompt: list, max_new_tokens: int, sampling: Sampling | None = None) -> Request:
        """Queue a request on the batch shard with the least outstanding work; ValueError if it can
        never be served (too long for a shard's pool, tokens outside the vocabulary)."""
        request = Request(request_id, list(prompt), max_new_tokens)
        vocab = self.program.config.model.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"request {request_id!r}: token ids outside [0, {vocab})")
        load = lambda d: sum(len(r.prompt) + r.max_new_tokens
                             for r in self.schedulers[d].waiting + self.schedulers[d].running)
        shard = min(range(self.shards), key=load)
        self.schedulers[shard].add(request)  # raises ValueError for a request that can never fit
        self.shard_of[request_id] = shard
        self.sampling[request_id] = sampling or Sampling()
        return request

    def step(self) -> tuple[list, dict]:
        """Run one scheduled step on every shard. Returns (the work done, {request id: token
        sampled this step})."""
        plans = [s.plan() for s in self.schedulers]
        n = max(sum(w.tokens for w in work) for work in plans)
        if n == 0:
            return [], {}
        width = next(w for w in self.widths() if w >= n)
        tokens = np.zeros((self.shards, width), np.int32)
        positions = np.zeros((self.shards, width), np.int32)
        table = np.full((self.shards, width, self.max_pages), self.scratch, np.int32)
        sample_rows = {}
        for d, work in enumerate(plans):
            r = 0
            for w in work:
                req = w.request
                pages = self.pools[d].table(req.id)[:self.max_pages]
                for i in range(w.tokens):
                    pos = w.start + i
                    tokens[d, r] = req.prompt[pos] if w.kind == "prefill" else req.generated[-1]
                    positions[d, r] = pos
                    table[d, r, :len(pages)] = pages
                    r += 1
                if w.kind == "decode" or w.start + w.tokens == len(req.prompt):
                    sample_rows[req.id] = (d * width + r - 1, req)
        logits = self._run(tokens.reshape(-1), positions.reshape(-1), table.reshape(-1, self.max_pages))
        sampled = {}
        if sample_rows:  # one call for every sequence that gets a token this step
            ids = list(sample_rows)
            settings = [self.sampling[rid] for rid in ids]
            tokens = _sample_rows(logits[np.asarray([sample_rows[rid][0] for rid in ids])],
                                  np.asarray([s.seed for s in settings], np.int32),
                                  np.asarray([len(sample_rows[rid][1].generated) for rid in ids], np.int32),
                                  np.asarray([s.temperature for s in settings], np.float32),
                                  np.asarray([s.top_k for s in settings], np.int32),
                                  np.asarray([s.top_p for s in settings], np.float32))
            sampled = dict(zip(ids, np.asarray(tokens).tolist()))
        for scheduler, work in zip(self.schedulers, plans):
            for req in scheduler.commit(work, sampled):
                self.sampling.pop(req.id, None)
                self.shard_of.pop(req.id, None)
        self.steps += 1
        return [w for work in plans for w in work], sampled

    def run(self, max_steps: int = 100_000) -> list[Request]:
        """Step until every submitted request has finished."""
        for _ in range(max_steps):
            if self.idle:
                break
            self.step()
        return self.finished
