"""The loader: a corpus's global batches for (seed, step), built ahead of the step by Grain, with
an iterator state that the checkpoint saves.

    loader = Loader(corpus, program.batch_sharding, config.seed, B, T, steps, prefetch=2)
    loader.restore(saved_state)        # or nothing: from step 0
    batch = next(loader)               # the global batch of the next step
    loader.state()                     # {"next_index": steps consumed, ...}: what a checkpoint saves

Batches are a pure function of (seed, step, split) and the corpus (`data.global_batch`): the
index sampler is stateless. For a token stream it is `data.sample_offsets` (uniform offsets drawn
from a Philox key of (seed, step)); for a corpus of documents (`DocumentCorpus`) it is a Grain
`MapDataset` over the rows of the corpus's plan, shuffled with the seed and reshuffled every epoch
(`MapDataset.range(R).shuffle(seed).repeat()`): element `step * B + b` is row b of step `step`'s
global batch. Each process reads and assembles only the rows its devices hold
(`addressable_devices_indices_map`), so the global batch does not depend on the process count.

Grain drives the steps: `MapDataset.range(steps).map(global batch of step)` read through an
`IterDataset` whose prefetch thread builds the next `prefetch` batches (host reads, assembly and
the transfer to the devices) while the step runs. Its state is the number of steps consumed
(`{"next_index": n}`); because the sampler is stateless, that number alone makes a resumed run
see exactly the batches it would have seen (bitwise losses), and it means the same thing for any
process count, so a checkpoint saved by N processes resumes exactly on M.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxsys import data as data_lib
from jaxsys.config import adaptive_buckets
from jaxsys.data import DataError, bytescale, packing


@dataclasses.dataclass
class Split:
    """One split of a corpus of documents: its pieces and their rows; with adaptive CP's layout
    buckets (config.data.adaptive_cp_buckets), also its batches: batch i is rows batches[i], laid
    out with local regions of `locals_[bucket[i]]` tokens a device (`bytescale.plan_batches`)."""

    pieces: packing.Pieces
    plan: packing.Plan
    batches: np.ndarray | None = None  # [NB, B] row ids
    bucket: np.ndarray | None = None  # [NB] index into config.data.adaptive_cp_buckets

    @property
    def num_rows(self) -> int:
        return self.plan.num_rows

    def padding(self, seq_len: int) -> float:
        """The fraction of the rows' T + 1 tokens that are padding."""
        if not self.num_rows:
            return 0.0
        return 1.0 - float(packing.row_fill(self.plan, self.pieces).sum()) / (self.num_rows * (seq_len + 1))


