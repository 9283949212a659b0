"""The full-precision pages of the engine's quantized KV cache (config.serve.kv_quant; docs/kv_quant.md).

Under kv_quant a sequence's logical page i has a slot in the quantized pool (its PagePool page,
reserved at admission as without quantization) and, while it is being written or is in the
residual window, a page of the small full-precision pool. The row at position p reads its pages
[0, n_quant(p)) quantized and [n_quant(p), p // page_size] in full precision, n_quant(p) =
max((p + 1) // page_size - residual, 0). `ResidualPages` (plain Python, one per batch shard)
hands out full-precision pages before a step (`prepare`: every page a row of the step writes or
reads in full precision, and the page it seals: the page of p, which the row at p fills when
(p + 1) % page_size == 0) and takes back after it the pages no later row writes or reads
(`advance`), and all of a finished sequence's (`free`). A row at p needs the full-precision pages
[first(p), p // page_size], first(p) = min(n_quant(p), p // page_size).

Pool size. At a step a sequence holds the pages [first(start), (start + T - 1) // page_size] of
its T rows from `start`: at most residual + 2 + (T - 1) // page_size. Over the at most max_seqs
running sequences and a token budget of `budget` rows that is at most
max_seqs (residual + 2) + ceil(budget / page_size) pages (`fp_pages`): the pool never runs out.
"""

from __future__ import annotations

import math

import numpy as np


def fp_pages(max_seqs: int, token_budget: int, page_size: int, residual: int) -> int:
    """Full-precision pages a batch shard needs (module docstring)."""
    return max_seqs * (residual + 2) + math.ceil(token_budget / page_size)


def n_quant(length: int, page_size: int, residual: int) -> int:
    """As kernels/paged_attention/quant.n_quant, in Python."""
    return max(length // page_size - residual, 0)


def first_fp_page(pos: int, page_size: int, residual: int) -> int:
    """The first logical page the row at `pos` needs in full precision (to read or to seal)."""
    return min(n_quant(pos + 1, page_size, residual), pos // page_size)


class ResidualPages:
    def __init__(self, num_pages: int, page_size: int, residual: int):
        self.num_pages, self.page_size, self.residual = num_pages, page_size, residual
        self._free = list(range(num_pages - 1, -1, -1))
        self._pages: dict = {}  # sequence -> {logical page: full-precision page id}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def prepare(self, seq, start: int, tokens: int) -> None:
        """Give `seq` a page for every logical page its rows start .. start + tokens - 1 write or
        read in full precision."""
        own = self._pages.setdefault(seq, {})
        lo = first_fp_page(start, self.page_size, self.residual)
        for i in range(lo, (start + tokens - 1) // self.page_size + 1):
            if i not in own:
                if not self._free:
                    raise RuntimeError("the full-precision page pool is exhausted (fp_pages sized it too small)")
                own[i] = self._free.pop()

    def table(self, seq, max_pages: int, scratch: int) -> np.ndarray:
        """[max_pages] full-precision page ids of `seq`'s logical pages (`scratch` where it has none)."""
        out = np.full(max_pages, scratch, np.int32)
        for i, page in self._pages.get(seq, {}).items():
            if i < max_pages:
                out[i] = page
        return out

    def pages(self, seq) -> dict:
        """{logical page: full-precision page id} of `seq`."""
        return dict(self._pages.get(seq, {}))

    def advance(self, seq, cached: int) -> None:
        """`seq` has `cached` tokens: free the pages its next row (position `cached`) and the later
        ones never write nor read in full precision."""
        own = self._pages.get(seq, {})
        lo = first_fp_page(cached, self.page_size, self.residual)
        for i in [i for i in own if i < lo]:
            self._free.append(own.pop(i))

    def free(self, seq) -> None:
        self._free.extend(self._pages.pop(seq, {}).values())
