"""Disaggregated prefill and decode (jaxsys/serve/disagg.py): prefill on tensor=4, decode on
data=2 x tensor=2, the KV pages handed over between the two sub-meshes. Every request gets exactly
the greedy tokens of a colocated engine; the bytes moved equal the formula; no page leaks; bad
sub-meshes are named before anything compiles; the cost model picks each side where it should."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxsys.analysis.decode import kv_transfer_bytes
from jaxsys.analysis.serving import CostModel
from jaxsys.config import ConfigError
from jaxsys.serve import disagg, engine
from tests.helpers import generate_contiguous, program_for, reference_logprob_rows, small_config


def _config(**serve):
    c = small_config(n_kv_heads=4)
    c.serve.disaggregate = True
    for k, v in serve.items():
        c.serve[k] = v
    return c


def _requests(n=6, seed=1):
    rng = np.random.default_rng(seed)
    return [
        (i, rng.integers(0, 256, size=int(rng.integers(1, 21))).tolist(), int(rng.integers(1, 8))) for i in range(n)
    ]


def _serve(eng, requests, arrive_per_step=2):
    pending = list(requests)
    while pending or not eng.idle:
        for _ in range(arrive_per_step):
            if pending:
                eng.submit(*pending.pop(0))
        eng.step()
    return {r.id: r.generated for r in eng.finished}


def _length_split_cost(pre, dec, tokens=10):
    """Prompts of >= `tokens` tokens to the prefill side, shorter ones colocated (no stall weight;
    the prefill side 4x faster; a link latency worth 3/4 of a `tokens`-token prefill)."""
    cm = CostModel.for_configs(pre.config, dec.config, interference=0.0)
    fd = 1e9
    return CostModel(
        cm.model,
        4,
        5,
        4 * fd,
        fd,
        0.0,
        0.0,
        1e30,
        link_latency_s=0.75 * cm.prefill_flops(tokens - 0.5) / fd,
        interference=0.0,
    )


@pytest.mark.parametrize("placement", ["prefill", "colocated", pytest.param("mixed", marks=pytest.mark.slow)])
def test_disaggregated_tokens_equal_colocated_and_bytes_equal_formula(placement):
    config = _config(placement="cost" if placement == "mixed" else placement)
    pre, dec = disagg.build_programs(config)
    assert pre.mesh.devices.size == 4 and dec.mesh.devices.size == 4
    assert not set(pre.mesh.devices.flat) & set(dec.mesh.devices.flat)
    params = program_for(small_config(n_kv_heads=4)).init(3).params  # one device: resharded onto each side
    cost = _length_split_cost(pre, dec) if placement == "mixed" else CostModel.for_configs(pre.config, dec.config)
    eng = disagg.DisaggregatedEngine(
        pre, dec, params, num_pages=16, page_size=4, token_budget=16, chunk_size=5, max_seqs=3, cost=cost
    )
    requests = _requests()
    got = _serve(eng, requests)
    # the same requests on one plain engine over all 8 devices (data=2 x tensor=4)
    whole = program_for(small_config({"data": 2, "tensor": 4}, n_kv_heads=4))
    ref = engine.Engine(
        whole,
        jax.device_put(params, whole.param_shardings),
        num_pages=16,
        page_size=4,
        token_budget=16,
        chunk_size=5,
        max_seqs=3,
    )
    want = _serve(ref, requests)
    assert sorted(got) == sorted(want) == [r[0] for r in requests]
    for rid, prompt, new in requests:
        assert got[rid] == want[rid], rid
        assert len(got[rid]) == new
    # every page back in both pools: nothing leaks
    for side in (eng.prefill, eng.decode):
        assert all(p.free_pages == p.num_pages for p in side.pools)
    handed = eng.transfers
    sides = {rid: eng.placement[rid] for rid, _, _ in requests}
    expect = {"prefill": {"prefill"}, "colocated": {"colocated"}, "mixed": {"prefill", "colocated"}}
    assert set(sides.values()) == expect[placement]
    assert {t["id"] for t in handed} == {rid for rid, _, new in requests if new > 1 and sides[rid] == "prefill"}
    if placement == "mixed":  # the length split: long prompts prefilled apart, short ones piggybacked
        assert all((sides[rid] == "prefill") == (len(p) >= 10) for rid, p, _ in requests)
    for t in handed:
        formula = kv_transfer_bytes(config.model, t["tokens"], 4)
        assert t["bytes"] == t["formula_bytes"] == formula
        assert formula == 2 * 2 * (-(-t["tokens"] // 4) * 4) * 4 * 16 * 4  # 2 L ceil(T/p)p K H b


def _with_model(c, model: str):
    """c with GQA's 4 kv heads (as _config), or MLA with its latent cache: one pool of
    [C + R = 20 -> 32] rows per token, whole on every tensor rank."""
    c.model.n_kv_heads = 4
    if model == "mla":
        c.model.n_kv_heads, c.model.head_dim = 8, 12
        c.model.mla.kv_lora_rank, c.model.mla.rope_head_dim, c.model.mla.v_head_dim = 16, 4, 8
    return c


@pytest.mark.parametrize("model", ["gqa", "mla"])
def test_pages_round_trip_between_meshes(model):
    """export -> receive -> import moves a sequence's pages exactly, into another shard's pages;
    the bytes moved are the formula's (a latent cache's once per decode tensor rank)."""
    config = _with_model(_config(), model)
    pre, dec = disagg.build_programs(config)
    params = program_for(_with_model(small_config(), model)).init(0).params
    eng = disagg.DisaggregatedEngine(
        pre, dec, params, num_pages=8, page_size=4, token_budget=8, chunk_size=4, max_seqs=2
    )
    rng = np.random.default_rng(0)
    eng.prefill.cache = jax.tree.map(
        lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), a.sharding), eng.prefill.cache
    )
    block = eng.prefill.export_pages(0, [5, 2, 7])
    placed, moved = eng.decode.receive_pages(1, block)
    copies = 2 if model == "mla" else 1  # decode's tensor=2 ranks each receive the whole latent
    assert (model == "mla") == (eng.decode.cache.v is None)
    assert moved == copies * sum(b.nbytes for b in jax.tree.leaves(block))
    assert moved == kv_transfer_bytes(config.model, 12, 4, tensor=2)
    eng.decode.import_pages(1, [3, 0, 6], placed)
    for src, dst in zip(eng.prefill.cache.per_layer().values(), eng.decode.cache.per_layer().values()):
        src, dst = np.asarray(src), np.asarray(dst)
        np.testing.assert_array_equal(dst[:, 9 + np.array([3, 0, 6])], src[:, [5, 2, 7]])  # shard 1 = pages 9..17
        assert not dst[:, :8].any()  # shard 0's pages untouched (its scratch page got zeros)


@pytest.mark.parametrize(
    "serve,match",
    [
        (dict(prefill_mesh="tensor=4", decode_mesh="data=2"), "add up to 8"),
        (dict(prefill_mesh="tensor=8", decode_mesh="data=2,tensor=2"), "add up to 8"),
        (dict(prefill_mesh="tensr=4"), "axis=size pairs"),
        (dict(prefill_mesh="tensor=x"), "not an integer"),
        (dict(prefill_mesh="data=1,tensor=3", decode_mesh="data=5"), "prefill_mesh=.*(divisible|does not divide)"),
        (dict(prefill_mesh="pipe=2,tensor=2", decode_mesh="data=2,tensor=2"), "prefill_mesh.*pipe"),
        (dict(prefill_mesh="data=2,tensor=2", decode_mesh="tensor=4", n_kv_heads=2), "decode_mesh=.*n_kv_heads"),
        (dict(placement="anywhere"), "placement"),
        (dict(hardware="abacus"), "hardware"),
        (dict(spec_k=2), "spec_k"),
    ],
)
def test_bad_submesh_configs_are_named(serve, match):
    kv = serve.pop("n_kv_heads", 4)
    c = small_config(n_kv_heads=kv)
    for k, v in serve.items():
        c.serve[k] = v
    with pytest.raises(ConfigError, match=match):
        disagg.side_configs(c, 8)


def test_cost_model_picks_each_side_where_it_should():
    """Priced for configs/llama_8b.py on H100s (prefill tensor=4, decode data=2 x tensor=2)."""
    from tests.helpers import config_file

    c = config_file("llama_8b")
    c.mesh.fsdp, c.mesh.tensor, c.parallel.sequence_parallel = 1, 1, False
    c.serve.chunk_size = 512
    pre, dec = disagg.side_configs(c, 8)
    cm = CostModel.for_configs(pre, dec)
    idle = [(0, 0), (0, 0)]
    # an idle prefill side takes any prompt: 4 devices, nothing to stall
    assert cm.place(4096, 0, idle) == ("prefill", None)
    assert cm.place(16, 0, [(0, 8), (0, 8)]) == ("prefill", None)
    # behind a long prefill queue a short prompt piggybacks on the decode shard (no stall to speak of) ...
    assert cm.place(16, 8192, [(0, 8), (0, 8)])[0] == "colocated"
    # ... and so does a long one when the decode side has nobody to stall ...
    assert cm.place(4096, 8192, idle)[0] == "colocated"
    # ... but not beside many running decodes
    assert cm.place(4096, 8192, [(0, 16), (0, 16)]) == ("prefill", None)
    # the decode shard: the one with fewer running decodes, then the shorter queue
    assert cm.place(1024, 8192, [(0, 12), (0, 4)]) == ("colocated", 1)
    assert cm.place(1024, 2048, [(0, 12), (0, 4)]) == ("prefill", None)  # a shorter queue: worth the wait
    assert cm.place(64, 8192, [(4096, 4), (0, 4)]) == ("colocated", 1)
    # transfer priced by the formula over the link
    assert cm.transfer_bytes(1000) == 2 * 32 * 1008 * 8 * 128 * 2
    assert cm.transfer_s(1000) == pytest.approx(cm.transfer_bytes(1000) / 450e9 + 20e-6)
    # forced placements
    forced = dataclasses.replace(cm, placement="colocated")
    assert forced.place(4096, 0, idle)[0] == "colocated"
    assert dataclasses.replace(cm, placement="prefill").place(16, 10**6, idle) == ("prefill", None)


def test_http_server_streams_from_the_disaggregated_engine():
    """`python -m jaxsys.serve` with config.serve.disaggregate=true runs this engine behind the same
    server loop: concurrent requests each get their solo greedy tokens, streamed; a scoring request
    (echo, logprobs 2) gets the prompt's and every generated token's logprobs and alternatives of
    the training forward, the first token's too (it is sampled on the prefill side)."""
    import json
    import threading
    import urllib.request

    from jaxsys.serve import server
    from jaxsys.tokenizer import ByteTokenizer

    config = _config(placement="prefill")
    one = program_for(small_config(n_kv_heads=4))
    params = one.init(3).params
    eng = disagg.DisaggregatedEngine.from_config(config, params)  # config.serve: 256 pages of 16
    httpd, loop = server.serve(eng, ByteTokenizer(), "tiny-disagg", port=0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/completions"
    results = {}

    def ask(i, prompt):
        data = json.dumps({"prompt": prompt, "max_tokens": 4, "stream": i % 2 == 0}).encode()
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=120) as r:
            body = r.read().decode()
        if i % 2:
            results[i] = json.loads(body)["choices"][0]["token_ids"]
        else:
            chunks = [json.loads(e[len("data: ") :]) for e in body.split("\n\n") if e and e != "data: [DONE]"]
            results[i] = [c["choices"][0]["token_ids"][0] for c in chunks]

    prompts = [[5 + i] * (3 + 7 * i) for i in range(3)]
    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(prompts)]
    scored = list(range(40, 52))
    try:
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        data = json.dumps({"prompt": scored, "max_tokens": 3, "echo": True, "logprobs": 2}).encode()
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=120) as r:
            choice = json.loads(r.read())["choices"][0]
    finally:
        server.shutdown(httpd, loop)
    for i, p in enumerate(prompts):
        assert results[i] == generate_contiguous(one, params, [p], 4)[0], i
    assert {t["id"] for t in eng.transfers} == set(eng.placement) and len(eng.transfers) == 4
    seq = scored + choice["token_ids"]
    rows = reference_logprob_rows(one, params, seq)
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(seq) and lp["token_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], rows[np.arange(len(seq) - 1), seq[1:]], atol=1e-4)
    for i in range(1, len(seq)):  # two alternatives and the token itself at every position
        best = np.argsort(-rows[i - 1])[:2]
        want = {server.token_text(ByteTokenizer(), int(t)): rows[i - 1, t] for t in (*best, seq[i])}
        assert set(lp["top_logprobs"][i]) == set(want), i
        np.testing.assert_allclose([lp["top_logprobs"][i][n] for n in want], list(want.values()), atol=1e-4)


def test_decode_analysis_reports_transfer_bytes():
    from jaxsys.analysis import decode as decode_analysis
    from jaxsys.analysis import hardware
    from tests.helpers import config_file

    c = config_file("llama_8b")
    c.mesh.fsdp = 1
    r = decode_analysis.decode_report(c, hardware.profile("h100"), contexts=(500, 2048), batches=(1,))
    assert r["transfer_bytes_per_request"] == {500: 2 * 32 * 512 * 8 * 128 * 2, 2048: 2 * 32 * 2048 * 8 * 128 * 2}
    assert r["transfer_s_per_request"][2048] == pytest.approx(r["transfer_bytes_per_request"][2048] / 450e9)
    assert "prefill->decode transfer" in decode_analysis.format_decode_report(r)


def test_page_methods_are_generic_over_a_quantized_cache():
    """The KIVI cache has pools with their own page ids: per-leaf ids move every leaf
    exactly (what disaggregation would need under kv_quant, which it still refuses by name)."""
    config = _config()
    pre, dec = disagg.build_programs(config)
    params = program_for(small_config(n_kv_heads=4)).init(0).params
    kw = dict(num_pages=8, page_size=4, token_budget=8, chunk_size=4, max_seqs=2, kv_quant="int8")
    src = engine.Engine(pre, disagg.reshard(params, pre), **kw)
    dst = engine.Engine(dec, disagg.reshard(params, dec), **kw)
    pools = src.cache.per_layer()
    assert len(pools) > 2
    rng = np.random.default_rng(0)
    pools = {k: jax.device_put(rng.integers(0, 100, a.shape).astype(a.dtype), a.sharding) for k, a in pools.items()}
    src.cache = src.cache.with_layers(pools)
    fp = {k for k, a in pools.items() if a.shape[1] != pools["kq"].shape[1]}
    ids_src = {k: ([1] if k in fp else [5, 2]) for k in pools}
    ids_dst = {k: ([0] if k in fp else [3, 6]) for k in pools}
    block = src.export_pages(0, ids_src)
    placed, moved = dst.receive_pages(1, block)
    assert moved == sum(b.nbytes for b in jax.tree.leaves(block))
    dst.import_pages(1, ids_dst, placed)
    for k in pools:
        a, b = np.asarray(pools[k]), np.asarray(dst.cache.per_layer()[k])
        per = b.shape[1] // dst.shards
        np.testing.assert_array_equal(b[:, per + np.array(ids_dst[k])], a[:, ids_src[k]])
    c = small_config(n_kv_heads=4)
    c.serve.kv_quant = "int8"
    with pytest.raises(ConfigError, match="kv_quant"):
        disagg.side_configs(c, 8)
