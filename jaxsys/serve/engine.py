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

A quantized cache (`kv_quant` = int8 | kivi4 | kivi2, config.serve.kv_quant; docs/kv_quant.md) is
a dict of pools instead of (k, v): "k", "v" [L, D (Pf + 1), page_size, K, H] full-precision pages
(the pages being written and the residual window; Pf = serve/kv_quant.fp_pages, scratch Pf) and
"kq", "vq", "ks", "kz", "vs", "vz" [L, D (P + 1), ...] the quantized pages (models/kv_quant.py),
indexed by the PagePool's ids. Every leaf has its page dimension at axis 1, but the two pools
have their own page ids: `request_pages(request_id)` gives, for each leaf, a running request's
page indices along that axis.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxsys.kernels.paged_attention.quant import MODES as KV_QUANT_MODES
from jaxsys.models import transformer
from jaxsys.models.kv_quant import layer_shapes as kv_quant_shapes
from jaxsys.serve import decode
from jaxsys.serve.kv_quant import ResidualPages, fp_pages
from jaxsys.serve.scheduler import PagePool, Request, Scheduler

MIN_ROWS = 8

# per sequence: its own settings, and a key folded from its seed and its token index
_sample_rows = jax.jit(
    jax.vmap(
        lambda logits, seed, n, t, k, p: decode.sample(
            logits[None], jax.random.fold_in(jax.random.key(seed), n), t, k, p
        )[0]
    )
)

_sample_at = jax.jit(lambda logits, at, *settings: _sample_rows(logits[at], *settings))


def _pad(values: list, size: int | None = None) -> list:
    """`values` padded to a power of two (or `size`) by repeating the first: the jitted helpers
    compile once per padded size, not once per count."""
    size = size or 1 << (len(values) - 1).bit_length()
    return values + [values[0]] * (size - len(values))


@dataclasses.dataclass
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def pool_settings(sv) -> dict:
    """config.serve's pool and schedule settings (per batch shard) as every engine's constructor
    takes them: num_pages, page_size, token_budget, chunk_size, max_seqs, policy."""
    keys = ("page_size", "token_budget", "chunk_size", "max_seqs", "policy")
    return {"num_pages": sv.pages, **{key: sv[key] for key in keys}}


