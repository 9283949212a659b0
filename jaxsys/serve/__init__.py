"""Serving: one engine over typed KV caches (jaxsys/cache/).

    engine.py       the engine (`Engine`, its interface `EngineAPI`, `generate`)
    runner.py       the model's one cached forward, compiled on the mesh (`ModelRunner`)
    scheduler.py    the page allocator and the continuous-batching scheduler (plain Python)
    sampling.py     next-token sampling on the device
    speculation.py  speculative decoding as drafters: a draft model, or self-speculation
    disagg.py       disaggregated prefill and decode: two engines and a page transfer
    server.py       the HTTP server (OpenAI's API, FastAPI); protocol.py: its request models
    bench.py        trace replay (TTFT, TPOT)

Commands: `python -m jaxsys.generate`, `python -m jaxsys.serve`, `python -m jaxsys.bench_serve`.
"""


def build_engine(program, params, max_len: int | None = None):
    """The engine `program.config.serve` describes: prefill and decode on two sub-meshes when
    serve.disaggregate, else one `Engine` (with a drafter when serve.spec_k >= 1)."""
    if program.config.serve.disaggregate:
        from jaxsys.serve import disagg

        return disagg.DisaggregatedEngine.from_config(program.config, params, max_len=max_len)
    from jaxsys.serve.engine import Engine

    return Engine.from_config(program, params, max_len)
