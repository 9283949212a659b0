"""The analysis on accelerator compilers (`jaxsys.analyze --target`): TPU slices through libtpu's
compile-only devices and NVIDIA GPU nodes through XLA:GPU's deviceless compilation.

- target names, topologies, slices and the errors for bad ones (unknown target, a mesh that does
  not match the chip count, a missing compiler);
- the mesh over a target: -1 fills the devices, DCN factors put an axis across slices;
- the reader of compiled HLO (`jaxsys/analysis/hlo.py`) on small hand-written modules whose answers
  are known (loop trip counts, async overlap, convolution FLOPs, the TPU's reduce-scatter emitter);
- the analysis itself: the target compiler's memory in the JSON, matmul FLOPs equal to the model's
  (loop trip counts make the rolled scan count every layer), collective bytes equal to the formula
  where the compiler keeps the algorithm, and exactly the documented difference where the TPU
  compiler replaces small reduce-scatters by all-reduce + slice.
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from jaxsys import analyze
from jaxsys.analysis import hlo, report, targets
from jaxsys.config import ConfigError, validate
from jaxsys.mesh import make_mesh
from tests.helpers import ROOT, small_config

# -------------------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    "name, topology, chips",
    [
        ("v5p-256", "v5p:4x4x8", 128),  # v5p names count TensorCores: 2 per chip
        ("v5p-8", "v5p:2x2x1", 4),
        ("v4-32", "v4:2x2x4", 16),
        ("v5e-16", "v5e:4x4", 16),  # v5e / v6e names count chips
        ("v5litepod-16", "v5e:4x4", 16),
        ("v6e-256", "v6e:16x16", 256),
        ("v5p:2x2x2", "v5p:2x2x2", 8),
        ("h100-8", "1x1x8", 8),  # GPUs: 8 per node
        ("h100-256", "1x32x8", 256),
        ("h200-4", "1x1x4", 4),
    ],
)
def test_target_names(name, topology, chips):
    t = targets.parse(name)
    assert (t.topology, t.chips) == (topology, chips)


def test_slices_multiply_the_chips():
    t = targets.parse("v6e-16", slices=4)
    assert (t.chips_per_slice, t.chips) == (16, 64)


@pytest.mark.parametrize(
    "name, message",
    [
        ("v9-8", "unknown target 'v9-8': known targets are v4-N"),
        ("v5p-12", "v5p-N counts TensorCores, 2 per chip"),
        ("v6e:2x2x2", "a v6e slice has 2 dimensions"),
        ("h100-12", "N must be 1, 2, 4 or a multiple of 8"),
    ],
)
def test_bad_target_names_are_refused_with_the_known_ones(name, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        targets.parse(name)


def test_topology_libtpu_cannot_build_is_refused():
    with pytest.raises(ConfigError, match="libtpu cannot describe TPU target v5p:3x3x3"):
        targets.devices(targets.parse("v5p:3x3x3"))


# -------------------------------------------------------------------------------------- meshes


def test_tpu_devices_and_slices():
    one = targets.devices(targets.parse("v5p:2x2x2"))
    assert len(one) == 8 and {d.platform for d in one} == {"tpu"}
    two = targets.devices(targets.parse("v5p:2x2x1", slices=2))
    assert sorted({d.slice_index for d in two}) == [0, 1]


def test_dcn_factor_puts_an_axis_across_slices():
    devices = targets.devices(targets.parse("v5p:2x2x1", slices=2))
    c = small_config(dict(data=2, fsdp=4))
    c.dcn.data = 2
    mesh = make_mesh(c, devices)
    slices = [[d.slice_index for d in row.flat] for row in mesh.devices]  # per `data` index
    assert slices == [[0] * 4, [1] * 4], "data (the DCN axis) must change slice; fsdp must not"
    c.dcn.data = 1
    with pytest.raises(ConfigError, match="span 2 slice\\(s\\) but config.dcn.\\* multiplies to 1"):
        make_mesh(c, devices)


def test_minus_one_fills_the_devices():
    c = small_config(dict(tensor=2))
    c.mesh.fsdp = -1
    validate(c)  # fine before the device count is known
    validate(c, num_devices=8)
    assert c.mesh.fsdp == 4
    c = small_config(dict(tensor=2))
    c.mesh.fsdp = c.mesh.data = -1
    with pytest.raises(ConfigError, match="only one axis may be -1"):
        validate(c)
    c = small_config(dict(tensor=2))
    c.mesh.fsdp = -1
    with pytest.raises(ConfigError, match="7 devices do not divide by the other axes"):
        validate(c, num_devices=7)


# -------------------------------------------------------------------------------------- CLI errors


def _cli(capsys, *args):
    code = analyze.main(list(args))
    return code, capsys.readouterr().err


def test_missing_libtpu_is_one_line_with_the_install_command(capsys, monkeypatch):
    monkeypatch.setattr(targets, "has_libtpu", lambda: False)
    code, err = _cli(capsys, "--config", "configs/tiny.py", "--target", "v5p-8")
    assert code == 2 and err.count("\n") == 1 and "pip install -e '.[tpu]'" in err


def test_missing_cuda_plugin_names_the_install_command(capsys, monkeypatch):
    monkeypatch.setattr(targets, "has_cuda_plugin", lambda: False)
    code, err = _cli(capsys, "--config", "configs/tiny.py", "--target", "h100-8")
    assert code == 2 and "pip install -e '.[gpu-aot]'" in err


def test_unknown_target_and_mismatched_mesh_are_refused(capsys):
    code, err = _cli(capsys, "--config", "configs/tiny.py", "--target", "v9-8")
    assert code == 2 and "known targets are" in err
    code, err = _cli(capsys, "--config", "configs/tiny.py", "--target", "v5p-16", "--config.mesh.data=4")
    assert code == 2 and "has 4 devices but 8 are available" in err and "8 chips of TPU v5p" in err
    code, err = _cli(capsys, "--config", "configs/llama_8b.py")
    assert code == 2 and "config.mesh.fsdp=-1 takes its size from the device count" in err


# -------------------------------------------------------------------------------------- HLO reader

LOOP = """HloModule m, is_scheduled=true

%cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%fused (a: f32[8,16], b: f32[16,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,16]{1,0} parameter(1)
  ROOT %d = f32[8,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,16]{1,0} constant({...})
  %ag = f32[32,16]{1,0} all-gather-start(%x), replica_groups=mesh['data'=4,'tensor'=2] {'data'}, dimensions={0}
  %f = f32[8,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused
  %agd = f32[32,16]{1,0} all-gather-done(%ag)
  %ar = f32[8,16]{1,0} all-reduce(%f), replica_groups=mesh['data'=4,'tensor'=2] {'tensor'}, to_apply=%fused
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%next, %ar)
}

ENTRY %main (x: f32[8,16]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %x)
  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_loop_trip_counts_scale_flops_and_collectives():
    module = hlo.parse(LOOP)
    assert module.executions["body"] == 7 and module.unknown_trip_counts == 0
    assert module.matmul_flops() == 7 * 2 * 8 * 16 * 16
    found = {c.kind: c for c in module.collectives({"data": 4, "tensor": 2})}
    gather, reduce = found["all_gather"], found["all_reduce"]
    assert (gather.axes, gather.group_size, gather.executions) == (("data",), 4, 7)
    assert gather.is_async and gather.overlapped_ops == 1 and gather.overlapped_flops == 2 * 8 * 16 * 16
    assert (reduce.axes, reduce.is_async, reduce.operand_bytes) == (("tensor",), False, 8 * 16 * 4)


CONV = """HloModule c

ENTRY %main (a: bf16[16,4096,128], b: bf16[128,256,1]) -> bf16[16,4096,256] {
  %a = bf16[16,4096,128]{2,1,0} parameter(0)
  %b = bf16[128,256,1]{2,1,0} parameter(1)
  %c = bf16[16,4096,256]{2,1,0} convolution(%a, %b), window={size=1}, dim_labels=0bf_io0->0bf
  ROOT %s = bf16[16,4096,256]{2,1,0} copy(%c)
}
"""


def test_convolution_flops_count_the_contraction():
    # how TPU HLO writes a matmul: lhs [spatial 16, batch 4096, features 128] against a [128 in,
    # 256 out, 1-wide window] kernel: 16 x 4096 rows, each a 128 -> 256 matmul
    assert hlo.parse(CONV).matmul_flops() == 2 * 16 * 4096 * 128 * 256


def test_strided_dilated_convolution_counts_only_real_inputs():
    # lhs dilation 2 puts holes between the 4 inputs; with stride 1 and a 3-wide window half the
    # (output, kernel) pairs land on holes or padding
    assert hlo._valid_positions(4, 3, 7, stride=1, pad_low=0, base_dilation=2, window_dilation=1) == 10
    assert hlo._valid_positions(5, 1, 5, stride=1, pad_low=0, base_dilation=1, window_dilation=1) == 5


