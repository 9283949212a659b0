"""The paged KV pool and the continuous-batching scheduler, plain Python outside jit.

PagePool: a fixed number of pages of `page_size` token slots (PagedAttention's block table). A
sequence owns an ordered list of pages; its token t lives in slot t % page_size of its page
t // page_size. Allocation never overflows: a request that cannot get its pages is refused
(`PoolExhausted`), and nothing changes.

Scheduler (Sarathi-Serve's stall-free batching): requests arrive and finish at any step. Each step
packs, up to `token_budget` tokens,
  1. one decode token for every running sequence, then
  2. prefill chunks of admitted requests, at most `chunk_size` tokens each,
and a request is admitted (its pages reserved for prompt + max_new_tokens, so a running sequence
never waits for a page) when the pool and `max_seqs` allow. `policy` gives the baselines the
Sarathi paper compares with: "prefill_first" (vLLM's: whole prompts before any decode, the
decodes of that step wait) and "decode_first" (decodes, then only whole prompts that fit what is
left of the budget); "chunked" is the default.
"""

from __future__ import annotations

import dataclasses
import math

from jaxsys.config import SERVE_POLICIES as POLICIES


class PoolExhausted(RuntimeError):
    """Not enough free pages: the request waits (or is refused if it can never fit)."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs num_pages >= 1 and page_size >= 1; got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest ids go out first
        self._pages: dict = {}

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def reserve(self, seq, tokens: int) -> list[int]:
        """Grow `seq`'s pages to hold `tokens` slots; PoolExhausted (and no change) if they are not free."""
        have = self._pages.get(seq, [])
        need = self.pages_for(tokens) - len(have)
        if need > len(self._free):
            raise PoolExhausted(f"sequence {seq!r} needs {need} more pages, {len(self._free)} are free")
        self._pages[seq] = have + [self._free.pop() for _ in range(max(need, 0))]
        return self._pages[seq]

    def table(self, seq) -> list[int]:
        return list(self._pages.get(seq, []))

    def free(self, seq) -> None:
        self._free.extend(reversed(self._pages.pop(seq, [])))


@dataclasses.dataclass
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
    # (Sampling.prompt_logprobs; None for the first)
    logprobs: list = dataclasses.field(default_factory=list)
    top_logprobs: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list = dataclasses.field(default_factory=list)
    # speculation's counts for this request: rounds, drafted and accepted tokens, decode steps
    stats: dict = dataclasses.field(
        default_factory=lambda: dict.fromkeys(("rounds", "drafted", "accepted", "decode_steps"), 0)
    )

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or len(self.generated) >= self.max_new_tokens

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
        """Tokens in the cache: the prefilled prompt and every generated token but the last."""
        return self.prefilled + max(len(self.generated) - 1, 0)


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
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: choose one of {POLICIES}")
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
        self.waiting: list[Request] = []  # arrived, no pages yet
        self.running: list[Request] = []  # pages reserved: prefilling or decoding
        self.finished: list[Request] = []

    def add(self, request: Request) -> None:
        """Queue a request; refuse (ValueError) one that could never fit the pool or the cache."""
        self.check(request)
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """ValueError for a request that could never fit the pool or the cache."""
        total = len(request.prompt) + request.max_new_tokens
        if not request.prompt or request.max_new_tokens < 1:
            raise ValueError(f"request {request.id!r}: needs a non-empty prompt and max_new_tokens >= 1")
        if self.pool.pages_for(total) > self.pool.num_pages or (self.max_len and total > self.max_len):
            raise ValueError(
                f"request {request.id!r} needs {total} tokens of cache ({self.pool.pages_for(total)} "
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
            try:
                self.pool.reserve(r.id, len(r.prompt) + r.max_new_tokens)
            except PoolExhausted:
                return  # first come, first served: later requests wait behind it
            self.running.append(self.waiting.pop(0))

    @staticmethod
    def lookahead(r: Request) -> int:
        """Tokens to draft for `r` this step: its spec_k, clamped so that the verified tokens
        (at most lookahead + 1) never run past max_new_tokens, nor the drafted slots past the
        pages reserved for prompt + max_new_tokens."""
        return max(min(r.spec_k, r.max_new_tokens - len(r.generated) - 1), 0)

    def plan(self) -> list[Work]:
        """The work of the next step (possibly empty when nothing is admitted or waiting)."""
        self._admit()
        decoding = [r for r in self.running if r.prefilled == len(r.prompt)]
        prefilling = [r for r in self.running if r.prefilled < len(r.prompt)]
        left = self.budget
        work: list[Work] = []

        def decodes():
            nonlocal left
            for r in decoding:
                if left == 0:
                    return
                n = min(1 + self.lookahead(r), left)
                work.append(Work(r, "decode", r.cached, n))
                left -= n

        def prefills(chunked: bool):
            nonlocal left
            for r in prefilling:
                remaining = len(r.prompt) - r.prefilled
                n = min(remaining, self.chunk, left) if chunked else remaining
                if n <= 0 or n > left:
                    continue
                work.append(Work(r, "prefill", r.prefilled, n))
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
        after each prompt's last chunk (a list of tokens after a speculative decode: the accepted
        drafts and the next token). Returns the requests that finished (their pages freed)."""
        done = []
        for w in work:
            r = w.request
            if w.kind == "prefill":
                r.prefilled += w.tokens
                if r.prefilled == len(r.prompt):
                    r.append([sampled[r.id]])
            else:
                tokens = sampled[r.id]
                r.append(tokens if isinstance(tokens, list) else [tokens])
            if r.done:
                done.append(r)
        for r in done:
            self.running.remove(r)
            self.pool.free(r.id)
            self.finished.append(r)
        return done

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
