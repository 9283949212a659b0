"""The serving engine: continuous batching with chunked prefill over a paged KV cache.

Each step the scheduler (scheduler.py, plain Python) packs decode tokens of running sequences and
prefill chunks of new ones up to a token budget; the device step is one compiled function per
row bucket (a power of two >= 8, at most the budget). A step's tokens are rows: row r is one
token of some sequence at position p_r with that sequence's page table, so decodes and prefill
chunks of any lengths share one program (`transformer._paged_attention`: every row's key and
value are written to its slot, then each row attends to its sequence's slots up to p_r). Padding
rows write to a scratch page no sequence owns.

The page pool [L, P + 1, page_size, K, H] (the + 1: the scratch page) is split over `tensor` by kv
heads; the engine runs on tensor parallelism with one batch shard (a pool split over `data` would
need one scheduler per shard: not done).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxsys.config import ConfigError
from jaxsys.models import transformer
from jaxsys.serve import decode
from jaxsys.serve.scheduler import PagePool, Request, Scheduler

MIN_ROWS = 8


@dataclasses.dataclass
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


class Engine:
    def __init__(self, program, params, num_pages: int, page_size: int, token_budget: int, chunk_size: int,
                 max_seqs: int, policy: str = "chunked", max_len: int | None = None):
        config = program.config
        decode.check_servable(config)
        layout = program.layout
        if layout.size(layout.compute_axes("batch")) > 1:
            raise ConfigError("the paged engine runs with one batch shard (config.mesh.data = fsdp = expert = 1) "
                              "and tensor parallelism; use jaxsys.serve.decode for data-parallel generation")
        self.program, self.params = program, params
        self.pool = PagePool(num_pages, page_size)
        self.max_len = max_len or num_pages * page_size
        self.max_pages = math.ceil(self.max_len / page_size)
        self.scheduler = Scheduler(self.pool, token_budget, chunk_size, max_seqs, policy, self.max_len)
        self.sampling: dict = {}
        m = config.model
        self.cache_pspec = layout.compute_spec(("layers", None, None, "kv_heads", None))
        shape = (m.n_layers, num_pages + 1, page_size, m.n_kv_heads, m.head_dim)
        sharding = NamedSharding(program.mesh, self.cache_pspec)
        zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(m.compute_dtype)), out_shardings=sharding)
        self.cache = (zeros(), zeros())
        self.scratch = num_pages
        self._step = self._compile()
        self.steps = 0

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
        rows = jax.sharding.PartitionSpec()
        fn = jax.shard_map(self._local, mesh=p.mesh,
                           in_specs=(p.param_pspecs, rows, rows, rows, self.cache_pspec, self.cache_pspec),
                           out_specs=(rows, self.cache_pspec, self.cache_pspec), check_vma=False)
        return jax.jit(fn, donate_argnums=(4, 5))

    def widths(self) -> list[int]:
        """The row buckets a step compiles for: powers of two from 8 to the token budget."""
        top = max(self.scheduler.budget, MIN_ROWS)
        out, w = [], MIN_ROWS
        while w < top:
            out.append(w)
            w *= 2
        return out + [top]

    def warmup(self) -> None:
        """Compile every row bucket now (steps of padding rows only: they write the scratch page)."""
        for width in self.widths():
            rows = np.zeros(width, np.int32)
            table = np.full((width, self.max_pages), self.scratch, np.int32)
            _, k, v = self._step(self.params, rows, rows, table, *self.cache)
            self.cache = (k, v)
        jax.block_until_ready(self.cache)

    # -- requests
    def submit(self, request_id, prompt: list, max_new_tokens: int, sampling: Sampling | None = None) -> Request:
        request = Request(request_id, list(prompt), max_new_tokens)
        if any(not 0 <= t < self.program.config.model.vocab_size for t in prompt):
            raise ValueError(f"request {request_id!r}: token ids outside [0, {self.program.config.model.vocab_size})")
        self.scheduler.add(request)  # raises ValueError for a request that can never fit
        self.sampling[request_id] = sampling or Sampling()
        return request

    def step(self) -> tuple[list, dict]:
        """Run one scheduled step. Returns (the work done, {request id: token sampled this step})."""
        work = self.scheduler.plan()
        if not work:
            return [], {}
        n = sum(w.tokens for w in work)
        width = next(w for w in self.widths() if w >= n)
        tokens = np.zeros(width, np.int32)
        positions = np.zeros(width, np.int32)
        table = np.full((width, self.max_pages), self.scratch, np.int32)
        sample_rows = {}
        r = 0
        for w in work:
            req = w.request
            pages = self.pool.table(req.id)[:self.max_pages]
            for i in range(w.tokens):
                pos = w.start + i
                tokens[r] = req.prompt[pos] if w.kind == "prefill" else req.generated[-1]
                positions[r] = pos
                table[r, :len(pages)] = pages
                r += 1
            if w.kind == "decode" or w.start + w.tokens == len(req.prompt):
                sample_rows[req.id] = (r - 1, req)
        logits, k, v = self._step(self.params, tokens, positions, table, *self.cache)
        self.cache = (k, v)
        sampled = {}
        for rid, (row, req) in sample_rows.items():
            s = self.sampling[rid]
            key = jax.random.fold_in(jax.random.key(s.seed), len(req.generated))
            token = decode._sample(logits[row:row + 1], key, jnp.float32(s.temperature), jnp.int32(s.top_k),
                                   jnp.float32(s.top_p))
            sampled[rid] = int(token[0])
        for req in self.scheduler.commit(work, sampled):
            self.sampling.pop(req.id, None)
        self.steps += 1
        return work, sampled

    def run(self, max_steps: int = 100_000) -> list[Request]:
        """Step until every submitted request has finished."""
        for _ in range(max_steps):
            if self.scheduler.idle:
                break
            self.step()
        return self.scheduler.finished
