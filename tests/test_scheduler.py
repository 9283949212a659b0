"""The paged KV pool and the continuous-batching scheduler (jaxsys/serve/scheduler.py), on random
traces: the invariants hold at every step, every request finishes and every page comes back."""

import numpy as np
import pytest

from jaxsys.serve.scheduler import POLICIES, PagePool, PoolExhausted, Request, Scheduler


def test_pool_reserves_grows_frees_and_never_overflows():
    pool = PagePool(num_pages=5, page_size=4)
    assert pool.reserve("a", 6) == [0, 1]
    assert pool.reserve("a", 9) == [0, 1, 2]  # grows in place
    with pytest.raises(PoolExhausted):
        pool.reserve("b", 12)  # 3 pages, 2 free
    assert pool.table("b") == [] and pool.free_pages == 2  # nothing changed
    pool.reserve("b", 8)
    assert pool.free_pages == 0
    pool.free("a")
    assert pool.free_pages == 3 and sorted(pool.reserve("c", 12)) == [0, 1, 2]


def _simulate(policy, seed, steps_max=2000):
    rng = np.random.default_rng(seed)
    pool = PagePool(num_pages=int(rng.integers(8, 40)), page_size=int(rng.choice([4, 8, 16])))
    budget, chunk = int(rng.integers(8, 64)), int(rng.integers(4, 32))
    sched = Scheduler(pool, token_budget=budget, chunk_size=chunk, max_seqs=int(rng.integers(1, 8)), policy=policy)
    arrivals = {}
    for i in range(int(rng.integers(5, 25))):
        prompt = list(range(int(rng.integers(1, 60))))
        new = int(rng.integers(1, 20))
        if pool.pages_for(len(prompt) + new) > pool.num_pages:
            with pytest.raises(ValueError, match="more than the pool"):
                sched.add(Request(i, prompt, new))
            continue
        if policy != "chunked" and len(prompt) > budget:
            with pytest.raises(ValueError, match="prefills whole prompts"):
                sched.add(Request(i, prompt, new))
            continue
        arrivals.setdefault(int(rng.integers(0, 40)), []).append(Request(i, prompt, new))
    expected = sum(len(v) for v in arrivals.values())
    for step in range(steps_max):
        for r in arrivals.pop(step, []):
            sched.add(r)
        work = sched.plan()
        # the invariants
        assert sum(w.tokens for w in work) <= budget
        assert len(sched.running) <= sched.max_seqs and pool.used_pages <= pool.num_pages
        owned = [p for r in sched.running for p in pool.table(r.id)]
        assert len(owned) == len(set(owned)) == pool.used_pages  # no page shared or leaked
        for r in sched.running:
            assert len(pool.table(r.id)) * pool.page_size >= len(r.prompt) + r.max_new_tokens
        for w in work:
            assert w.tokens >= 1 and w.start + w.tokens <= len(w.request.prompt) + w.request.max_new_tokens
            if w.kind == "prefill" and policy == "chunked":
                assert w.tokens <= chunk
        if policy == "chunked":  # stall-free: every decoding sequence advances when the budget allows
            decoding = [r for r in sched.running if r.prefilled == len(r.prompt) and not r.done]
            if len(decoding) <= budget:
                assert {w.request.id for w in work if w.kind == "decode"} == {r.id for r in decoding}
        sched.commit(work, {w.request.id: step for w in work})
        if not arrivals and sched.idle:
            break
    assert not arrivals and sched.idle, "not every request finished"
    assert len(sched.finished) == expected and pool.free_pages == pool.num_pages
    assert all(len(r.generated) == r.max_new_tokens and r.prefilled == len(r.prompt) for r in sched.finished)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(12))
def test_random_traces_keep_the_invariants_and_finish(policy, seed):
    _simulate(policy, seed)


def test_bad_requests_and_settings_are_named():
    sched = Scheduler(PagePool(4, 4), token_budget=8, chunk_size=4, max_seqs=2, max_len=12)
    with pytest.raises(ValueError, match="non-empty prompt"):
        sched.add(Request(0, [], 4))
    with pytest.raises(ValueError, match="12-token limit"):
        sched.add(Request(1, [1] * 10, 4))
    with pytest.raises(ValueError, match="policy="):
        Scheduler(PagePool(4, 4), 8, 4, 2, policy="fifo")
