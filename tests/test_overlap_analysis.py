"""What the analysis reads of overlap in a compiled schedule (`jaxsys/analysis/hlo.py`,
`report.overlap_summary`): per collective, async or not, the compute between its start and done,
and the time that hides; on small HLO modules written after real compiler output, and on a real
v5e-8 fsdp 8 step (libtpu, ahead of time).

- the TPU's async collective fusions (v5e): a start fusion, continuation fusions (a gather step
  fused with a matmul) and a done fusion are one asynchronous all-gather, paired by data flow;
  two interleaved chains (the second chain's matmul reads the first's) stay apart;
- `*-start`/`*-done` pairs (XLA:GPU's all-gather / reduce-scatter / all-reduce, the TPU's
  collective-permute), an `async-start` wrapping a reduce-scatter, and XLA:GPU's `"is_sync":true`
  pairs (synchronous);
- compute between start and done: a fusion's matmul, a loop times its trip count, a call's body, a
  conditional's cheapest branch.
"""

import math
import re

import jax
import pytest

from jaxsys.analysis import cost_model, hlo, report, targets
from tests.helpers import small_config

FSDP8 = {"data": 1, "pipe": 1, "fsdp": 8, "expert": 1, "seq": 1, "tensor": 1}
DATA8 = {"data": 8, "pipe": 1, "fsdp": 1, "expert": 1, "seq": 1, "tensor": 1}

# The v5e form, as libtpu 0.0.48.1 writes it (layouts, the 9-element state tuple, the continuation
# fusions' 11-element output with the matmul first, `continuation_config`), shapes made small.
_STATE = (
    "(bf16[1,4,128]{2,1,0:T(8,128)(2,1)S(1)}, bf16[1,32,128]{2,1,0:T(8,128)(2,1)S(1)}, s32[2]{0:S(4)}, "
    "u32[]{:S(2)}, u32[]{:S(2)}, /*index=5*/u32[]{:S(2)}, u32[]{:S(2)}, u32[]{:S(2)}, u32[]{:S(2)})"
)
_CONT_OUT = (
    "(f32[32,128]{0,1:S(1)}, bf16[1,4,128]{2,1,0:T(8,128)(2,1)S(1)}, bf16[1,32,128]{2,1,0:T(8,128)(2,1)S(1)}, "
    "bf16[1,32,128]{2,1,0:T(8,128)(2,1)S(1)}, s32[2]{0:S(4)}, /*index=5*/u32[]{:S(2)}, u32[]{:S(2)}, "
    "u32[]{:S(2)}, u32[]{:S(2)}, u32[]{:S(2)}, /*index=10*/u32[]{:S(2)})"
)
_GROUPS = "replica_groups=mesh['data'=1,'pipe'=1,'fsdp'=8,'expert'=1,'seq'=1,'tensor'=1] {'fsdp'}"


def _gather(name, operand, flags, layout="{2,1,0:T(8,128)(2,1)S(1)}"):
    return (
        f"  %{name} = bf16[1,32,128]{layout} all-gather(%{operand}), channel_id=8, {_GROUPS}, dimensions={{1}}, "
        'use_global_device_ids=true, frontend_attributes={chain_id="6"}, backend_config={"flag_configs":[],'
        '"barrier_config":{"barrier_type":"CUSTOM","id":"0"},"scoped_memory_configs":[],'
        f'"async_collective_fusion_config":{{"flag_start":"{flags[0]}","flag_end":"{flags[1]}"}},'
        '"used_scoped_memory_configs":[]}'
    )


def _start_body(n):
    return f"""%fused_computation.{n} (param_0.{n}: bf16[1,4,128]) -> {_STATE} {{
  %param_0.{n} = bf16[1,4,128]{{2,1,0:T(8,128)(2,1)S(1)}} parameter(0)
{_gather(f"all-gather.{n}", f"param_0.{n}", (-1, -1), "{2,1,0:T(8,128)(2,1)}")}
  ROOT %custom-call.{n} = {_STATE} custom-call(%all-gather.{n}), custom_call_target="AsyncCollectiveStart"
}}
"""


def _state_params(n):
    shapes = ["bf16[1,4,128]", "bf16[1,32,128]", "s32[2]"] + ["u32[]"] * 6
    return shapes, [f"param_{i}.{n}" for i in range(9)]