class Engine:
    @classmethod
    def from_config(cls, program, params, max_len: int | None = None) -> "Engine":
        """The engine `program.config.serve` describes."""
        sv = program.config.serve
        return cls(
            program, params, **pool_settings(sv), max_len=max_len, kv_quant=sv.kv_quant, kv_residual=sv.kv_residual
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
        kv_quant: str = "none",
        kv_residual: int = 0,
    ):
        """`num_pages`, `token_budget` and `max_seqs` are per batch shard (config.serve); `kv_quant`
        and `kv_residual` (full-precision pages before the open one) choose a quantized cache."""
        config = program.config
        decode.check_servable(config)
        layout = program.layout
        self.program, self.params = program, params
        self.shards = layout.size(layout.compute_axes("batch"))
        self.pools = [PagePool(num_pages, page_size) for _ in range(self.shards)]
        self.max_len = max_len or num_pages * page_size
        self.max_pages = math.ceil(self.max_len / page_size)
        self.schedulers = [
            Scheduler(pool, token_budget, chunk_size, max_seqs, policy, self.max_len) for pool in self.pools
        ]
        self.budget = token_budget
        self.sample_slots = self.shards * max_seqs  # sequences that can get a token in one step
        self.shard_of: dict = {}
        self.sampling: dict = {}
        m = config.model
        self.cache_pspec = layout.compute_spec(("layers", "batch", None, "kv_heads", None))
        self.rows_pspec = layout.compute_spec(("batch",))
        self.table_pspec = layout.compute_spec(("batch", None))
        shape = (m.n_layers, self.shards * (num_pages + 1), page_size, m.n_kv_heads, m.head_dim)
        sharding = NamedSharding(program.mesh, self.cache_pspec)
        zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(m.compute_dtype)), out_shardings=sharding)
        self.scratch = num_pages  # a shard's local id of its scratch page
        self.kv_quant, self.kv_residual = kv_quant, kv_residual
        if kv_quant == "none":
            self.cache = (zeros(), zeros())
        else:
            self._init_quant_cache(num_pages, page_size, token_budget, max_seqs)
        self._step = self._compile()
        self.steps = 0

    @property
    def idle(self) -> bool:
        return all(s.idle for s in self.schedulers)

    @property
    def finished(self) -> list[Request]:
        return [r for s in self.schedulers for r in s.finished]

    # -- the device step
    def _local(self, params, tokens, positions, table, k, v, **extra):
        kv = {"k": k, "v": v, "page_table": table, **extra}  # extra: spec_engine's sparse read table
        logits, kv = self._forward(params, tokens, positions, kv)
        return logits, kv["k"], kv["v"]

    def _local_quant(self, params, tokens, positions, table, fp_table, cache):
        """The step under kv_quant: `cache` the dict of pools, `fp_table` the rows' full-precision page ids."""
        kv = {**cache, "page_table": table, "fp_table": fp_table, "kv_quant": (self.kv_quant, self.kv_residual)}
        logits, kv = self._forward(params, tokens, positions, kv)
        return logits, {name: kv[name] for name in cache}

    def _forward(self, params, tokens, positions, kv):
        """One token per row through the model with the paged cache `kv`: (logits [rows, V], the updated kv)."""
        m, layout, specs = self.program.config.model, self.program.layout, self.program.specs
        x = transformer.embed(params, tokens[:, None], m, layout, specs)
        x, _, kv = transformer.layer_stack(params["layers"], x, positions[:, None], m, layout, specs, kv=kv)
        h = transformer.final_norm(params, x, m, layout, specs)
        logits = transformer.output_logits(params, h, m, layout, specs)[:, 0].astype(jnp.float32)
        axes = layout.compute_axes("vocab")
        logits = jax.lax.all_gather(logits, axes, axis=-1, tiled=True) if axes else logits
        return logits, kv

    def _compile(self):
        p = self.program
        rows, table = self.rows_pspec, self.table_pspec
        if self.kv_quant != "none":
            fn = jax.shard_map(
                self._local_quant,
                mesh=p.mesh,
                in_specs=(p.param_pspecs, rows, rows, table, table, self.cache_pspec),
                out_specs=(table, self.cache_pspec),
                check_vma=False,
            )
            return jax.jit(fn, donate_argnums=(5,))
        fn = jax.shard_map(
            self._local,
            mesh=p.mesh,
            in_specs=(p.param_pspecs, rows, rows, table, self.cache_pspec, self.cache_pspec),
            out_specs=(table, self.cache_pspec, self.cache_pspec),
            check_vma=False,
        )
        return jax.jit(fn, donate_argnums=(4, 5))

    def widths(self) -> list[int]:
        """The row buckets (per shard) a step compiles for: powers of two from 8 to the token budget."""
        top = max(self.budget, MIN_ROWS)
        out, w = [], MIN_ROWS
        while w < top:
            out.append(w)
            w *= 2
        return out + [top]

    def _sample(self, logits, sample_rows: dict, sampling: dict) -> dict:
        """{request id: token} for `sample_rows` {request id: (row of logits, request)}, in one call
        padded to `sample_slots` rows, so that it compiles once per row bucket (in `warmup`), not
        once per number of sequences."""
        ids = _pad(list(sample_rows), max(self.sample_slots, len(sample_rows)))
        settings = [sampling[rid] for rid in ids]
        tokens = _sample_at(
            logits,
            np.asarray([sample_rows[rid][0] for rid in ids], np.int32),
            np.asarray([s.seed for s in settings], np.int32),
            np.asarray([len(sample_rows[rid][1].generated) for rid in ids], np.int32),
            np.asarray([s.temperature for s in settings], np.float32),
            np.asarray([s.top_k for s in settings], np.int32),
            np.asarray([s.top_p for s in settings], np.float32),
        )
        return dict(zip(ids[: len(sample_rows)], np.asarray(tokens).tolist()))

    def _put(self, array, pspec):
        return jax.device_put(array, NamedSharding(self.program.mesh, pspec))

    def _run(self, tokens, positions, table, fp_table=None):
        """One device step on rows [D * width] (shard d's rows first-to-last in block d); under
        kv_quant `fp_table` holds the rows' full-precision page ids (None: all scratch)."""
        if self.kv_quant != "none":
            if fp_table is None:
                fp_table = np.full(np.shape(table), self.fp_scratch, np.int32)
            logits, self.cache = self._step(
                self.params,
                *(self._put(a, self.rows_pspec) for a in (tokens, positions)),
                *(self._put(a, self.table_pspec) for a in (table, fp_table)),
                self.cache,
            )
            return logits
        logits, k, v = self._step(
            self.params,
            self._put(tokens, self.rows_pspec),
            self._put(positions, self.rows_pspec),
            self._put(table, self.table_pspec),
            *self.cache,
        )
        self.cache = (k, v)
        return logits

    def warmup(self) -> None:
        """Compile every row bucket now (steps of padding rows only: they write the scratch page)."""
        for width in self.widths():
            rows = np.zeros(self.shards * width, np.int32)
            logits = self._run(rows, rows, np.full((self.shards * width, self.max_pages), self.scratch, np.int32))
            self._sample(logits, {0: (0, Request(0, [0], 1))}, {0: Sampling()})  # and its sampling
        jax.block_until_ready(self.cache)

    # -- requests
    def submit(self, request_id, prompt: list, max_new_tokens: int, sampling: Sampling | None = None) -> Request:
        """Queue a request on the batch shard with the least outstanding work; ValueError if it can
        never be served (too long for a shard's pool, tokens outside the vocabulary)."""
        request = Request(request_id, list(prompt), max_new_tokens)
        vocab = self.program.config.model.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"request {request_id!r}: token ids outside [0, {vocab})")
        load = lambda d: sum(
            len(r.prompt) + r.max_new_tokens for r in self.schedulers[d].waiting + self.schedulers[d].running
        )
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
        fp_table = None if self.kv_quant == "none" else np.full_like(table, self.fp_scratch)
        sample_rows = {}
        for d, work in enumerate(plans):
            r = 0
            for w in work:
                req = w.request
                pages = self.pools[d].table(req.id)[: self.max_pages]
                if fp_table is not None:  # kv_quant: the full-precision pages these rows write and read
                    self.residual[d].prepare(req.id, w.start, w.tokens)
                    fp_row = self.residual[d].table(req.id, self.max_pages, self.fp_scratch)
                for i in range(w.tokens):
                    pos = w.start + i
                    tokens[d, r] = req.prompt[pos] if w.kind == "prefill" else req.generated[-1]
                    positions[d, r] = pos
                    table[d, r, : len(pages)] = pages
                    if fp_table is not None:
                        fp_table[d, r] = fp_row
                    r += 1
                if w.kind == "decode" or w.start + w.tokens == len(req.prompt):
                    sample_rows[req.id] = (d * width + r - 1, req)
        logits = self._run(
            tokens.reshape(-1),
            positions.reshape(-1),
            table.reshape(-1, self.max_pages),
            None if fp_table is None else fp_table.reshape(-1, self.max_pages),
        )
        sampled = self._sample(logits, sample_rows, self.sampling) if sample_rows else {}
        for scheduler, work in zip(self.schedulers, plans):
            for req in scheduler.commit(work, sampled):
                self.sampling.pop(req.id, None)
                self.shard_of.pop(req.id, None)
        if fp_table is not None:  # kv_quant: give back the full-precision pages no later row reads
            for d, work in enumerate(plans):
                for w in work:
                    if w.request.done:
                        self.residual[d].free(w.request.id)
                    else:
                        self.residual[d].advance(w.request.id, w.request.cached)
        self.steps += 1
        return [w for work in plans for w in work], sampled

    def run(self, max_steps: int = 100_000) -> list[Request]:
        """Step until every submitted request has finished."""
        for _ in range(max_steps):
            if self.idle:
                break
            self.step()
        return self.finished

    # -- the quantized KV cache (kv_quant != "none"; docs/kv_quant.md)
    def _init_quant_cache(self, num_pages: int, page_size: int, token_budget: int, max_seqs: int) -> None:
        from jaxsys.config import KV_QUANT

        m = self.program.config.model
        if self.kv_quant not in KV_QUANT:
            raise ValueError(f"kv_quant={self.kv_quant!r}: choose one of {KV_QUANT}")
        if not isinstance(self.kv_residual, int) or self.kv_residual < 0:
            raise ValueError(f"kv_residual={self.kv_residual!r} must be an integer >= 0 (pages)")
        per_byte = 8 // KV_QUANT_MODES[self.kv_quant][0]
        if m.head_dim % per_byte:
            raise ValueError(
                f"kv_quant={self.kv_quant!r} packs {per_byte} codes per byte along the head dim: "
                f"head_dim={m.head_dim} must be a multiple of {per_byte}"
            )
        n_fp = fp_pages(max_seqs, token_budget, page_size, self.kv_residual)
        self.residual = [ResidualPages(n_fp, page_size, self.kv_residual) for _ in range(self.shards)]
        self.fp_scratch = n_fp  # a shard's local id of its full-precision scratch page
        shapes = kv_quant_shapes(
            self.kv_quant, self.shards * (num_pages + 1), self.shards * (n_fp + 1), page_size, m.n_kv_heads, m.head_dim
        )
        sharding = NamedSharding(self.program.mesh, self.cache_pspec)
        make = lambda shape, dtype: jax.jit(lambda: jnp.zeros((m.n_layers, *shape), dtype), out_shardings=sharding)()
        self.cache = {name: make(shape, dtype or jnp.dtype(m.compute_dtype)) for name, (shape, dtype) in shapes.items()}

    def request_pages(self, request_id):
        """A running request's pages: a pytree like `self.cache` whose leaves are int32 arrays of
        indices along that leaf's page dimension (axis 1, global: shard d's local id i is
        d (pool size + 1) + i). Without kv_quant both leaves get the PagePool's pages (every page
        reserved for the request, written or not). Under kv_quant the quantized leaves get them
        (only pages [0, n_quant) of the next position hold sealed data) and "k", "v" the
        full-precision pages the request holds, in logical order: `self.residual[d].pages(id)`
        maps them to logical pages."""
        d = self.shard_of[request_id]
        quant = np.asarray(self.pools[d].table(request_id), np.int32) + d * (self.scratch + 1)
        if self.kv_quant == "none":
            return (quant, quant)
        own = self.residual[d].pages(request_id)
        fp = np.asarray([own[i] for i in sorted(own)], np.int32) + d * (self.fp_scratch + 1)
        return {name: fp if name in ("k", "v") else quant for name in self.cache}

    # -- a sequence's pages out of one engine and into another (disaggregated serving, serve/disagg.py).
    # Generic over the cache pytree: every leaf is [L, D B, ...], its page dimension at axis 1 in D
    # blocks of B pages split over the batch axes (one block per batch shard, its last page scratch).
    # `pages`: one list of local page ids for every leaf, or a pytree like the cache of such lists
    # (leaves with their own page ids, as a quantized cache's two pools).
    def _leaf_pages(self, pages):
        if isinstance(pages, (list, np.ndarray)) and all(np.ndim(p) == 0 for p in pages):
            return jax.tree.map(lambda _: [int(p) for p in pages], self.cache)
        return jax.tree.map(
            lambda _, p: [int(i) for i in p], self.cache, pages, is_leaf=lambda x: isinstance(x, (list, np.ndarray))
        )

    def _page_fn(self, kind: str, shard: int, counts):
        fns = self.__dict__.setdefault("_page_fns", {})
        key = (kind, shard, tuple(jax.tree.leaves(counts)), jax.tree.structure(self.cache))
        if key in fns:
            return fns[key]
        mesh = self.program.mesh
        specs = jax.tree.map(lambda a: a.sharding.spec, self.cache)
        id_specs = jax.tree.map(lambda _: self.rows_pspec, self.cache)
        if kind == "export":  # each shard gathers its ids; keep block `shard`, its page dimension whole
            local = lambda cache, ids: jax.tree.map(lambda a, i: jnp.take(a, i, axis=1), cache, ids)
            gather = jax.shard_map(local, mesh=mesh, in_specs=(specs, id_specs), out_specs=specs, check_vma=False)
            whole = jax.tree.map(lambda a: NamedSharding(mesh, _pages_unsplit(a.sharding.spec, a.ndim)), self.cache)
            fn = jax.jit(
                lambda cache, ids: jax.tree.map(
                    lambda a, n: a[:, shard * n : (shard + 1) * n], gather(cache, ids), counts
                ),
                out_shardings=whole,
            )
        else:  # import: each shard writes its block of x into its ids (the other shards: zeros to scratch)
            local = lambda cache, x, ids: jax.tree.map(lambda a, b, i: a.at[:, i].set(b.astype(a.dtype)), cache, x, ids)
            fn = jax.jit(
                jax.shard_map(local, mesh=mesh, in_specs=(specs, specs, id_specs), out_specs=specs, check_vma=False),
                donate_argnums=0,
            )
        fns[key] = fn
        return fn

    def _page_ids(self, shard: int, pages):
        """Per leaf: ids [D n] (block `shard` = its pages, the other blocks that leaf's scratch page), and n."""

        def ids(a, p):
            scratch = a.shape[1] // self.shards - 1
            out = np.full((self.shards, len(p)), scratch, np.int32)
            out[shard] = p
            return self._put(out.reshape(-1), self.rows_pspec)

        pages = self._leaf_pages(pages)
        counts = jax.tree.map(lambda _, p: len(p), self.cache, pages, is_leaf=lambda x: isinstance(x, list))
        return jax.tree.map(ids, self.cache, pages, is_leaf=lambda x: isinstance(x, list)), counts

    def export_pages(self, shard: int, pages):
        """Cache pages `pages` (local ids in batch shard `shard`'s pool) of every cache leaf: a
        pytree like the cache with leaves [L, len(pages), ...] on this mesh (page dimension unsplit)."""
        ids, counts = self._page_ids(shard, pages)
        return self._page_fn("export", shard, counts)(self.cache, ids)

    def receive_pages(self, shard: int, block) -> tuple:
        """Move `block` (an `export_pages` result, on any devices) onto the devices of batch shard
        `shard` of this mesh, each device receiving its share (its kv heads) once: one device_put
        per destination device, zeros made in place on the other shards' devices. Returns (the
        pytree, leaves [L, D n, ...] sharded like the cache; the bytes moved between devices)."""
        moved = 0

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

        placed = jax.tree.map(leaf, block, self.cache)
        return placed, moved

    def import_pages(self, shard: int, pages, placed) -> None:
        """Write a `receive_pages` result into cache pages `pages` (local ids of batch shard `shard`)."""
        ids, counts = self._page_ids(shard, pages)
        self.cache = self._page_fn("import", shard, counts)(self.cache, placed, ids)


def _pages_unsplit(spec, ndim: int):
    """`spec` (of a cache leaf) with its page dimension (axis 1) not split."""
    from jax.sharding import PartitionSpec

    entries = list(spec) + [None] * (ndim - len(spec))
    entries[1] = None
    return PartitionSpec(*entries)
