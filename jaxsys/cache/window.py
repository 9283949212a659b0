"""Self-speculation's read view (TriForce / StreamingLLM): a paged cache read through a sparse
table of its own pages, the first `sink` tokens (attention sinks) and the last `window` tokens.

`WindowView(cache, read_table, read_lengths, read_fp_table, read_quant)` wraps a `PagedCache` or a
`QuantizedPagedCache`: `attend` writes this step's keys and values through the cache's own tables
(the draft's rows write their sequence's real slots, which the verify step overwrites) and reads
only the view's pages, so the paged kernel reads sink + window tokens. Sink and window are whole
pages (the sink rounded up, the window's first page rounded down). A sequence shorter than sink +
window reads its whole cache, and then the draft is the target (every draft accepted).

Over a quantized cache the view keeps what the full read would see: the view's pages that the
sequence has sealed are read quantized, the rest in full precision. The sealed pages are a prefix
of the view (sink pages come first, and a window page is sealed only if every sink page is), so
`read_quant` (the kernel's quantized page count per row) says it.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxsys.cache.base import ROW, ROWS, KVCache


def view_pages(length: int, page_size: int, sink_pages: int, window: int) -> tuple[list[int], int]:
    """The logical pages a draft row at cache length `length` reads, in order, and how many of
    their slots: the first `sink_pages` pages and the pages holding the last `window` tokens (the
    window's first page whole). The whole cache when the two overlap."""
    first = max(length - window, 0) // page_size
    last = math.ceil(length / page_size)
    if first <= sink_pages:
        return list(range(last)), length
    return list(range(sink_pages)) + list(range(first, last)), sink_pages * page_size + length - first * page_size


def sealed_in_view(pages: list[int], sealed: int) -> int:
    """How many of the view's `pages` are among the sequence's first `sealed` (quantized) pages."""
    return sum(page < sealed for page in pages)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowView(KVCache):
    cache: KVCache
    read_table: jax.Array
    read_lengths: jax.Array
    read_fp_table: jax.Array | None = None  # a quantized cache's full-precision ids of the view
    read_quant: jax.Array | None = None  # ... and its quantized page count per row

    def per_layer(self) -> dict:
        return self.cache.per_layer()

    def with_layers(self, layers: dict) -> "WindowView":
        return dataclasses.replace(self, cache=self.cache.with_layers(layers))

    def pspecs(self, layout):
        rows, row = layout.compute_spec(ROWS), layout.compute_spec(ROW)
        optional = lambda x, spec: None if x is None else spec
        return WindowView(
            self.cache.pspecs(layout),
            rows,
            row,
            optional(self.read_fp_table, rows),
            optional(self.read_quant, row),
        )

    def attend(self, q, k, v, positions, window=None, softcap=None):
        """A model's sliding window counts the view's last positions, which are the sequence's
        own last ones while the window fits in the view's recent pages (a draft; the verify step
        reads the real cache)."""
        if self.read_fp_table is None:
            read = (self.read_table, self.read_lengths)
        else:
            read = (self.read_table, self.read_lengths, self.read_fp_table, self.read_quant)
        o, cache = self.cache.attend(q, k, v, positions, window=window, softcap=softcap, read=read)
        return o, dataclasses.replace(self, cache=cache)
