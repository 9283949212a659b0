"""The paged KV pool and the continuous-batching scheduler, plain Python outside jit.

PagePool: a fixed number of pages of `page_size` token slots (PagedAttention's block table), each
with a reference count. A sequence holds an ordered list of pages; its token t lives in slot
t % page_size of its page t // page_size. Pages are taken as a sequence grows and given back when
it ends; an allocation that cannot be met raises `PoolExhausted` and changes nothing.
Prefix caching (vLLM's automatic prefix caching, SGLang's RadixAttention): a full page is named by
the hash chain of the tokens up to its end (`page_hashes`); `register` records a sequence's full
pages under those names, and `match` gives a new sequence the longest run of its prefix's pages
already in the pool (their reference counts go up: shared pages are only read). A page nobody
references stays cached until its slot is needed (least recently used first).

Scheduler (Sarathi-Serve's stall-free batching): requests arrive and finish at any step. Each step
packs, up to `token_budget` tokens,
  1. one decode token (1 + k under speculation) for every running sequence, then
  2. prefill chunks of admitted requests, at most `chunk_size` tokens each.
A request is admitted when `max_seqs` allows and the pool holds its prefix's pages (allocation
"on_demand": then its pages grow as it decodes) or its prompt + max_new_tokens pages (allocation
"reserve": a running sequence never waits for a page). When an on-demand sequence cannot grow, the
most recently admitted running sequence is preempted (vLLM's recompute preemption): its pages go
back (its full pages stay in the prefix cache), and it waits at the head of the queue to prefill
its prompt and the tokens it has generated again; its output is unchanged. Under swap preemption
the engine copies its cache to host memory first (`on_preempt`) and back into its new pages when
it is admitted again (`on_resume`), which then prefills only what was not in the cache. `policy` gives the
baselines the Sarathi paper compares with: "prefill_first" (vLLM's: whole prompts before any
decode, the decodes of that step wait) and "decode_first" (decodes, then only whole prompts that
fit what is left of the budget); "chunked" is the default.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math

import numpy as np

from jaxsys.config import SERVE_POLICIES as POLICIES

ALLOCATIONS = ("on_demand", "reserve")
PREEMPTIONS = ("recompute", "swap")  # what a preempted sequence's cache becomes (the engine's serve.preemption)
# what `Scheduler.commit` takes for a token sampled on the device whose value the host reads a step
# later (overlapped scheduling, the engine's serve.overlap): the request counts it (`pending`)
PENDING = object()


class PoolExhausted(RuntimeError):
    """Not enough free pages: the request waits (or is refused if it can never fit)."""


def page_hashes(tokens: list, page_size: int, previous: list | None = None) -> list[bytes]:
    """The names of the full pages of `tokens`: page i's is a hash of page i - 1's and page i's
    tokens, so equal names mean equal prefixes. `previous`: names already computed for the first
    pages (extended, not recomputed)."""
    out = list(previous or [])
    for i in range(len(out), len(tokens) // page_size):
        h = hashlib.blake2b(out[-1] if out else b"", digest_size=16)
        h.update(np.asarray(tokens[i * page_size : (i + 1) * page_size], np.int64).tobytes())
        out.append(h.digest())
    return out


def ring_pages(m, page_size: int, chunk_size: int) -> int:
    """R, the pages a sequence needs at once when every layer of model `m` is a sliding-window
    one (W = m.sliding_window), else 0: a step writes up to C = chunk_size tokens from position p
    and its first query reads back to p - W + 1, so the logical pages from (p - W + 1) / page_size
    to (p + C - 1) / page_size, at most (W + C - 2) // page_size + 2 of them, must be distinct."""
    from jaxsys.models import attention

    if not m.sliding_window or any(kind != "local" for kind in attention.layer_types(m)):
        return 0
    return (m.sliding_window + chunk_size - 2) // page_size + 2