RS = """HloModule r, is_scheduled=true

%all-reduce-scatter.1 (input: bf16[4096,64]) -> bf16[512,64] {
  %input = bf16[4096,64]{1,0} parameter(0)
  %ar = bf16[4096,64]{1,0} all-reduce(%input), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %z = u32[] constant(0)
  ROOT %ds = bf16[512,64]{1,0} dynamic-slice(%ar, %z, %z), dynamic_slice_sizes={512,64}
}

ENTRY %main (x: bf16[4096,64]) -> bf16[512,64] {
  %x = bf16[4096,64]{1,0} parameter(0)
  ROOT %f = bf16[512,64]{1,0} fusion(%x), kind=kCustom, calls=%all-reduce-scatter.1
}
"""


def test_tpu_all_reduce_scatter_emitter_is_a_reduce_scatter():
    (c,) = hlo.parse(RS).collectives({"data": 1, "fsdp": 8})
    assert (c.kind, c.axes, c.group_size, c.operand_bytes) == ("reduce_scatter", ("fsdp",), 8, 4096 * 64 * 2)


# -------------------------------------------------------------------------------------- the analysis


def _config(mesh, **model):
    """The tiny model scaled up so that the TPU compiler keeps large collectives as written
    (D=512, F=2048, T=256, B=16; it turns small reduce-scatters into all-reduce + slice)."""
    c = small_config(mesh, d_model=512, d_ff=2048, head_dim=64, **model)
    c.data.seq_len, c.train.batch_size = 256, 16
    return c


@pytest.fixture(scope="module")
def v5p_16():
    return targets.parse("v5p-16")


def _by_axes(rows):
    out = {}
    for (kind, axes), (_, b) in report.by_kind_axes(rows).items():
        out[axes] = out.get(axes, 0.0) + b
    return out


@pytest.mark.parametrize(
    "mesh, model",
    [
        pytest.param(dict(data=8), {}, id="data8"),
        pytest.param(dict(tensor=8), dict(n_kv_heads=8), id="tensor8", marks=pytest.mark.slow),  # 66 s
    ],
)
def test_tpu_analysis_has_the_compilers_memory_and_the_formulas_bytes(mesh, model, v5p_16):
    config = _config(mesh, **model)
    r = report.analyze_target(config, v5p_16, jax.devices(), flops=False)
    json.dumps(r)  # what --json prints
    t = r["target"]
    assert t["compiler"].startswith("TPU compiler (libtpu ") and t["chips"] == 8
    m = t["memory"]
    assert m["fits"] and m["device"]["peak_bytes"] > r["memory"]["params_bytes"] + r["memory"]["optimizer_bytes"]
    assert m["device"]["argument_bytes"] >= r["memory"]["params_bytes"]
    # every layer counted once per execution: the rolled scan's matmuls are the model's (remat none,
    # fp32, the reference attention computes the full T x T scores as the formula counts them)
    assert t["flops"]["matmul_flops_per_chip"] == pytest.approx(r["model_flops_per_device"], rel=1e-9)
    assert t["flops"]["unknown_trip_counts"] == 0
    # the compiler merges collectives (fewer ops) but moves the formula's bytes; a few bytes more
    # where it combined a 4-byte scalar into a gradient all-reduce
    compiled = report.by_kind_axes(t["collectives"])
    formula = report.by_kind_axes(r["collectives_formula"])
    assert set(compiled) == set(formula)
    for key, (count, b) in formula.items():
        assert compiled[key][1] == pytest.approx(b, rel=1e-6), key
        assert 1 <= compiled[key][0] <= count


@pytest.mark.slow  # CI time
def test_tpu_compiler_turns_small_reduce_scatters_into_all_reduces(v5p_16):
    """FSDP at this size: the gradient reduce-scatters come out as (combined) all-reduces followed by
    slices, so the wire carries twice their bytes; the all-gathers stay. Per axis: the formula's bytes
    plus the reduce-scatters' once more."""
    r = report.analyze_target(_config(dict(fsdp=8)), v5p_16, jax.devices(), flops=False)
    kinds = {row["kind"] for row in r["target"]["collectives"] if not row["scalar"]}
    assert "reduce_scatter" not in kinds and {"all_gather", "all_reduce"} <= kinds
    formula = report.by_kind_axes(r["collectives_formula"])
    scattered = formula[("reduce_scatter", ("fsdp",))][1]
    assert _by_axes(r["target"]["collectives"])[("fsdp",)] == pytest.approx(
        _by_axes(r["collectives_formula"])[("fsdp",)] + scattered, rel=1e-3
    )


