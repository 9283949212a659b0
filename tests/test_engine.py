"""The continuous-batching engine (jaxsys/serve/engine.py) over a paged KV cache: every request
gets the tokens it would get generated alone (greedy, with the contiguous cache), whatever the
arrival order, chunking and co-scheduled requests, on one device and tensor=2."""

import numpy as np
import pytest

from jaxsys.serve import engine, sampling
from tests.helpers import generate_contiguous, program_for, small_config


@pytest.mark.parametrize(
    "mesh,policy", [(None, "chunked"), ({"tensor": 2, "data": 2}, "chunked"), (None, "decode_first")]
)
def test_continuous_batching_gives_each_request_its_solo_tokens(mesh, policy):
    program = program_for(small_config(mesh, n_kv_heads=4))
    params = program.init(3).params
    eng = engine.Engine(
        program, params, num_pages=24, page_size=4, token_budget=24, chunk_size=5, max_seqs=3, policy=policy
    )
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, size=int(rng.integers(1, 20))).tolist() for _ in range(7)]
    news = [int(rng.integers(1, 10)) for _ in range(7)]
    # requests arrive over the first steps, while others are running
    pending = list(range(7))
    while pending or not eng.idle:
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                i = pending.pop(0)
                eng.submit(i, prompts[i], news[i])
        eng.step()
    done = {r.id: r.generated for r in eng.finished}
    assert sorted(done) == list(range(7)) and all(p.free_pages == p.num_pages for p in eng.pools)
    for i in range(7):
        assert done[i] == generate_contiguous(program, params, [prompts[i]], news[i])[0], i


def test_contiguous_cache_from_the_config_and_abort():
    """config.serve.cache='contiguous' serves the paged engine's tokens; aborting a running and a
    waiting request frees their pages and leaves the others' tokens unchanged."""
    config = small_config(n_kv_heads=4)
    program = program_for(config)
    params = program.init(3).params
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [2, 7]]
    kw = dict(num_pages=16, page_size=4, token_budget=16, chunk_size=4, max_seqs=2)
    paged = engine.Engine(program, params, **kw)
    for i, p in enumerate(prompts):
        paged.submit(i, p, 6)
    want = {r.id: r.generated for r in paged.run()}
    config.serve.cache = "contiguous"
    config.serve.token_budget, config.serve.chunk_size, config.serve.max_seqs = 16, 4, 2
    contiguous = engine.Engine.from_config(program_for(config), params, max_len=32)
    assert contiguous.kind == "contiguous" and contiguous.max_len == 32
    for i, p in enumerate(prompts):
        contiguous.submit(i, p, 6)
    contiguous.step()
    contiguous.step()
    assert [r.id for r in contiguous.schedulers[0].running] == [0, 1] and contiguous.schedulers[0].waiting
    assert contiguous.abort(1) and contiguous.abort(3) and not contiguous.abort(3)
    got = {r.id: r.generated for r in contiguous.run()}
    assert got == {0: want[0], 2: want[2]}
    assert all(p.free_pages == p.num_pages for p in contiguous.pools)


def test_after_warmup_no_step_compiles():
    """warmup() compiles the step and its sampling for every row bucket: steps that sample for 1, 2
    or 3 sequences do not compile again (on a GPU each such compile stalled a step ~2.8 s)."""
    program = program_for(small_config(n_kv_heads=4))
    params = program.init(0).params
    eng = engine.Engine(program, params, num_pages=24, page_size=4, token_budget=16, chunk_size=4, max_seqs=3)
    eng.warmup()
    counts = lambda: (eng.runner.compiled(), sampling.sample_at._cache_size(), eng._advance_fn()._cache_size())
    compiled = counts()
    for i, (length, new) in enumerate([(3, 6), (9, 2), (5, 4)]):
        eng.submit(i, list(range(1, length + 1)), new)
    while not eng.idle:
        eng.step()
    assert len(eng.finished) == 3
    assert counts() == compiled


def test_engine_refuses_what_it_cannot_serve():
    program = program_for(small_config(n_kv_heads=4))
    params = program.init(0).params
    eng = engine.Engine(program, params, num_pages=4, page_size=4, token_budget=8, chunk_size=4, max_seqs=2)
    with pytest.raises(ValueError, match="more than the pool"):
        eng.submit("big", [1] * 10, 10)
    with pytest.raises(ValueError, match="outside"):
        eng.submit("bad", [300], 2)


def test_bench_serve_replays_a_trace_and_reports(tmp_path, capsys):
    import json

    from jaxsys import bench_serve
    from jaxsys.serve import bench as serve_bench

    trace = tmp_path / "trace.jsonl"
    rows = [{"arrival_s": 0.01 * i, "prompt_len": 3 + i, "output_len": 2 + i % 3} for i in range(6)]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    args = [
        "--config",
        "configs/tiny.py:test",
        "--trace",
        str(trace),
        "--pages",
        "32",
        "--page-size",
        "8",
        "--token-budget",
        "16",
        "--chunk-size",
        "4",
        "--max-seqs",
        "3",
        "--json",
        "--config.model.n_kv_heads=4",
    ]
    assert bench_serve.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["requests"] == 6 and result["generated_tokens"] == sum(r["output_len"] for r in rows)
    for key in ("ttft_s", "tpot_s"):
        assert 0 < result[key]["p50"] <= result[key]["p99"]
    assert bench_serve.main(["--config", "configs/tiny.py:test", "--prompt-len", "9:3"]) == 2
    assert "lo <= hi" in capsys.readouterr().err
    generated = serve_bench.make_trace(200, 10.0, (1, 4), (1, 2), seed=0)
    gaps = np.diff([r["arrival_s"] for r in generated])
    assert abs(gaps.mean() - 0.1) < 0.03  # Poisson at 10/s: exponential gaps of mean 0.1 s


def test_set_params_reshards_from_another_mesh_and_sleep_wake():
    """An RL trainer's update reaches the engine by a resharding transfer: parameters trained on
    fsdp=4 over devices 0-3 land on the engine's data=2 x tensor=2 over devices 4-7 bitwise, every
    byte of the engine's shards crossing devices, and the engine then generates what an engine
    built with those parameters generates. sleep() frees the cache's buffers; wake() serves again."""
    import jax

    from jaxsys import program as program_lib
    from jaxsys.mesh import make_mesh

    base = small_config(n_kv_heads=4)
    trainer_config = small_config({"fsdp": 4}, n_kv_heads=4)
    trainer = program_lib.build(trainer_config, make_mesh(trainer_config, jax.devices()[:4]))
    serve_config = small_config({"data": 2, "tensor": 2}, n_kv_heads=4)
    served = program_lib.build(serve_config, make_mesh(serve_config, jax.devices()[4:8]))
    trained = trainer.init(7).params
    kw = dict(num_pages=16, page_size=4, token_budget=16, chunk_size=8, max_seqs=2)
    eng = engine.Engine(served, served.init(0).params, **kw)
    moved = eng.set_params(trained)
    total = sum(s.data.nbytes for a in jax.tree.leaves(eng.params) for s in a.addressable_shards)
    assert moved == total > 0
    for got, want in zip(jax.tree.leaves(eng.params), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    want = generate_contiguous(
        program_for(base), jax.device_put(trained, program_for(base).param_shardings), [[1, 2, 3]], 5
    )
    assert engine.generate(eng, [[1, 2, 3]], 5) == want
    pools = list(eng.cache.per_layer().values())
    eng.sleep()
    assert eng.cache is None and all(a.is_deleted() for a in pools)
    eng.wake()
    assert engine.generate(eng, [[1, 2, 3]], 5) == want