@dataclasses.dataclass
class DocumentCorpus:
    """A tokenized corpus of documents (`shards.Store`), its train and eval splits cut into rows of
    T + 1 tokens (`packing`); batches are `data.Batch`es. The last `eval_fraction` of the documents
    (at least one when the fraction is > 0) are held out."""

    store: Any  # shards.Store
    splits: dict[str, Split]
    seq_len: int
    packed: bool
    vocab_needed: int
    description: str
    pairs: bool = False  # preference pairs: rows 2i and 2i + 1 (chosen, rejected) stay together
    _orders: dict = dataclasses.field(default_factory=dict, repr=False)  # seed -> Grain index sampler

    @property
    def has_eval(self) -> bool:
        return "eval" in self.splits and self.splits["eval"].num_rows > 0

    def split(self, name: str) -> Split:
        if name not in ("train", "eval"):
            raise DataError(f"unknown split {name!r}; valid splits are ['eval', 'train']")
        if name not in self.splits or not self.splits[name].num_rows:
            raise DataError(
                "the eval split is empty because config.data.eval_fraction is 0; "
                "set config.data.eval_fraction > 0 to evaluate"
            )
        return self.splits[name]

    def _order(self, seed: int):
        if seed not in self._orders:
            import grain

            train = self.splits["train"]
            if train.batches is not None:  # layout buckets: whole batches are shuffled
                units = train.batches.shape[0]
            else:
                units = train.num_rows // (2 if self.pairs else 1)  # pairs are shuffled whole
            self._orders[seed] = grain.MapDataset.range(units).shuffle(seed=seed).repeat(None)
        return self._orders[seed]

    def bucket(self, seed: int, step: int) -> int:
        """The layout bucket of step `step`'s train batch (config.data.adaptive_cp_buckets: which
        compiled program runs it); 0 without buckets."""
        train = self.splits["train"]
        if train.bucket is None:
            return 0
        return int(train.bucket[int(self._order(int(seed))[step])])

    def row_ids(self, seed: int, step: int, batch_size: int, split: str, rows) -> list[int]:
        """The plan rows of rows `rows` of step `step`'s global batch: train rows in a Grain shuffle
        of the seed (reshuffled every epoch; preference pairs shuffled as pairs, the batch size
        even), eval rows in order (wrapping)."""
        n = self.split(split).num_rows
        first = step * batch_size
        if split == "eval":
            return [(first + r) % n for r in rows]
        order = self._order(int(seed))
        batches = self.split(split).batches
        if batches is not None:  # step `step` is one planned batch, whole
            if batch_size != batches.shape[1]:
                raise DataError(
                    f"the corpus was planned in batches of {batches.shape[1]} rows "
                    f"(config.data.adaptive_cp_buckets), not {batch_size}"
                )
            return [int(batches[int(order[step]), r]) for r in rows]
        if self.pairs:  # element step * B / 2 + j is pair j of the step: rows 2j (chosen), 2j + 1 (rejected)
            return [2 * int(order[(first + r) // 2]) + (first + r) % 2 for r in rows]
        return [int(order[first + r]) for r in rows]

    def rows(self, seed: int, step: int, batch_size: int, split: str, rows):
        """(tokens, segments, weights) numpy arrays of rows `rows` of the global batch."""
        s = self.split(split)
        ids = self.row_ids(seed, step, batch_size, split, rows)
        members = [s.plan.row(r) for r in ids]
        starts = None if s.plan.starts is None else [s.plan.row_starts(r) for r in ids]
        return packing.assemble(members, s.pieces, self.store.document, self.seq_len, starts)

    def global_batch(self, sharding, seed: int, step: int, batch_size: int, seq_len: int, split: str = "train"):
        """The `data.Batch` of (seed, step, split) with `sharding` on each array; each process
        reads and assembles only the rows of its devices."""
        if seq_len != self.seq_len:
            raise DataError(f"the corpus was cut into rows of {self.seq_len + 1} tokens, not {seq_len + 1}")
        if not 0 <= step < 2**62:
            raise DataError(f"step must be in [0, 2**62), got {step}")
        shape = (batch_size, seq_len + 1)
        indices = sharding.addressable_devices_indices_map(shape).values()
        local = sorted({r for index in indices for r in range(*index[0].indices(batch_size))})
        where = {r: i for i, r in enumerate(local)}
        arrays = self.rows(seed, step, batch_size, split, local)

        def make(array: np.ndarray) -> jax.Array:
            def cb(index):
                sel = [where[r] for r in range(*index[0].indices(batch_size))]
                return array[sel][(slice(None),) + tuple(index[1:])]

            return jax.make_array_from_callback((batch_size,) + array.shape[1:], sharding, cb)

        return data_lib.Batch(*(make(a) for a in arrays))


def load_corpus(data_cfg, encode=None, splits=("train", "eval"), chunks=None, batch=None):
    """The corpus of `data_cfg`: a corpus of documents (`load_documents`), or a token stream
    (`data.load_corpus`, with its `encode` and `splits`). `chunks` (`context.chunk_table`, with
    config.data.adaptive_cp): lay packed rows out for length-adaptive context parallelism; `batch`
    (B rows, D data shards): with config.data.adaptive_cp_buckets, the batches to plan."""
    if data_lib.is_documents(data_cfg):
        return load_documents(data_cfg, chunks=chunks, batch=batch)
    return data_lib.load_corpus(data_cfg, encode, splits)


def load_documents(data_cfg, progress: bool | None = None, chunks=None, batch=None) -> DocumentCorpus:
    """The corpus of documents of `data_cfg`, tokenized (`shards.load`: built first when missing
    and this is the only process) and cut into the rows of its splits."""
    from jaxsys.data import shards

    lead = jax.process_index() == 0
    store = shards.load(
        data_cfg,
        build_missing=jax.process_count() == 1,
        progress=lead if progress is None else progress,
        log=print if lead else (lambda *_: None),
    )
    return split_documents(store, data_cfg, chunks, batch)


def split_documents(store, data_cfg, chunks=None, batch=None) -> DocumentCorpus:
    """The splits' pieces and rows: one piece a row, best-fit packed rows, or (packing with
    `chunks` given) rows laid out by `bytescale.plan` for length-adaptive context parallelism;
    with config.data.adaptive_cp_buckets the train split in whole batches of `batch` = (B, D),
    each laid out for one bucket (`bytescale.plan_batches`)."""
    seq_len, fraction = int(data_cfg.seq_len), float(data_cfg.eval_fraction)
    n = store.num_docs
    n_eval = max(1, int(n * fraction)) if fraction > 0 else 0
    if n - n_eval < 1:
        raise DataError(
            f"the corpus ({store.directory}) has {n} documents: too few to hold out "
            f"config.data.eval_fraction={fraction} and train on the rest"
        )
    pairs = bool(store.manifest.get("pairs"))
    if pairs:  # hold out whole pairs: documents 2i and 2i + 1 are a record's chosen and rejected
        n_eval = 2 * (max(1, int(n // 2 * fraction)) if fraction > 0 else 0)
        if n - n_eval < 2:
            raise DataError(
                f"the corpus ({store.directory}) has {n // 2} preference pairs: too few to hold out "
                f"config.data.eval_fraction={fraction} and train on the rest"
            )
    chat = data_cfg.format in ("chat", "preference")
    local, groups, cut_at = 0, (), seq_len  # adaptive CP's tiers: pieces then fit the full ring region
    buckets: tuple[int, ...] = ()
    if data_cfg.packing and chunks is not None:
        from jaxsys.parallel import context

        shape = np.asarray(chunks).shape
        shares = context.parse_groups(str(data_cfg.get("adaptive_cp_groups", "")))
        sizes = lambda f: context.region_sizes(seq_len, shape[0], shape[1] == 2, f, shares)
        tiers = sizes(float(data_cfg.get("adaptive_cp_local", 0.0)))
        local, groups = tiers[0], tuple((g, n) for (g, _), n in zip(shares, tiers[1:-1]))
        buckets = tuple(sizes(f)[0] for f in adaptive_buckets(data_cfg))
        if buckets and batch is None:
            raise ValueError("config.data.adaptive_cp_buckets plans whole batches: pass batch=(B, D)")
        cut_at = shape[0] * tiers[-1]  # (with buckets each bucket cuts at its own, `plan_batches`)
    splits = {}
    for name, docs in (("train", np.arange(n - n_eval)), ("eval", np.arange(n - n_eval, n))):
        if name == "eval" and not n_eval:
            continue
        pieces = packing.pieces(store.doc_len[docs], cut_at, split_long=not chat, docs=docs)
        if pairs and len(pieces) != docs.shape[0]:  # encode_preference refuses shorter documents
            raise DataError(f"the {name} split of {store.directory} has a preference document of fewer than 2 tokens")
        if not len(pieces):
            raise DataError(
                f"the {name} split of the corpus ({store.directory}) has no document of 2 tokens or more: "
                "nothing to predict"
            )
        batches = bucket = None
        if data_cfg.packing and chunks is not None and buckets and name == "train":
            planned = bytescale.plan_batches(
                store.doc_len[docs], seq_len, chunks, buckets, *batch, groups=groups, split_long=not chat, docs=docs
            )
            pieces, plan = planned.pieces, planned.placement.to_plan()
            batches, bucket = planned.batches, planned.bucket
        elif data_cfg.packing and chunks is not None:  # eval: the adaptive_cp_local layout
            plan = bytescale.plan(pieces.length, seq_len, chunks, local=local, groups=groups).to_plan()
        elif data_cfg.packing:
            plan = packing.packed_plan(pieces.length, seq_len + 1)
        else:
            plan = packing.padded_plan(len(pieces))
        splits[name] = Split(pieces, plan, batches, bucket)
    m = store.manifest
    train = splits["train"]
    cut = f", {_cut_pairs(store, seq_len)} pairs with a completion cut away at T + 1 tokens" if pairs else ""
    desc = (
        f"{data_cfg.source} {data_cfg.format} documents ({m['docs']} docs{cut}, {m['tokens']} tokens, "
        f"{data_cfg.tokenizer} tokenizer, train {n - n_eval} / eval {n_eval}) "
        f"{('packed for adaptive CP' if chunks is not None else 'packed') if data_cfg.packing else 'one a row'}: {train.num_rows} train rows of {seq_len + 1}, "
        f"{train.padding(seq_len):.1%} padding; shards in {store.directory}"
    )
    if train.bucket is not None:  # how many batches each layout runs
        counts = np.bincount(train.bucket, minlength=len(buckets))
        mix = ", ".join(f"local {f:g}: {int(k)}" for f, k in zip(adaptive_buckets(data_cfg), counts))
        desc += f"; {train.bucket.shape[0]} batches of {train.batches.shape[1]} by layout ({mix})"
    return DocumentCorpus(store, splits, seq_len, bool(data_cfg.packing), int(m["vocab_needed"]), desc, pairs)


def _cut_pairs(store, seq_len: int) -> int:
    """How many preference pairs have a completion without a token in its row's T + 1 (a prompt of
    T + 1 tokens or more): such a pair's log-probabilities are 0 and it teaches nothing."""
    cut = 0
    for pair in range(store.num_docs // 2):
        for doc in (2 * pair, 2 * pair + 1):
            _, mask = store.document(doc)
            if mask is not None and not mask[1 : seq_len + 1].any():
                cut += 1
                break
    return cut


# ----------------------------------------------------------------------------- the Grain loader


class Loader:
    """Global train batches of steps 0 .. steps - 1 in order, `prefetch` of them built ahead on a
    Grain thread. `state()` / `restore(state)`: the position, saved with each checkpoint."""

    def __init__(self, corpus, sharding, seed: int, batch_size: int, seq_len: int, steps: int, prefetch: int = 2):
        import grain

        self.seed, self.batch_size, self.seq_len = int(seed), int(batch_size), int(seq_len)

        def batch(step: int):  # looked up at call time: tests replace data.global_batch
            return data_lib.global_batch(corpus, sharding, self.seed, int(step), self.batch_size, self.seq_len)

        dataset = grain.MapDataset.range(steps).map(batch)
        options = grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch)
        self._dataset = dataset.to_iter_dataset(options)
        self._iter = iter(self._dataset)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._iter)

    def state(self) -> dict:
        """What a checkpoint saves: Grain's iterator state (the steps consumed) and the sampler's
        arguments."""
        return {
            "grain": self._iter.get_state(),
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
        }

    @property
    def next_step(self) -> int:
        return int(self._iter.get_state()["next_index"])

    def restore(self, state: dict) -> None:
        """Continue from a saved `state()` (before the first `next`)."""
        self._iter.set_state(state["grain"])