def test_gpu_analysis_keeps_the_formulas_bytes_and_runs_collectives_async():
    r = report.analyze_target(_config(dict(fsdp=8)), targets.parse("h100-8"), None, flops=False)
    t = r["target"]
    assert t["compiler"].startswith("XLA:GPU deviceless") and t["memory"]["device"]["peak_bytes"] > 0
    assert _by_axes(t["collectives"])[("fsdp",)] == pytest.approx(
        _by_axes(r["collectives_formula"])[("fsdp",)], rel=1e-6
    )
    assert all(row["async"] == row["count"] for row in t["collectives"] if not row["scalar"])
    assert t["flops"]["matmul_flops_per_chip"] == pytest.approx(r["model_flops_per_device"], rel=1e-9)


def test_a_program_that_does_not_fit_is_reported_with_the_compilers_numbers():
    c = small_config({}, d_model=2048, d_ff=8192, n_heads=16, n_kv_heads=4, head_dim=128)
    c.data.seq_len, c.train.batch_size = 2048, 16
    m = report.target_analysis(c, targets.parse("v5e-1"))["memory"]
    assert not m["fits"] and m["required_bytes"] > m["available_bytes"] > 15 * 2**30
    assert "Ran out of memory" in m["error"]


@pytest.mark.slow
def test_cli_json_for_a_target():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxsys.analyze",
            "--config",
            "configs/tiny.py",
            "--target",
            "v5e-8",
            "--config.mesh.fsdp=-1",
            "--config.mesh.tensor=2",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TPU_ACCELERATOR_TYPE" not in out.stderr and "TPU_WORKER_HOSTNAMES" not in out.stderr
    r = json.loads(out.stdout)
    assert r["config"]["mesh"]["fsdp"] == 4 and r["target"]["generation"] == "v5e"
    assert r["target"]["memory"]["device"]["peak_bytes"] > 0 and r["memory"]["peak_bytes_per_device"] > 0
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxsys.analyze",
            "--config",
            "configs/tiny.py",
            "--target",
            "v5e-8",
            "--config.mesh.fsdp=-1",
            "--no-cpu",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert text.returncode == 0 and "TPU compiler (libtpu" in text.stdout and "HBM 16.00 GiB: fits" in text.stdout


@pytest.mark.parametrize("name", [pytest.param("pipe2-seq2-tensor2-ring", marks=pytest.mark.slow), "ep-ragged-ep8"])
def test_what_cpu_refuses_compiles_for_gpu(name):
    """Ring context parallelism under a pipeline and the ragged all-to-all dispatch, refused on CPU,
    compile with XLA:GPU (tests/test_tpu_compile.py does the same for TPU)."""
    from tests.test_tpu_compile import LAYOUTS, compile_on_tpu

    config = LAYOUTS[name]()
    text = compile_on_tpu(config, targets.devices(targets.parse("h100-8"))).as_text()
    assert ("ragged-all-to-all" if "ragged" in name else "collective-permute") in text


@pytest.mark.slow  # CI time
def test_multi_slice_dcn_collectives_are_counted_over_the_dcn_axis():
    """Across slices the TPU compiler hands the data-parallel all-reduce to the megascale runtime
    (host-transfer sends over DCN), asynchronous and overlapped; its bytes are the formula's."""
    config = _config(dict(data=2, fsdp=4))
    config.dcn.data = 2
    r = report.analyze_target(config, targets.parse("v5p:2x2x1", slices=2), jax.devices(), flops=False)
    rows = [row for row in r["target"]["collectives"] if row["axes"] == ["data"] and not row["scalar"]]
    assert rows and all(row["kind"] == "all_reduce" and row["async"] == row["count"] for row in rows)
    formula = report.by_kind_axes(r["collectives_formula"])[("all_reduce", ("data",))][1]
    assert sum(row["bytes"] for row in rows) == pytest.approx(formula, rel=1e-3)


BRANCHES = """HloModule b

%light (x: f32[8,16]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  ROOT %n = f32[8,16]{1,0} negate(%x)
}

%heavy (x: f32[8,16]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[16,16]{1,0} constant({...})
  ROOT %d = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (i: s32[], x: f32[8,16]) -> f32[8,16] {
  %i = s32[] parameter(0)
  %x = f32[8,16]{1,0} parameter(1)
  ROOT %c = f32[8,16]{1,0} conditional(%i, %x, %x), branch_computations={%light, %heavy}
}
"""


def test_a_conditional_costs_its_heaviest_branch():
    module = hlo.parse(BRANCHES)
    assert module.conditionals == 1 and "light" not in module.executions
    assert module.matmul_flops() == 2 * 8 * 16 * 16