def _continuation_body(n, lhs, rhs):
    shapes, names = _state_params(n)
    header = ", ".join(f"{p}: {s}" for p, s in zip(names, shapes))
    lines = [
        f"  %{p} = {s}{{:S(2)}} parameter({i})" if s == "u32[]" else f"  %{p} = {s} parameter({i})"
        for i, (p, s) in enumerate(zip(names, shapes))
    ]
    rest = ", ".join(names[2:])
    return f"""%async_collective_fusion.{n} ({header}, param_9.{n}: {lhs}, param_10.{n}: {rhs}) -> {_CONT_OUT} {{
  %param_9.{n} = {lhs}{{1,0:T(8,128)S(1)}} parameter(9)
  %param_10.{n} = {rhs}{{0,1:T(8,128)(2,1)S(1)}} parameter(10)
  %convolution.{n} = f32[32,128]{{0,1:S(1)}} convolution(%param_9.{n}, %param_10.{n}), dim_labels=bf_io->bf
{chr(10).join(lines)}
{_gather(f"all-gather.{n}", f"param_0.{n}", (2, 8))}
  ROOT %tuple.{n} = {_CONT_OUT} tuple(%convolution.{n}, %param_0.{n}, %param_1.{n}, %all-gather.{n}, {rest})
}}
"""


def _done_body(n):
    shapes, names = _state_params(n)
    header = ", ".join(f"{p}: {s}" for p, s in zip(names, shapes))
    lines = [f"  %{p} = {s} parameter({i})" for i, (p, s) in enumerate(zip(names, shapes))]
    rest = ", ".join(f"%{p}" for p in names[2:])
    return f"""%fused_computation.{n} ({header}) -> bf16[1,32,128] {{
{chr(10).join(lines)}
{_gather(f"all-gather.{n}", f"param_0.{n}", (2, 8), "{2,1,0:T(8,128)(2,1)}")}
  ROOT %custom-call.{n} = bf16[1,32,128]{{2,1,0:T(8,128)(2,1)S(1)}} custom-call(%param_0.{n}, %param_1.{n}, %all-gather.{n}, {rest}), custom_call_target="AsyncCollectiveDone"
}}
"""


def _gtes(source, prefix, indices, shapes):
    return [f"  %{prefix}.{i} = {shapes[i]} get-tuple-element(%{source}), index={i}" for i in indices]


