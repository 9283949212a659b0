"""What a config costs, measured from the compiled train step beside the formulas of
`cost_model`: memory per device, every collective with its axes, count and bytes, FLOPs, and a
roofline step time and MFU on a hardware profile. Nothing is materialised: the state is abstract,
so a pod-size layout compiles on a laptop against fake CPU devices.
"""

from __future__ import annotations

import collections
import math

import jax
import numpy as np

from jaxsys.analysis import collectives as collectives_lib
from jaxsys.analysis import cost_model
from jaxsys.analysis import flops as flops_lib
from jaxsys.config import MESH_AXES
from jaxsys.mesh import make_mesh
from jaxsys.models import params as params_lib


def _shard_bytes(abstract_tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (device 0's shard)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def _batch(program):
    c = program.config
    return jax.ShapeDtypeStruct((c.train.batch_size, c.data.seq_len + 1), np.int32,
                                sharding=program.batch_sharding)


def measured_collectives(found, mesh_sizes) -> list[dict]:
    """Group parsed collectives by (kind, axes, dtype): count, operand bytes, ring bytes."""
    groups = collections.OrderedDict()
    for c in found:
        scalar = c.shape == ()  # the loss and the gradient norm, kept apart from the techniques
        key = (c.kind, c.axes, c.dtype, scalar)
        n = math.prod(mesh_sizes[a] for a in c.axes)
        row = groups.setdefault(key, {"kind": c.kind, "axes": list(c.axes), "dtype": c.dtype,
                                      "scalar": scalar, "count": 0, "operand_bytes": 0, "bytes": 0.0})
        row["count"] += 1
        row["operand_bytes"] += c.operand_bytes
        row["bytes"] += cost_model.ring_bytes(c.kind, c.operand_bytes, n)
    return list(groups.values())


def by_kind_axes(rows: list[dict], scalar: bool = False) -> dict:
    """{(kind, axes): [count, bytes]} of collective rows (measured or formula), the scalar metric
    all-reduces kept apart unless `scalar`."""
    out = collections.defaultdict(lambda: [0, 0.0])
    for row in rows:
        if row.get("scalar", False) == scalar:
            key = (row["kind"], tuple(row["axes"]))
            out[key][0] += row["count"]
            out[key][1] += row["bytes"]
    return dict(out)


def memory_report(program, compiled) -> dict:
    """Per-device memory of a compiled step: XLA's buffer assignment, with the state's shards
    (exact, from the shardings) broken out, beside the ZeRO formula."""
    config, mesh = program.config, program.mesh
    stats = compiled.memory_analysis()
    state = program.abstract_state()
    params_b, opt_b = _shard_bytes(state.params), _shard_bytes(state.opt_state)
    itemsize = np.dtype(config.model.param_dtype).itemsize
    # gradients after the reduction: full at stages 0-1, the 1/N slice after ZeRO-2's reduce-scatter
    grad_pspecs = program.grad_pspecs if config.train.zero_stage == 2 else program.param_pspecs
    grads_b = sum(math.prod(jax.sharding.NamedSharding(mesh, spec).shard_shape(s.shape)) * itemsize
                  for s, spec in zip(jax.tree.leaves(program.specs, is_leaf=params_lib.is_spec),
                                     jax.tree.leaves(grad_pspecs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))))
    # XLA:CPU's peak_memory_in_bytes leaves temporaries out; live arguments + outputs + temporaries
    # (less what the outputs alias from the donated arguments) is the bound XLA's own tools report.
    peak = int(stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
               + stats.temp_size_in_bytes)
    batch_b = _shard_bytes(_batch(program))
    return {
        "peak_bytes_per_device": peak,
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "params_bytes": params_b,
        "optimizer_bytes": opt_b,
        "grads_bytes": grads_b,
        "activations_and_workspace_bytes": max(peak - params_b - opt_b - grads_b - batch_b, 0),
        "formula": cost_model.zero_memory(config),
    }


def lower_unrolled(program):
    """The step with the layer scan written out: each executed collective appears once per
    execution in its text, and XLA's cost analysis (which counts a loop body once) sees every layer."""
    from jaxsys import train
    unrolled = train.build(program.config, program.mesh, unroll_layers=True)
    return unrolled.train_step_fn().lower(program.abstract_state(), _batch(unrolled))


def analyze(config, hardware: str = "cpu", devices=None, flops: bool = True) -> dict:
    """Compile `config`'s train step for the current devices (or `devices`) and report.
    `flops=False` skips compiling the written-out step (FLOPs then come from the formula)."""
    from jaxsys import train  # the analysis is of train's program

    hw = cost_model.hardware(hardware)
    mesh = make_mesh(config, devices)
    sizes = {a: int(config.mesh[a]) for a in MESH_AXES}
    n_devices = math.prod(sizes.values())

    program = train.build(config, mesh)
    compiled = program.train_step_fn().lower(program.abstract_state(), _batch(program)).compile()
    memory = memory_report(program, compiled)
    lowered = lower_unrolled(program)
    measured = measured_collectives(collectives_lib.parse(lowered.as_text(), sizes), sizes)
    cost = lowered.compile().cost_analysis() if flops else {}

    tokens = config.train.batch_size * config.data.seq_len
    per_device = lambda per_token: per_token * tokens / n_devices
    model_flops = per_device(flops_lib.train_flops_per_token(config.model, config.data.seq_len))
    analytic = model_flops
    if config.model.remat == "full":  # the forward runs twice: 8N instead of 6N
        analytic += per_device(flops_lib.forward_flops_per_token(config.model, config.data.seq_len))
    xla_flops = float(cost.get("flops", 0.0))
    predicted, caveats = cost_model.predicted_collectives(config)
    per_axes = collections.defaultdict(float)
    for row in measured:
        per_axes[tuple(row["axes"])] += row["bytes"]
    roofline = cost_model.roofline(config, hw, xla_flops or analytic,
                                   float(cost.get("bytes accessed", 0.0)), per_axes)
    return {
        "config": {"mesh": sizes, "devices": n_devices, "hardware": hw.name,
                   "zero_stage": config.train.zero_stage,
                   "sequence_parallel": bool(config.parallel.sequence_parallel),
                   "remat": config.model.remat},
        "params_count": params_lib.count(program.specs),
        "memory": memory,
        "collectives": measured,
        "collectives_formula": [dict(technique=r.technique, kind=r.kind, axes=list(r.axes),
                                     count=r.count, bytes=r.bytes) for r in predicted],
        "formula_caveats": caveats,
        "metric_scalars_formula": cost_model.metric_collectives(config),
        "flops_per_device": xla_flops,
        "flops_per_device_analytic": analytic,
        "model_flops_per_device": model_flops,
        "roofline": roofline,
        "fits": memory["peak_bytes_per_device"] <= hw.hbm_bytes,
    }


def startup_summary(program, compiled) -> str:
    """The one-line analysis a training run prints: memory from the step it compiled, collectives
    from the written-out step (tracing only, no second compile)."""
    memory = memory_report(program, compiled)
    sizes = dict(program.layout.mesh_sizes)
    rows = measured_collectives(collectives_lib.parse(lower_unrolled(program).as_text(), sizes), sizes)
    comm = sum(row["bytes"] for row in rows)
    kinds = ", ".join(f"{row['count']} {row['kind']}[{','.join(row['axes'])}]" for row in rows) or "no collectives"
    return (f"analysis: peak {_b(memory['peak_bytes_per_device'])}/device (params "
            f"{_b(memory['params_bytes'])}, optimizer {_b(memory['optimizer_bytes'])}); per step {kinds}; "
            f"{_b(comm)} sent/device")


# ----------------------------------------------------------------------------- printing


def _b(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def format_report(r: dict) -> str:
    c, m = r["config"], r["memory"]
    layout = " x ".join(f"{a}={s}" for a, s in c["mesh"].items() if s > 1) or "1 device"
    out = [f"{r['params_count'] / 1e6:,.1f}M parameters on {layout} ({c['devices']} devices), "
           f"ZeRO stage {c['zero_stage']}, SP {c['sequence_parallel']}, remat {c['remat']}; "
           f"hardware profile {c['hardware']}", "",
           "memory per device        measured       formula (ZeRO)"]
    f = m["formula"]
    out += [f"  parameters             {_b(m['params_bytes']):>12}   {_b(f['params']):>12}",
            f"  optimizer state        {_b(m['optimizer_bytes']):>12}   {_b(f['optimizer']):>12}",
            f"  gradients (as held)    {_b(m['grads_bytes']):>12}   {_b(f['grads']):>12}",
            f"  activations+workspace  {_b(m['activations_and_workspace_bytes']):>12}",
            f"  peak (XLA)             {_b(m['peak_bytes_per_device']):>12}   "
            f"{'fits' if r['fits'] else 'DOES NOT FIT'} in the device memory", "",
            "collectives per step (measured)      count   operand bytes   ring bytes/device"]
    for row in r["collectives"]:
        name = f"{row['kind']}[{','.join(row['axes'])}] {row['dtype']}" + (" scalar" if row["scalar"] else "")
        out.append(f"  {name:<34} {row['count']:>5}   {_b(row['operand_bytes']):>13}   {_b(row['bytes']):>17}")
    out += ["", "collectives per step (formula)"]
    for row in r["collectives_formula"]:
        name = f"{row['kind']}[{','.join(row['axes'])}]"
        out.append(f"  {row['technique']:<52} {name:<24} x{row['count']:<4} {_b(row['bytes']):>12}")
    out += [f"  (+ {r['metric_scalars_formula']} scalar all-reduces: loss and gradient norm)"]
    out += [f"  caveat: {text}" for text in r["formula_caveats"]]
    rl = r["roofline"]
    out += ["", f"FLOPs per device per step: XLA {r['flops_per_device']:.3e}, analytic "
                f"{r['flops_per_device_analytic']:.3e} (model FLOPs {r['model_flops_per_device']:.3e})",
            f"roofline: compute {rl['compute_s'] * 1e3:.2f} ms, memory {rl['memory_s'] * 1e3:.2f} ms, "
            f"communication {rl['comm_s'] * 1e3:.2f} ms -> step {rl['step_s_overlapped'] * 1e3:.2f} ms "
            f"(overlapped) .. {rl['step_s_serial'] * 1e3:.2f} ms (serial); MFU "
            f"{rl['mfu_overlapped']:.1%} .. {rl['mfu_serial']:.1%}"]
    return "\n".join(out)