class PagePool:
    """Pages of `page_size` slots, reference-counted, with a prefix cache. `ring` R > 0 (a model
    whose every layer attends over a sliding window, `Engine`): a sequence holds at most R pages and
    its table maps logical page i to its (i mod R)-th, so that the pages behind the window are
    written over (R covers the window and a step's new tokens; the kernels read only the window's
    pages). No prefix cache then: a page's contents change with the position."""

    def __init__(self, num_pages: int, page_size: int, ring: int = 0):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs num_pages >= 1 and page_size >= 1; got {num_pages}, {page_size}")
        self.num_pages, self.page_size, self.ring = num_pages, page_size, ring
        self._span: dict = {}  # ring: sequence -> its logical pages (the table's length)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest ids go out first
        self._refs = [0] * num_pages
        self._pages: dict = {}  # sequence -> its pages in order
        self._page_of: dict = {}  # prefix cache: page name -> page
        self._name_of: dict = {}  # ... and page -> its name
        self._idle: collections.OrderedDict = collections.OrderedDict()  # cached, unreferenced: LRU first
        self.hits = self.queries = 0  # prefix-cache pages found / looked for

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def held_for(self, tokens: int) -> int:
        """Pages a sequence of `tokens` slots holds: pages_for, at most the ring's R."""
        return min(self.pages_for(tokens), self.ring) if self.ring else self.pages_for(tokens)

    @property
    def free_pages(self) -> int:
        """Pages an allocation can take: free ones and cached pages nobody references."""
        return len(self._free) + len(self._idle)

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        else:  # evict the least recently used cached page
            page, _ = self._idle.popitem(last=False)
            del self._page_of[self._name_of.pop(page)]
        self._refs[page] = 1
        return page

    def reserve(self, seq, tokens: int) -> list[int]:
        """Grow `seq`'s pages to hold `tokens` slots; PoolExhausted (and no change) if they are not free."""
        have = self._pages.get(seq, [])
        need = self.held_for(tokens) - len(have)
        if need > self.free_pages:
            raise PoolExhausted(f"sequence {seq!r} needs {need} more pages, {self.free_pages} are free")
        self._pages[seq] = have + [self._take() for _ in range(max(need, 0))]
        if self.ring:
            self._span[seq] = max(self._span.get(seq, 0), self.pages_for(tokens))
        return self.table(seq)

    def table(self, seq) -> list[int]:
        """`seq`'s page of each logical page (with a ring, its pages repeated cyclically)."""
        pages = self._pages.get(seq, [])
        if not self.ring or not pages:
            return list(pages)
        return [pages[i % len(pages)] for i in range(self._span.get(seq, len(pages)))]

    def free(self, seq) -> None:
        """Give back `seq`'s pages: a page nobody else references is free again (or, if it is in
        the prefix cache, stays there until evicted)."""
        self._span.pop(seq, None)
        for page in reversed(self._pages.pop(seq, [])):
            self._refs[page] -= 1
            assert self._refs[page] >= 0, (seq, page)
            if self._refs[page] == 0:
                if page in self._name_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def forget_cache(self) -> None:
        """Empty the prefix cache (new weights make its keys and values stale): cached pages nobody
        references are free again, referenced ones lose their names (freed as usual later)."""
        for page in self._idle:
            self._free.append(page)
        self._idle.clear()
        self._page_of.clear()
        self._name_of.clear()

    def match(self, seq, names: list[bytes]) -> int:
        """Give `seq` (holding no pages yet) the cached pages of the longest run of `names` from
        the first; returns how many."""
        assert not self._pages.get(seq), seq
        shared = []
        for name in names:
            page = self._page_of.get(name)
            if page is None:
                break
            shared.append(page)
        self.queries += len(names)
        self.hits += len(shared)
        for page in shared:
            self._idle.pop(page, None)
            self._refs[page] += 1
        if shared:
            self._pages[seq] = shared
        return len(shared)

    def register(self, seq, names: list[bytes]) -> None:
        """Name `seq`'s first len(names) pages (full, their tokens final) in the prefix cache; a
        name already cached keeps its page."""
        pages = self._pages.get(seq, [])
        for page, name in zip(pages, names):
            if name not in self._page_of and page not in self._name_of:
                self._page_of[name] = page
                self._name_of[page] = name

    def check(self) -> None:
        """The pool's invariants (for tests): every page is free, idle-cached or referenced, and
        the references are the sequences' holdings."""
        counts = collections.Counter(p for pages in self._pages.values() for p in pages)
        assert all(self._refs[p] == counts.get(p, 0) for p in range(self.num_pages)), "reference counts"
        free, idle = set(self._free), set(self._idle)
        assert not free & idle and len(free) == len(self._free), "a page free twice"
        for p in range(self.num_pages):
            assert (p in free) + (p in idle) + (self._refs[p] > 0) == 1, f"page {p}"
        assert set(self._idle) <= set(self._name_of), "an idle page that is not cached"


