"""The GPU benchmark scripts' code paths on CPU (benchmarks/gpu_kernels.sh runs them on a GPU):
gpu_check's quantized checks, split-K included, and the flash bench's interpret smoke run with its
vendor columns skipped by name rather than failing."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402

from jaxsys.kernels.flash_attention import bench as flash_bench  # noqa: E402


def test_gpu_check_quantized_passes_with_split_k(tmp_path):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--small", "--only", "quantized", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert any("split_k=2" in r["check"] for r in rows) and all(r["ok"] for r in rows)


def test_flash_bench_smoke_skips_the_vendor_columns_by_name(tmp_path, capsys):
    out = tmp_path / "flash.json"
    argv = ["--interpret-smoke", "--impls", "pallas,cudnn,tokamax,xla", "--causal", "true", "--out", str(out)]
    assert flash_bench.main(argv) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["pallas"]["fwd_err"] <= 2.0**-7 * rows["pallas"]["fwd_ref_max"]
    assert rows["pallas"]["fwd_bwd_err"] <= 2.0**-6 * rows["pallas"]["fwd_bwd_ref_max"]
    assert rows["cudnn"]["skipped"] == "cudnn needs a GPU"
    assert rows["tokamax"]["skipped"] == "tokamax needs a GPU"
    # the table again from the JSON alone (what a run cut by its time limit leaves)
    capsys.readouterr()
    assert flash_bench.main(["--table", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("| 128 | 64 |") for line in table) == 4 and any("| pallas |" in x for x in table)


def test_gpu_check_json_says_which_checks_ran_to_the_end(tmp_path, monkeypatch):
    """gpu_kernels.sh benches the Mosaic GPU kernels only if check.json's `completed` names their
    check: a check that raises part-way keeps its earlier rows but is not listed, and the record is
    on disk after each check (a later hang cut by the step's limit loses nothing before it)."""
    out = tmp_path / "check.json"

    def half_done(small):
        yield "first case", 0.0, 1.0
        raise RuntimeError("the kernel failed to launch")

    def after(small):
        assert json.loads(out.read_text())["completed"] == ["fine"]  # written before this check ran
        yield "later case", 0.0, 1.0

    monkeypatch.setitem(gpu_check.CHECKS, "half_done", half_done)
    monkeypatch.setitem(gpu_check.CHECKS, "fine", lambda small: iter([("a case", 0.5, 1.0)]))
    monkeypatch.setitem(gpu_check.CHECKS, "after", after)
    assert gpu_check.main(["--only", "half_done,fine,after", "--out", str(out)]) == 1
    record = json.loads(out.read_text())
    assert record["completed"] == ["fine", "after"]
    assert [r["check"] for r in record["rows"]] == ["first case", "half_done", "a case", "later case"]
    assert "failed to launch" in record["rows"][1]["error"]


def test_trace_kernels_sums_the_gpu_streams_kernels(tmp_path):
    """gpu_profile.sh's fallback where ncu cannot read counters: each kernel's device time from
    JAX's Perfetto trace, the GPU processes' events only, longest first, per profiled call."""
    import gzip

    import profile_kernel

    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        *({"ph": "X", "pid": 1, "name": "flash_attention_mgpu_bwd_fused", "dur": 300.0} for _ in range(2)),
        *({"ph": "X", "pid": 1, "name": "loop_convert_fusion", "dur": 10.0} for _ in range(4)),
        {"ph": "X", "pid": 2, "name": "PjitFunction(f)", "dur": 5000.0},  # host time: left out
    ]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = profile_kernel.trace_kernels(str(tmp_path))
    assert rows == [("flash_attention_mgpu_bwd_fused", 2, 600.0), ("loop_convert_fusion", 4, 40.0)]
    table = profile_kernel.kernel_table(rows, iters=2)
    assert "| flash_attention_mgpu_bwd_fused | 1 | 300.0 | 93.8% |" in table
    assert "| loop_convert_fusion | 2 | 20.0 | 6.2% |" in table


def test_split_override_sends_the_hopper_kernels_to_the_split_backward(tmp_path, monkeypatch):
    """What gpu_kernels.sh sets when the fused backward fails its check: a JAXSYS_TUNING_DIR file
    for this device under which llama_1b's attention (H = 64, T = 2048, causal, bf16) and H = 128
    get the split backward."""
    import jax.numpy as jnp

    from jaxsys.kernels import tuning
    from jaxsys.kernels.flash_attention import kernel_mgpu

    assert gpu_check.main(["--split-override", str(tmp_path)]) == 0
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path))
    tuning.clear_cache()
    try:
        for h, t in ((64, 2048), (128, 4096), (128, 16384)):
            assert not kernel_mgpu.make_config(h, t, jnp.bfloat16, scale=h**-0.5, causal=True).fused_dq
    finally:
        tuning.clear_cache()