def _async_fusion_module() -> str:
    state = re.findall(r"(?:bf16|s32|u32)\[[^\]]*\]\{[^}]*\}", _STATE)
    cont = re.findall(r"(?:f32|bf16|s32|u32)\[[^\]]*\]\{[^}]*\}", _CONT_OUT)
    cont_config = (
        'backend_config={"flag_configs":[],"scoped_memory_configs":[],"continuation_config":'
        '{"output_tuple_original_start":"0","output_tuple_original_end":"0",'
        '"operand_original_start":"9","operand_original_end":"10"},"used_scoped_memory_configs":[]}'
    )

    def continuation(name, chain, lhs, rhs, n):
        ops = ", ".join(f"%{chain}.{i}" for i in range(9))
        return (
            f"  %{name} = {_CONT_OUT} fusion({ops}, %{lhs}, %{rhs}), kind=kOutput, "
            f"calls=%async_collective_fusion.{n}, {cont_config}"
        )

    def done(name, source, n):
        ops = ", ".join(f"%{source}.{i}" for i in (1, 2, 4, 5, 6, 7, 8, 9, 10))
        return (
            f"  %{name} = bf16[1,32,128]{{2,1,0:T(8,128)(2,1)S(1)}} fusion({ops}), kind=kCustom, "
            f"output_to_operand_aliasing={{{{}}: (1, {{}})}}, calls=%fused_computation.{n}"
        )

    entry = [
        "  %shard_a = bf16[1,4,128]{2,1,0:T(8,128)(2,1)S(1)} parameter(0)",
        "  %shard_b = bf16[1,4,128]{2,1,0:T(8,128)(2,1)S(1)} parameter(1)",
        "  %x = f32[32,64]{1,0:T(8,128)S(1)} parameter(2)",
        "  %w = bf16[64,128]{0,1:T(8,128)(2,1)S(1)} parameter(3)",
        "  %w2 = bf16[128,128]{0,1:T(8,128)(2,1)S(1)} parameter(4)",
        f"  %async-collective-start = {_STATE} fusion(%shard_a), kind=kCustom, "
        "output_to_operand_aliasing={{0}: (0, {})}, calls=%fused_computation.1",
        *_gtes("async-collective-start", "gs_a", range(9), state),
        continuation("fusion.1", "gs_a", "x", "w", 2),
        f"  %async-collective-start.1 = {_STATE} fusion(%shard_b), kind=kCustom, "
        "output_to_operand_aliasing={{0}: (0, {})}, calls=%fused_computation.4",
        *_gtes("async-collective-start.1", "gs_b", range(9), state),
        *_gtes("fusion.1", "gc_a", range(11), cont),
        # chain b's continuation multiplies chain a's matmul result: data flow that is not the state
        continuation("fusion.2", "gs_b", "gc_a.0", "w2", 5),
        done("async-collective-done", "gc_a", 3),
        "  %fusion.3 = f32[32,128]{1,0} fusion(%gc_a.0, %w2), kind=kOutput, calls=%fused_dot",
        *_gtes("fusion.2", "gc_b", range(11), cont),
        done("async-collective-done.1", "gc_b", 6),
        _gather("all-gather.9", "shard_a", (-1, -1), "{2,1,0:T(8,128)(2,1)}"),
        "  ROOT %out = (bf16[1,32,128]{2,1,0:T(8,128)(2,1)S(1)}, bf16[1,32,128]{2,1,0:T(8,128)(2,1)S(1)}, "
        "f32[32,128]{1,0}, bf16[1,32,128]{2,1,0:T(8,128)(2,1)}) tuple(%async-collective-done, "
        "%async-collective-done.1, %fusion.3, %all-gather.9)",
    ]
    fused_dot = """%fused_dot (p0: f32[32,128], p1: bf16[128,128]) -> f32[32,128] {
  %p0 = f32[32,128]{1,0} parameter(0)
  %p1 = bf16[128,128]{1,0} parameter(1)
  ROOT %d = f32[32,128]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    return "\n".join(
        [
            "HloModule jit__local_step, is_scheduled=true",
            "",
            _start_body(1),
            _continuation_body(2, "f32[32,64]", "bf16[64,128]"),
            _done_body(3),
            _start_body(4),
            _continuation_body(5, "f32[32,128]", "bf16[128,128]"),
            _done_body(6),
            fused_dot,
            "ENTRY %main (shard_a: bf16[1,4,128], shard_b: bf16[1,4,128], x: f32[32,64], w: bf16[64,128], "
            "w2: bf16[128,128]) -> (bf16[1,32,128], bf16[1,32,128], f32[32,128], bf16[1,32,128]) {",
            *entry,
            "}",
            "",
        ]
    )


MATMUL_A, MATMUL_B = 2 * 32 * 64 * 128, 2 * 32 * 128 * 128  # continuation a's, b's (and fusion.3's)


def test_async_collective_fusions_count_each_gather_once_with_the_matmuls_between():
    module = hlo.parse(_async_fusion_module())
    found = {c.name: c for c in module.collectives(FSDP8)}
    assert set(found) == {"async-collective-start", "async-collective-start.1", "all-gather.9"}
    a, b, sync = found["async-collective-start"], found["async-collective-start.1"], found["all-gather.9"]
    for c in (a, b):
        assert (c.kind, c.axes, c.group_size, c.form) == ("all_gather", ("fsdp",), 8, "async-fusion")
        assert c.is_async and c.operand_bytes == 4 * 128 * 2 and c.dtype == "bf16"
    assert a.done == "async-collective-done" and b.done == "async-collective-done.1"  # not crossed
    # a: its own continuation and b's (the starts and dones of other chains are not compute)
    assert (a.overlapped_ops, a.overlapped_flops) == (2, MATMUL_A + MATMUL_B)
    # b: its own continuation and the plain matmul fusion after a's done
    assert (b.overlapped_ops, b.overlapped_flops) == (2, 2 * MATMUL_B)
    assert (sync.is_async, sync.form, sync.overlapped_ops) == (False, "sync", 0)
    assert module.matmul_flops() == MATMUL_A + 2 * MATMUL_B


START_DONE = """HloModule jit__local_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_dot (p0: f32[32,64], p1: f32[64,64]) -> f32[32,64] {
  %p0 = f32[32,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  ROOT %d = f32[32,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%branch_heavy (t: (f32[32,64], f32[64,64])) -> f32[32,64] {
  %t = (f32[32,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %a = f32[32,64]{1,0} get-tuple-element(%t), index=0
  %b = f32[64,64]{1,0} get-tuple-element(%t), index=1
  %f1 = f32[32,64]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot
  ROOT %f2 = f32[32,64]{1,0} fusion(%f1, %b), kind=kOutput, calls=%fused_dot
}

%branch_light (t: (f32[32,64], f32[64,64])) -> f32[32,64] {
  %t = (f32[32,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %a = f32[32,64]{1,0} get-tuple-element(%t), index=0
  %b = f32[64,64]{1,0} get-tuple-element(%t), index=1
  ROOT %f1 = f32[32,64]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot
}

%cond (p: (s32[], f32[32,64], f32[64,64])) -> pred[] {
  %p = (s32[], f32[32,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[32,64], f32[64,64])) -> (s32[], f32[32,64], f32[64,64]) {
  %p = (s32[], f32[32,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %a = f32[32,64]{1,0} get-tuple-element(%p), index=1
  %b = f32[64,64]{1,0} get-tuple-element(%p), index=2
  %f = f32[32,64]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[32,64]{1,0}, f32[64,64]{1,0}) tuple(%next, %f, %b)
}

%called (a: f32[32,64], b: f32[64,64]) -> f32[32,64] {
  %a = f32[32,64]{1,0} parameter(0)
  %b = f32[64,64]{1,0} parameter(1)
  ROOT %f = f32[32,64]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot
}

%wrapped_reduce_scatter (p: f32[256,64]) -> f32[32,64] {
  %p = f32[256,64]{1,0} parameter(0)
  ROOT %rs = f32[32,64]{1,0} reduce-scatter(%p), channel_id=6, replica_groups=mesh['data'=8,'pipe'=1,'fsdp'=1,'expert'=1,'seq'=1,'tensor'=1] {'data'}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[32,64], w: f32[64,64], idx: s32[]) -> (f32[32,64], f32[32,64], f32[32,64], f32[32,64]) {
  %x = f32[32,64]{1,0} parameter(0)
  %w = f32[64,64]{1,0} parameter(1)
  %idx = s32[] parameter(2)
  %all-gather-start = ((f32[32,64]{1,0}), f32[256,64]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=mesh['data'=8,'pipe'=1,'fsdp'=1,'expert'=1,'seq'=1,'tensor'=1] {'data'}, dimensions={0}, use_global_device_ids=true, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false,"is_pipelined":false}}
  %fusion.1 = f32[32,64]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %all-gather-done = f32[256,64]{1,0} all-gather-done(%all-gather-start)
  %reduce-scatter-start = ((f32[256,64]{1,0}), f32[32,64]{1,0}) reduce-scatter-start(%all-gather-done), channel_id=2, replica_groups=mesh['data'=8,'pipe'=1,'fsdp'=1,'expert'=1,'seq'=1,'tensor'=1] {'data'}, use_global_device_ids=true, dimensions={0}, to_apply=%add, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false,"is_pipelined":false}}
  %branches = (f32[32,64]{1,0}, f32[64,64]{1,0}) tuple(%x, %w)
  %conditional = f32[32,64]{1,0} conditional(%idx, %branches, %branches), branch_computations={%branch_heavy, %branch_light}
  %reduce-scatter-done = f32[32,64]{1,0} reduce-scatter-done(%reduce-scatter-start)
  %all-reduce-start = ((f32[32,64]{1,0}), f32[32,64]{1,0}) all-reduce-start(%x), channel_id=3, replica_groups=mesh['data'=8,'pipe'=1,'fsdp'=1,'expert'=1,'seq'=1,'tensor'=1] {'data'}, use_global_device_ids=true, to_apply=%add, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":true,"is_pipelined":false}}
  %fusion.2 = f32[32,64]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %all-reduce-done = f32[32,64]{1,0} all-reduce-done(%all-reduce-start), backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":true,"is_pipelined":false}}
  %collective-permute-start = (f32[32,64]{1,0:S(1)}, f32[32,64]{1,0:S(1)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}
  %zero = s32[] constant(0)
  %init = (s32[], f32[32,64]{1,0}, f32[64,64]{1,0}) tuple(%zero, %x, %w)
  %loop = (s32[], f32[32,64]{1,0}, f32[64,64]{1,0}) while(%init), condition=%cond, body=%body
  %call = f32[32,64]{1,0} call(%x, %w), to_apply=%called
  %collective-permute-done = f32[32,64]{1,0:S(1)} collective-permute-done(%collective-permute-start)
  %reduce-scatter.1-start = ((f32[256,64]{1,0}), f32[32,64]{1,0}, s32[]) async-start(%all-gather-done), calls=%wrapped_reduce_scatter
  %fusion.3 = f32[32,64]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %reduce-scatter.1-done = f32[32,64]{1,0} async-done(%reduce-scatter.1-start)
  %looped = f32[32,64]{1,0} get-tuple-element(%loop), index=1
  ROOT %out = (f32[32,64]{1,0}, f32[32,64]{1,0}, f32[32,64]{1,0}, f32[32,64]{1,0}) tuple(%reduce-scatter-done, %all-reduce-done, %collective-permute-done, %reduce-scatter.1-done)
}
"""
DOT = 2 * 32 * 64 * 64


def test_start_done_pairs_async_start_and_synchronous_pairs():
    module = hlo.parse(START_DONE)
    found = {c.name: c for c in module.collectives(DATA8)}
    assert set(found) == {
        "all-gather-start",
        "reduce-scatter-start",
        "all-reduce-start",
        "collective-permute-start",
        "reduce-scatter.1-start",  # the reduce-scatter inside its async-start is not counted again
    }
    ag, rs, ar = found["all-gather-start"], found["reduce-scatter-start"], found["all-reduce-start"]
    cp, wrapped = found["collective-permute-start"], found["reduce-scatter.1-start"]
    assert (ag.kind, ag.is_async, ag.done, ag.overlapped_ops, ag.overlapped_flops) == (
        "all_gather",
        True,
        "all-gather-done",
        1,
        DOT,
    )
    assert (ag.axes, ag.group_size, ag.operand_bytes) == (("data",), 8, 32 * 64 * 4)
    # a conditional between start and done hides its cheapest branch (one dot, not the heavy two)
    assert (rs.kind, rs.is_async, rs.overlapped_ops, rs.overlapped_flops) == ("reduce_scatter", True, 1, DOT)
    # XLA:GPU's is_sync pairs run synchronously: nothing overlaps them
    assert (ar.kind, ar.is_async, ar.form, ar.overlapped_ops, ar.overlapped_flops) == (
        "all_reduce",
        False,
        "sync",
        0,
        0,
    )
    # a loop between start and done hides its trip count times its body; a call its body
    assert (cp.kind, cp.axes, cp.is_async, cp.overlapped_ops) == ("collective_permute", ("data",), True, 2)
    assert cp.overlapped_flops == 4 * DOT + DOT
    assert (wrapped.kind, wrapped.is_async, wrapped.done, wrapped.form) == (
        "reduce_scatter",
        True,
        "reduce-scatter.1-done",
        "start-done",
    )
    assert (wrapped.overlapped_ops, wrapped.overlapped_flops, wrapped.operand_bytes) == (1, DOT, 256 * 64 * 4)
    # the step's matmuls count the conditional's heaviest branch (every device waits for it)
    assert module.matmul_flops() == DOT * (1 + 2 + 1 + 4 + 1 + 1)


def _seconds(c, bandwidth, peak):
    t = report._ring_bytes(c) / min(bandwidth[a] for a in c.axes)
    hidden = min(t, c.overlapped_flops / peak) if c.is_async else 0.0
    return c.executions * t, c.executions * hidden


def test_overlap_summary_hides_each_collective_up_to_the_matmuls_between():
    config = small_config(dict(data=8))
    hw = targets.hardware(targets.parse("v5e-8"))
    bandwidth = cost_model.axis_bandwidth({a: config.mesh[a] for a in config.mesh}, hw, dict(config.dcn))
    peak = hw.peak(config.model.compute_dtype)
    found = hlo.parse(START_DONE).collectives(DATA8)
    s = report.overlap_summary(START_DONE, config, hw)
    time = sum(_seconds(c, bandwidth, peak)[0] for c in found)
    hidden = sum(_seconds(c, bandwidth, peak)[1] for c in found)
    assert s["time_s"] == pytest.approx(time) and s["hidden_s"] == pytest.approx(hidden)
    assert s["exposed_s"] == pytest.approx(time - hidden) and 0 < hidden < time
    assert s["exposed_s"] == pytest.approx(report.exposed_comm_s(found, config, hw))
    assert (s["count"], s["async"], s["overlapped"]) == (5, 4, 4)
    ring = {c.name: report._ring_bytes(c) for c in found}
    assert s["overlapped_fraction"] == pytest.approx(1 - ring["all-reduce-start"] / sum(ring.values()))
    assert s["beside_matmul_fraction"] == s["overlapped_fraction"]  # every window here holds a dot
    rows = {(r["kind"], tuple(r["axes"])): r for r in s["rows"]}
    assert rows[("reduce_scatter", ("data",))]["count"] == 2 and rows[("all_reduce", ("data",))]["async"] == 0
    # another peak (the script's bf16 figure) and a selection
    only = report.overlap_summary(found, config, hw, select=lambda c: c.kind == "all_gather", peak_flops=peak / 2)
    assert only["count"] == 1 and only["hidden_s"] == pytest.approx(min(only["time_s"], DOT / (peak / 2)))


def _tpu_compiled_text(config, target):
    from tests.test_tpu_compile import compile_on_tpu

    return compile_on_tpu(config, targets.devices(targets.parse(target))).as_text()


@pytest.mark.skipif(not targets.has_libtpu(), reason="needs libtpu (the TPU compiler, ahead of time)")
def test_real_v5e_fsdp8_step_counts_each_gather_once():
    """On a v5e-8 fsdp 8 train step (tiny model), the all-gathers counted equal the distinct ones:
    the async-collective-start fusions paired by name with their async-collective-done (the pairing
    scripts/fsdp_prefetch_schedule.py used to do), plus the plain all-gathers outside those fusions,
    each times its computation's executions. Before, the gather steps inside the fusions were each
    counted as a synchronous all-gather (100 for 30 here; 150 for 58 on the doc's mid model)."""
    config = small_config(dict(fsdp=8))
    text = _tpu_compiled_text(config, "v5e-8")
    module = hlo.parse(text)
    found = module.collectives(FSDP8)
    gathers = [c for c in found if c.kind == "all_gather"]
    starts = {
        c: [i for i in insts if i.name.startswith("async-collective-start")] for c, insts in module.computations.items()
    }
    expected_async = 0
    for comp, insts in starts.items():
        names = {i.name for i in module.computations[comp]}
        for start in insts:
            assert start.name.replace("start", "done") in names
            expected_async += module.executions.get(comp, 0)
    plain = sum(
        module.executions[comp]
        for comp in module.executions
        if comp not in module.async_bodies
        for i in module.computations[comp]
        if i.opcode == "all-gather"
    )
    async_count = sum(c.executions for c in gathers if c.is_async)
    assert async_count == expected_async > 0
    assert sum(c.executions for c in gathers) == expected_async + plain
    for c in gathers:
        if c.form == "async-fusion":
            assert c.done == c.name.replace("start", "done")  # data flow agrees with the names
    # the continuation fusions' matmuls sit between start and done
    assert any(c.overlapped_flops > 0 for c in gathers if c.is_async)
    assert sum(c.executions for c in gathers) == 30, "the tiny model's count on libtpu 0.0.48.1"
    s = report.overlap_summary(module, config, targets.hardware(targets.parse("v5e-8")))
    assert 0 < s["overlapped_fraction"] < 1 and 0 < s["hidden_s"] < s["time_s"]
    assert s["exposed_s"] == pytest.approx(s["time_s"] - s["hidden_s"])


def test_analysis_reports_the_cpu_schedule_overlap_beside_the_cost_model():
    """XLA:CPU runs every collective synchronously: all exposed, and for a layout whose formula is
    exact the cost model's communication time equals the schedule's."""
    config = small_config(dict(fsdp=8))
    r = report.analyze(config, devices=jax.devices()[:8], flops=False)
    ov = r["overlap"]
    assert ov["schedule"] == "XLA:CPU" and ov["async"] == 0 and ov["hidden_s"] == 0
    assert ov["exposed_s"] == ov["time_s"] > 0
    rows = {(row["kind"], tuple(row["axes"])): row for row in ov["rows"]}
    scalars = rows[("all_reduce", ("fsdp",))]["time_s"]  # the loss and gradient norm: not in the formula
    assert ov["cost_model"]["comm_s"] == pytest.approx(ov["time_s"] - scalars, rel=1e-9)
    assert ov["cost_model"]["exposed_s"] == ov["cost_model"]["comm_s"]
    measured = report.by_kind_axes(r["collectives"])  # the written-out StableHLO's count
    assert rows[("all_gather", ("fsdp",))]["count"] == measured[("all_gather", ("fsdp",))][0]
    text = report.format_report(r)
    assert "overlap (XLA:CPU schedule" in text and "cost model" in text
    assert math.isclose(sum(row["time_s"] for row in ov["rows"]), ov["time_s"])
