"""KV caches as types. The model's attention knows one thing about inference: a cache object with
one method, `o, cache = cache.attend(q, k, v, positions[, window, softcap])` (write this step's keys and
values, then attend to the cache, over each query's last W positions for a sliding-window layer,
scores soft-capped for a Gemma 2 model), and the layer stack scans its per-layer arrays (base.py). Each kind is one
file, its metadata typed fields of a pytree dataclass, never dict keys the model inspects:

    ContiguousCache      contiguous.py  [L, B, S, K, H]: a row of S slots per sequence (a batch of
                                        sequences, or the engine's slots), optionally seen
                                        fake-quantized (the KIVI reference)
    PagedCache           paged.py       [L, P, page, K, H] pages shared by all sequences, a page
                                        table per row; the Pallas paged-attention kernel
    QuantizedPagedCache  kivi.py        KIVI / int8 pages sealed as they fill, a small
                                        full-precision pool for the open and residual pages
    WindowView           window.py      a paged cache read through sinks + a recent window of its
                                        own pages (self-speculation's draft)

A *latent* cache (MLA, base.py) is a PagedCache or ContiguousCache whose `v` is None: one pool of
[C + R] rows, read as keys and values.

The serving engine (jaxsys/serve/engine.py) allocates the pages and fills the tables on the host;
the model (`transformer.forward`) only calls `attend`.
"""

from jaxsys.cache.base import KVCache
from jaxsys.cache.contiguous import ContiguousCache
from jaxsys.cache.kivi import FakeQuant, QuantizedPagedCache
from jaxsys.cache.paged import PagedCache
from jaxsys.cache.window import WindowView

__all__ = ["KVCache", "ContiguousCache", "PagedCache", "QuantizedPagedCache", "WindowView", "FakeQuant"]
