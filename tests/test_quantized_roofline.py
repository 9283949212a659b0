"""experiments/quantized_decode_roofline/run.py: the decode roofline against hand-computed values
(H100: 3.35 TB/s, 989 TFLOP/s bf16, 1979 TOPS int8; Llama-2-7B: 32 layers, D 4096, F 11008,
MHA, V 32000)."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "quantized_decode_roofline", os.path.join(ROOT, "experiments", "quantized_decode_roofline", "run.py")
)
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)

H100 = run.CHIPS["h100"]
BLOCKS = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # 6,476,005,376 matmul weights in the blocks
HEAD = 4096 * 32000  # the bf16 output layer


def test_params_of_llama_7b():
    assert run.params(run.MODELS["llama-7b"]) == dict(blocks=BLOCKS, head=HEAD, matmul=BLOCKS + HEAD)


def test_batch_1_is_bandwidth_bound_and_w4a16_gains_the_byte_ratio():
    """At batch 1 the step reads the weights once: bf16 2 B per weight, W4A16 (G = 128, fp32 scales)
    0.5 + 4/128 = 0.53125 B, the output layer bf16 in both: ~3.57x, not 4x (scales and the head)."""
    bf16 = run.step("llama-7b", "bf16", 1, 0, H100)
    w4 = run.step("llama-7b", "w4a16", 1, 0, H100)
    assert bf16["bound"] == w4["bound"] == "memory"
    assert bf16["weight_bytes"] == 2 * (BLOCKS + HEAD)
    assert w4["weight_bytes"] == 0.53125 * BLOCKS + 2 * HEAD
    assert bf16["tokens_per_s"] == pytest.approx(3.35e12 / (2 * (BLOCKS + HEAD)), rel=2e-3)  # ~253
    ratio = (2 * (BLOCKS + HEAD)) / (0.53125 * BLOCKS + 2 * HEAD)  # 3.569
    assert w4["tokens_per_s"] / bf16["tokens_per_s"] == pytest.approx(ratio, rel=2e-3)
    assert 3.5 < ratio < 4.0


def test_large_batch_is_compute_bound_and_the_speedup_falls_to_one():
    """Past every crossover all formats run the same FLOPs: W4A16 / W8A16 at the bf16 peak (1x),
    W8A8 at the int8 peak (2x on the blocks, the bf16 head holding it just below)."""
    bf16 = run.step("llama-7b", "bf16", 2048, 0, H100)
    w4 = run.step("llama-7b", "w4a16", 2048, 0, H100)
    w8a8 = run.step("llama-7b", "w8a8", 2048, 0, H100)
    assert bf16["bound"] == w4["bound"] == w8a8["bound"] == "compute"
    assert bf16["seconds"] / w4["seconds"] == pytest.approx(1.0)
    assert bf16["seconds"] == pytest.approx(2 * 2048 * (BLOCKS + HEAD) / 989e12)
    want = (BLOCKS + HEAD) / 989e12 / (BLOCKS / 1979e12 + HEAD / 989e12)
    assert bf16["seconds"] / w8a8["seconds"] == pytest.approx(want)


def test_the_crossover_where_4x_stops():
    """Weights only, a matmul turns compute bound at batch bytes-per-weight x peak / (2 BW):
    W4A16 0.53125 x 989 / 6.7 = 78 on an H100, bf16 295; the whole step (bf16 head, activations)
    a little later. Between the two the ideal speed-up falls as ~295 / batch."""
    assert run.ideal_crossover_weights_only(0.53125, H100) == pytest.approx(78.4, abs=0.1)
    assert run.ideal_crossover_weights_only(2.0, H100) == pytest.approx(295.2, abs=0.1)
    b4 = run.crossover("llama-7b", "w4a16", 0, H100)
    assert 78 < b4 < 100
    assert run.step("llama-7b", "w4a16", b4 - 1, 0, H100)["bound"] == "memory"
    assert run.step("llama-7b", "w4a16", b4, 0, H100)["bound"] == "compute"
    at = lambda b: (
        run.step("llama-7b", "bf16", b, 0, H100)["seconds"] / run.step("llama-7b", "w4a16", b, 0, H100)["seconds"]
    )
    assert at(16) > 3.4 and at(200) == pytest.approx(run.ideal_crossover_weights_only(2.0, H100) / 200, rel=0.1)


def test_kv_cache_bytes_and_its_effect():
    """KV cache: 2 x 32 layers x 128 tokens x 4096 x 2 B = 64 MiB per sequence; with it the
    bytes grow with the batch and the speed-up falls sooner."""
    s = run.step("llama-7b", "w4a16", 3, 128, H100)
    assert s["kv_bytes"] == 3 * 64 * 2**20
    assert run.crossover("llama-7b", "w4a16", 128, H100) is None  # 64 MiB per sequence outgrows the FLOPs
    speedup = lambda ctx: (
        run.step("llama-7b", "bf16", 16, ctx, H100)["seconds"] / run.step("llama-7b", "w4a16", 16, ctx, H100)["seconds"]
    )
    assert speedup(0) > speedup(128) > speedup(2048) > 1


def test_measured_speedups_weight_the_bench_shapes_per_layer(tmp_path):
    """A bench.py record's best times, summed over a layer's matmuls by count (q, k, v, o are 4 of
    4096 x 4096 in Llama-7B, gate and up 2 of 4096 x 11008, down 1 of 11008 x 4096)."""
    us = {"bf16": (10.0, 20.0, 30.0), "w4a16": (4.0, 6.0, 10.0)}
    rows = [
        dict(model="llama-7b", K=k, N=n, M=1, format=fmt, us=t, best=True)
        for fmt, ts in us.items()
        for (k, n), t in zip([(4096, 4096), (4096, 11008), (11008, 4096)], ts)
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(device="NVIDIA H100 80GB HBM3", results=rows)))
    got = run.measured_speedups(str(path))
    assert got[("h100", "llama-7b", 1, "w4a16")] == pytest.approx((4 * 10 + 2 * 20 + 30) / (4 * 4 + 2 * 6 + 10))
    assert got[("h100", "llama-7b", 1, "bf16")] == 1.0