@dataclasses.dataclass(eq=False)  # a request is itself: `in` and `remove` compare identity
class Request:
    id: object
    prompt: list
    max_new_tokens: int
    prefilled: int = 0  # prompt tokens already in the cache
    generated: list = dataclasses.field(default_factory=list)
    spec_k: int = 0  # speculative decoding (serve/speculation.py): tokens drafted per decode step
    stop_ids: tuple = ()  # the request ends ("stop") when it generates one of these (EOS ids)
    finish_reason: str | None = None  # length | stop | abort | error, once it has ended
    error: str | None = None  # what failed, with finish_reason "error"
    fork_of: object = None  # the request whose prefill this one shares (n > 1 samples of one prompt)
    # per generated token: its log-probability under the model, and the top alternatives
    # (Sampling.logprobs); per prompt token: its log-probability given the tokens before it
    # (Sampling.prompt_logprobs; None for the first) and the top alternatives there
    logprobs: list = dataclasses.field(default_factory=list)
    top_logprobs: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list = dataclasses.field(default_factory=list)
    prompt_top_logprobs: list = dataclasses.field(default_factory=list)
    # speculation's counts for this request: rounds, drafted and accepted tokens, decode steps
    stats: dict = dataclasses.field(
        default_factory=lambda: dict.fromkeys(("rounds", "drafted", "accepted", "decode_steps"), 0)
    )
    # what prefill computes: the prompt, or after a preemption the prompt and the tokens generated
    # before it (recomputed; `prefilled` counts positions of this prefix in the cache)
    prefix: list = dataclasses.field(default_factory=list)
    names: list = dataclasses.field(default_factory=list)  # prefix-cache names of its full pages
    registered: int = 0  # of its pages, those named in the pool's prefix cache
    preempted: int = 0  # times it was preempted
    share_prefix: bool = True  # may start from cached pages (not when its prompt's logits are wanted)
    # overlapped scheduling: tokens sampled on the device, not yet read by the host (0 or 1); they
    # count for the cache and the schedule (`cached`, `ended`) but are not in `generated`
    pending: int = 0
    swapped: int = 0  # swap preemption: tokens of its cache copied to host memory, copied back on resume

    def __post_init__(self):
        if not self.prefix:
            self.prefix = self.prompt

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or len(self.generated) >= self.max_new_tokens

    @property
    def ended(self) -> bool:
        """Nothing more to schedule: done, or its last token is sampled but still on the device."""
        return self.done or len(self.generated) + self.pending >= self.max_new_tokens

    def append(self, tokens: list) -> int:
        """Add generated tokens, cut after the first stop id; sets finish_reason when the request
        is complete. Returns how many were kept."""
        kept = []
        for token in tokens:
            kept.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
        self.generated.extend(kept)
        if self.finish_reason is None and len(self.generated) >= self.max_new_tokens:
            self.finish_reason = "length"
        return len(kept)

    @property
    def cached(self) -> int:
        """Tokens in the cache: the prefilled prefix and every token generated since but the last."""
        generated = len(self.generated) + self.pending
        return self.prefilled + max(generated - (len(self.prefix) - len(self.prompt)) - 1, 0)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prefix)


@dataclasses.dataclass(frozen=True)
class Work:
    """One request's share of a step: `tokens` new tokens starting at cache position `start`.
    kind "prefill" (a prompt chunk; its last chunk also yields the first generated token) or
    "decode" (the last generated token at position `start`, and under speculative decoding
    `tokens` - 1 drafted tokens after it)."""

    request: Request
    kind: str
    start: int
    tokens: int


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        token_budget: int,
        chunk_size: int,
        max_seqs: int,
        policy: str = "chunked",
        max_len: int | None = None,
        allocation: str = "reserve",
        prefix_cache: bool = False,
        on_preempt=None,
        on_resume=None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: choose one of {POLICIES}")
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation={allocation!r}: choose one of {ALLOCATIONS}")
        if token_budget < 1 or chunk_size < 1 or max_seqs < 1:
            raise ValueError("token_budget, chunk_size and max_seqs must be >= 1")
        self.pool, self.budget, self.chunk, self.max_seqs, self.policy = (
            pool,
            token_budget,
            chunk_size,
            max_seqs,
            policy,
        )
        self.max_len = max_len
        self.allocation, self.prefix_cache = allocation, prefix_cache
        self.on_preempt = on_preempt  # called with a preempted request, its pages still held (the
        # engine drops its device state, or copies its cache to host memory: r.swapped)
        self.on_resume = on_resume  # called with a swapped request given its pages again: its
        # cache copied back, returns the tokens restored
        self.waiting: list[Request] = []  # arrived (or preempted), no pages yet
        self.running: list[Request] = []  # holding pages: prefilling or decoding, oldest admitted first
        self.finished: list[Request] = []
        self.preemptions = 0

    def add(self, request: Request) -> None:
        """Queue a request; refuse (ValueError) one that could never fit the pool or the cache."""
        self.check(request)
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """ValueError for a request that could never fit the pool or the cache."""
        total = len(request.prompt) + request.max_new_tokens
        if not request.prompt or request.max_new_tokens < 1:
            raise ValueError(f"request {request.id!r}: needs a non-empty prompt and max_new_tokens >= 1")
        if self.pool.held_for(total) > self.pool.num_pages or (self.max_len and total > self.max_len):
            raise ValueError(
                f"request {request.id!r} needs {total} tokens of cache ({self.pool.held_for(total)} "
                f"pages), more than the pool's {self.pool.num_pages} pages"
                + (f" or the {self.max_len}-token limit" if self.max_len else "")
            )
        if self.policy != "chunked" and len(request.prompt) > self.budget:
            raise ValueError(
                f"request {request.id!r}: a {len(request.prompt)}-token prompt exceeds the token "
                f"budget of {self.budget}, and policy {self.policy!r} prefills whole prompts; raise "
                "the budget or use policy='chunked'"
            )

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_seqs:
            r = self.waiting[0]
            shared = 0
            if self.prefix_cache and r.share_prefix and not r.prefilled and not r.swapped:
                # at least the last prefix token is computed (its logits give the next token)
                r.names = page_hashes(r.prefix, self.pool.page_size, r.names)
                shared = self.pool.match(r.id, r.names[: (len(r.prefix) - 1) // self.pool.page_size])
            tokens = len(r.prefix) if self.allocation == "on_demand" else len(r.prompt) + r.max_new_tokens
            try:
                self.pool.reserve(r.id, tokens)
            except PoolExhausted:
                self.pool.free(r.id)  # the shared pages it matched
                return  # first come, first served: later requests wait behind it
            r.prefilled = shared * self.pool.page_size
            r.registered = shared
            if r.swapped:
                r.prefilled, r.swapped = self.on_resume(r), 0
            self.running.append(self.waiting.pop(0))

    def preempt(self, r: Request) -> None:
        """Take `r`'s pages back (recompute preemption): it waits at the head of the queue to prefill
        its prompt and the tokens it generated, then decodes on."""
        self.running.remove(r)
        if self.on_preempt is not None:
            self.on_preempt(r)
        self.pool.free(r.id)
        r.prefix = r.prompt + r.generated
        r.prefilled = r.registered = 0
        r.names = r.names[: len(r.prefix) // self.pool.page_size]
        r.preempted += 1
        self.preemptions += 1
        self.waiting.insert(0, r)

    def _grow(self, r: Request, tokens: int, planned: list) -> bool:
        """Give `r` pages for `tokens` slots, preempting the most recently admitted running
        sequences not yet planned in this step (`r` itself last); False if `r` was preempted."""
        while True:
            try:
                self.pool.reserve(r.id, tokens)
                return True
            except PoolExhausted:
                victim = next((v for v in reversed(self.running) if v not in planned and v is not r), r)
                self.preempt(victim)
                if victim is r:
                    return False

    @staticmethod
    def lookahead(r: Request) -> int:
        """Tokens to draft for `r` this step: its spec_k, clamped so that the verified tokens
        (at most lookahead + 1) never run past max_new_tokens, nor the drafted slots past the
        pages reserved for prompt + max_new_tokens."""
        return max(min(r.spec_k, r.max_new_tokens - len(r.generated) - 1), 0)

    def plan(self) -> list[Work]:
        """The work of the next step (possibly empty when nothing is admitted or waiting)."""
        self._admit()
        left = self.budget
        work: list[Work] = []
        planned: list[Request] = []

        def decodes():
            nonlocal left
            for r in [r for r in self.running if r.decoding]:
                if left == 0:
                    return
                if not r.decoding:  # preempted to make room for an older sequence (O(1): `in` is O(running))
                    continue
                n = min(1 + self.lookahead(r), left)
                if self.allocation == "on_demand" and not self._grow(r, r.cached + n, planned):
                    continue
                work.append(Work(r, "decode", r.cached, n))
                planned.append(r)
                left -= n

        def prefills(chunked: bool):
            nonlocal left
            for r in [r for r in self.running if not r.decoding]:
                if r not in self.running:
                    continue
                remaining = len(r.prefix) - r.prefilled
                n = min(remaining, self.chunk, left) if chunked else remaining
                if n <= 0 or n > left:
                    continue
                work.append(Work(r, "prefill", r.prefilled, n))
                planned.append(r)
                left -= n

        if self.policy == "chunked":
            decodes()
            prefills(chunked=True)
        elif self.policy == "decode_first":
            decodes()
            prefills(chunked=False)
        else:  # prefill_first: whole prompts, and decodes only in steps without prefill
            prefills(chunked=False)
            if not work:
                decodes()
        return work

    def commit(self, work: list[Work], sampled: dict) -> list[Request]:
        """Apply a step's results: `sampled[request id]` is the token sampled after each decode and
        after each prefix's last chunk (a list of tokens after a speculative decode: the accepted
        drafts and the next token; PENDING: sampled on the device, its value read later). Names
        the sequences' newly full pages in the prefix cache.
        Returns the requests that finished (their pages given back)."""
        done = []
        for w in work:
            r = w.request
            if w.kind == "prefill":
                r.prefilled += w.tokens
            if w.kind == "decode" or r.prefilled == len(r.prefix):
                tokens = sampled[r.id]
                if tokens is PENDING:
                    r.pending += 1
                else:
                    r.append(tokens if isinstance(tokens, list) else [tokens])
            if self.prefix_cache:
                self._register(r)
            if r.ended:
                done.append(r)
        for r in done:
            self.running.remove(r)
            self.pool.free(r.id)
            self.finished.append(r)
        return done

    def receive(self, r: Request, token: int) -> tuple[bool, bool]:
        """Overlapped scheduling: the value of `r`'s pending token, read a step after it was
        sampled. Dropped if `r` ended meanwhile (an abort, a stop string, a failure); a stop id ends
        `r` now, running or preempted (the decode of it already dispatched is wasted). A preempted
        `r` recomputes the token with its prefix. Returns (kept, `r` ended now: its pages freed)."""
        r.pending -= 1
        if r.finish_reason is not None:
            return False, False
        waiting = r in self.waiting
        r.append([token])
        if waiting:  # preempted with the token in flight: its prefix did not have it yet
            r.prefix = r.prompt + r.generated
        if r.finish_reason == "stop" and (waiting or r in self.running):
            (self.waiting if waiting else self.running).remove(r)
            self.pool.free(r.id)
            self.finished.append(r)
            return True, True
        return True, False

    def _register(self, r: Request) -> None:
        full = r.cached // self.pool.page_size
        if full > r.registered:
            r.names = page_hashes(r.prompt + r.generated, self.pool.page_size, r.names[:full])[:full]
            self.pool.register(r.id, r.names)
            r.registered = full

    def remove(self, request_id, reason: str = "abort", keep: bool = False) -> Request | None:
        """End a waiting or running request now (an abort, a stop string, a failure) with
        finish_reason `reason`, freeing its pages; `keep`: list it in `finished`. None if it is
        neither waiting nor running."""
        for queue in (self.waiting, self.running):
            for r in queue:
                if r.id == request_id:
                    queue.remove(r)
                    self.pool.free(request_id)
                    r.finish_reason = reason
                    if keep:
                        self.finished.append(r)
                    return r
        return None

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
