"""What a config costs, measured from the compiled train step beside the formulas of
`cost_model`: memory per device, every collective with its axes, count and bytes, FLOPs, and a
roofline step time and MFU on a hardware profile. Nothing is materialised: the state is abstract,
so a pod-size layout compiles on a laptop against fake CPU devices.
"""

from __future__ import annotations

import collections
import math
import re
import time

import jax
import numpy as np

from jaxsys.analysis import collectives as collectives_lib
from jaxsys.analysis import cost_model
from jaxsys.analysis import flops as flops_lib
from jaxsys.analysis import hardware as hardware_lib
from jaxsys.config import MESH_AXES, ConfigError
from jaxsys.mesh import make_mesh
from jaxsys.models import params as params_lib


def _shard_bytes(abstract_tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (device 0's shard)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def _host_bytes(abstract_tree) -> int:
    """Bytes one device holds in host memory (memory kind pinned_host) of a tree of sharded structs."""
    return sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(abstract_tree)
        if leaf.sharding.memory_kind == "pinned_host"
    )


def offload_report(config, hw: hardware_lib.Hardware, program=None) -> dict | None:
    """What config.offload moves to the host: the state bytes by the formula (device / host), as
    the shardings place them (when `program` is given), ZeRO-Offload's own split for the same
    parameter count, and the host-link traffic per step with its time on `hw`. None without offload."""
    o = config.offload
    if not (o.optimizer or o.params or o.activations):
        return None
    out = {
        "options": {
            "optimizer": bool(o.optimizer),
            "optimizer_update": o.optimizer_update,
            "optimizer_fraction": float(o.optimizer_fraction),
            "params": bool(o.params),
            "activations": o.activations,
        },
        "formula": cost_model.offload_memory(config),
        "activations_to_host_bytes": cost_model.offloaded_activation_bytes(config),
        "traffic": cost_model.offload_traffic(config, hw),
    }
    psi = cost_model.zero_memory(config)["params"] / np.dtype(config.model.param_dtype).itemsize
    out["paper_zero_offload"] = {"psi_per_device": psi, **cost_model.paper_zero_offload_memory(psi)}
    if program is not None:
        state = program.abstract_state()
        out["placed"] = {"host_bytes": _host_bytes(state), "device_bytes": _shard_bytes(state) - _host_bytes(state)}
    return out


def _format_offload(off: dict | None) -> list[str]:
    if not off:
        return []
    o, f, t = off["options"], off["formula"], off["traffic"]
    what = []
    if o["optimizer"]:
        what.append(f"optimizer state ({o['optimizer_fraction']:.0%} of its bytes, {o['optimizer_update']} update)")
    if o["params"]:
        what.append("parameters")
    if o["activations"]:
        what.append(f"activations {o['activations']}")
    out = [
        "",
        "host offload: " + ", ".join(what),
        f"  model states per device    formula: device {_b(f['device_total'])}, host {_b(f['host_total'])}",
    ]
    if "placed" in off:
        out.append(
            f"                             as placed: device {_b(off['placed']['device_bytes'])}, "
            f"host {_b(off['placed']['host_bytes'])}"
        )
    p = off["paper_zero_offload"]
    out.append(
        f"  ZeRO-Offload's split for these {p['psi_per_device'] / 1e6:,.2f}M parameters per device: "
        f"device 2 psi = {_b(p['device'])} (fp16 params), host 14 psi = {_b(p['host'])} "
        "(fp16 grads + fp32 master weights and Adam moments)"
    )
    if o["activations"]:
        out.append(f"  activations to host per step: {_b(off['activations_to_host_bytes'])}")
    link = ", ".join(f"{k} {_b(v)}" for k, v in t["link_bytes"].items() if v)
    out.append(
        f"  host link per step: {_b(t['link_bytes_total'])} ({link or 'none'}) -> "
        f"{t['link_s'] * 1e3:.1f} ms; host update {t['host_update_s'] * 1e3:.1f} ms"
    )
    return out


def _batch(program):
    """The abstract global batch: tokens [B, T+1], or a data.Batch (tokens, segments, weights)."""
    return program.abstract_batch()


def measured_collectives(found, mesh_sizes) -> list[dict]:
    """Group parsed collectives by (kind, axes, dtype): count, operand bytes, ring bytes."""
    groups = collections.OrderedDict()
    for c in found:
        scalar = c.shape == ()  # the loss and the gradient norm, kept apart from the techniques
        key = (c.kind, c.axes, c.dtype, scalar)
        n = math.prod(mesh_sizes[a] for a in c.axes)
        row = groups.setdefault(
            key,
            {
                "kind": c.kind,
                "axes": list(c.axes),
                "dtype": c.dtype,
                "scalar": scalar,
                "count": 0,
                "operand_bytes": 0,
                "bytes": 0.0,
            },
        )
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
    # (of the trainable leaves: with LoRA the adapters alone)
    grad_pspecs = program.grad_pspecs if config.train.zero_stage == 2 else program.trainable_pspecs
    grads_b = sum(
        math.prod(jax.sharding.NamedSharding(mesh, spec).shard_shape(s.shape)) * itemsize
        for s, spec in zip(
            jax.tree.leaves(program.trainable_specs, is_leaf=params_lib.is_spec),
            jax.tree.leaves(grad_pspecs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
        )
    )
    if config.train.optimizer == "zo":  # two forwards: no gradient exists (jaxsys/optim/zo.py)
        grads_b = 0
    # XLA:CPU's peak_memory_in_bytes leaves temporaries out; live arguments + outputs + temporaries
    # (less what the outputs alias from the donated arguments) is the bound XLA's own tools report.
    peak = int(
        stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    )
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
    from jaxsys import program as program_lib

    unrolled = program_lib.build(program.config, program.mesh, unroll_layers=True)
    args = (program.abstract_state(), _batch(unrolled)) + (
        (program.abstract_state().params,) if program.needs_reference else ()
    )
    return unrolled.train_step_fn().lower(*args)


def analyze_inference(config, hw: hardware_lib.Hardware, devices=None, flops: bool = True) -> dict:
    """A quantized checkpoint's config (config.model.quant) is for inference: compile its forward
    pass over one global batch (the evaluation function) instead of a train step, and report
    memory, collectives, FLOPs and a forward roofline in which every weight byte is read once."""
    from jaxsys import program as program_lib
    from jaxsys.models import quant

    mesh = make_mesh(config, devices)
    sizes = {a: int(config.mesh[a]) for a in MESH_AXES}
    program = program_lib.build(config, mesh)
    params = program.abstract_state().params
    compiled = program.eval_loss_fn().lower(params, _batch(program)).compile()
    stats = compiled.memory_analysis()
    unrolled = program_lib.build(config, mesh, unroll_layers=True)
    lowered = unrolled.eval_loss_fn().lower(params, _batch(unrolled))
    measured = measured_collectives(collectives_lib.parse(lowered.as_text(), sizes), sizes)
    cost = lowered.compile().cost_analysis() if flops else {}
    n_devices = math.prod(sizes.values())
    tokens = config.train.batch_size * config.data.seq_len
    analytic = flops_lib.forward_flops_per_token(config.model, config.data.seq_len) * tokens / n_devices
    xla_flops = float(cost.get("flops", 0.0))
    params_b = _shard_bytes(params)
    dense = {k: v for k, v in params["layers"].items() if k in quant.CONTRACTED}
    compute_s = max(xla_flops, analytic) / hw.peak(config.model.compute_dtype)
    weights_s = params_b / hw.hbm_bytes_per_s
    peak = int(
        stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    )
    return {
        "mode": "inference",
        "config": {
            "mesh": sizes,
            "devices": n_devices,
            "hardware": hw.name,
            "quant": config.model.quant,
            "quant_group_size": config.model.quant_group_size,
            "quant_impl": config.model.quant_impl,
            "batch_tokens": tokens,
        },
        "params_count": sum(math.prod(a.shape) for a in jax.tree.leaves(params)),
        "memory": {
            "peak_bytes_per_device": peak,
            "params_bytes": params_b,
            "dense_weight_bytes": _shard_bytes(dense),
            "temp_bytes": int(stats.temp_size_in_bytes),
        },
        "collectives": measured,
        "flops_per_device": xla_flops,
        "flops_per_device_analytic": analytic,
        "roofline": {"compute_s": compute_s, "weights_s": weights_s, "forward_s": max(compute_s, weights_s)},
        "fits": peak <= hw.hbm_bytes,
    }


def _collective_lines(rows: list[dict]) -> list[str]:
    """One line per measured collective group: kind[axes] dtype, count, operand and ring bytes."""
    out = []
    for row in rows:
        name = f"{row['kind']}[{','.join(row['axes'])}] {row['dtype']}" + (" scalar" if row["scalar"] else "")
        out.append(f"  {name:<34} {row['count']:>5}   {_b(row['operand_bytes']):>13}   {_b(row['bytes']):>17}")
    return out


def format_inference_report(r: dict) -> str:
    c, m, rl = r["config"], r["memory"], r["roofline"]
    layout = " x ".join(f"{a}={s}" for a, s in c["mesh"].items() if s > 1) or "1 device"
    quant = c["quant"] + (f" (G={c['quant_group_size']})" if c["quant"].startswith("w4") else "")
    out = [
        f"inference forward of a {quant} checkpoint's model on {layout} ({c['devices']} devices), "
        f"{c['batch_tokens']:,} tokens per forward; hardware profile {c['hardware']}",
        "",
        f"memory per device: parameters {_b(m['params_bytes'])} (dense weights {_b(m['dense_weight_bytes'])}), "
        f"peak {_b(m['peak_bytes_per_device'])} ({'fits' if r['fits'] else 'DOES NOT FIT'})",
        "",
        "collectives per forward (measured)   count   operand bytes   ring bytes/device",
    ]
    out += _collective_lines(r["collectives"])
    out += [
        "",
        f"FLOPs per device per forward: XLA {r['flops_per_device']:.3e}, analytic {r['flops_per_device_analytic']:.3e}",
        f"roofline: compute {rl['compute_s'] * 1e3:.3f} ms, reading the weights {rl['weights_s'] * 1e3:.3f} ms "
        f"-> forward {rl['forward_s'] * 1e3:.3f} ms",
    ]
    if c["quant_impl"] == "pallas":
        out.append(
            "  caveat: XLA counts the FLOPs inside a Pallas kernel's loops once (interpret mode on "
            "CPU), so its figure misses most of the quantized matmuls; the analytic one counts them"
        )
    return "\n".join(out)


def analyze(config, hardware="cpu", devices=None, flops: bool = True) -> dict:
    """Compile `config`'s train step for the current devices (or `devices`) and report.
    `hardware` is a profile name (analysis/hardware.py PROFILES) or a `hardware.Hardware`.
    `flops=False` skips compiling the written-out step (FLOPs then come from the formula).
    A -1 mesh axis is resolved from the device count, in `config` itself."""
    from jaxsys import program as program_lib
    from jaxsys.analysis import hlo

    hw = hardware if isinstance(hardware, hardware_lib.Hardware) else hardware_lib.profile(hardware)
    if config.model.quant != "none":
        return analyze_inference(config, hw, devices, flops)
    mesh = make_mesh(config, devices)
    sizes = {a: int(config.mesh[a]) for a in MESH_AXES}
    n_devices = math.prod(sizes.values())

    program = program_lib.build(config, mesh)
    compiled = program.train_step_fn().lower(program.abstract_state(), _batch(program)).compile()
    memory = memory_report(program, compiled)
    lowered = lower_unrolled(program)
    measured = measured_collectives(collectives_lib.parse(lowered.as_text(), sizes), sizes)
    cost = lowered.compile().cost_analysis() if flops else {}

    tokens = config.train.batch_size * config.data.seq_len
    per_device = lambda per_token: per_token * tokens / n_devices
    model_flops = per_device(flops_lib.step_flops_per_token(config))
    analytic = model_flops
    if config.model.remat == "full" and config.train.optimizer != "zo":  # forward twice: 8N, not 6N
        analytic += per_device(flops_lib.forward_flops_per_token(config.model, config.data.seq_len))
    xla_flops = float(cost.get("flops", 0.0))
    predicted, caveats = cost_model.predicted_collectives(config)
    per_axes = collections.defaultdict(float)
    for row in measured:
        per_axes[tuple(row["axes"])] += row["bytes"]
    roofline = cost_model.roofline(config, hw, xla_flops or analytic, float(cost.get("bytes accessed", 0.0)), per_axes)
    scheduled = hlo.parse(compiled.as_text()).collectives(sizes, {a: int(config.dcn[a]) for a in MESH_AXES})
    return {
        "config": {
            "mesh": sizes,
            "dcn": {a: int(config.dcn[a]) for a in MESH_AXES},
            "devices": n_devices,
            "hardware": hw.name,
            "zero_stage": config.train.zero_stage,
            "sequence_parallel": bool(config.parallel.sequence_parallel),
            "remat": config.model.remat,
        },
        "params_count": params_lib.count(program.specs),
        "memory": memory,
        "collectives": measured,
        "collectives_formula": [
            dict(technique=r.technique, kind=r.kind, axes=list(r.axes), count=r.count, bytes=r.bytes) for r in predicted
        ],
        "formula_caveats": caveats,
        "metric_scalars_formula": cost_model.metric_collectives(config),
        "flops_per_device": xla_flops,
        "flops_per_device_analytic": analytic,
        "model_flops_per_device": model_flops,
        "roofline": roofline,
        "overlap": overlap_report(scheduled, config, hw, predicted, "XLA:CPU"),
        "fits": memory["peak_bytes_per_device"] <= hw.hbm_bytes,
        "offload": offload_report(config, hw, program),
    }


def run(config, hardware: str, devices, target=None, compare_on_cpu: bool = True, flops: bool = True):
    """(result, its formatter): what `jaxsys analyze` prints for `config`. With `target`, its
    compiler's analysis beside the same program on `devices` (fake CPU devices, as many as the
    target has chips; compare_on_cpu=False skips that); otherwise the analysis on `devices` with
    the profile `hardware` (a forward pass for a quantized checkpoint's config)."""
    if target is not None:
        if config.model.quant != "none":
            raise ConfigError(
                f"config.model.quant={config.model.quant!r}: the analysis of a quantized "
                "(inference) config runs on fake CPU devices only so far; drop --target"
            )
        return analyze_target(config, target, devices if compare_on_cpu else None, flops=flops), format_target_report
    result = analyze(config, hardware, devices, flops=flops)
    return result, format_inference_report if result.get("mode") == "inference" else format_report


def _out_of_memory(message: str) -> dict:
    """What the TPU compiler says when a program does not fit: the bytes it needed and had."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    sizes = [float(v) * units[u] for v, u in re.findall(r"(\d+(?:\.\d+)?)([KMGT])\b", message)]
    out = {"fits": False, "error": message.strip().splitlines()[0][:500]}
    if len(sizes) >= 2:
        out["required_bytes"], out["available_bytes"] = sizes[0], sizes[1]
        out["over_bytes"] = sizes[0] - sizes[1]
    return out


def collective_rows(found: list) -> list[dict]:
    """Compiled-HLO collectives (hlo.Collective) grouped by (kind, axes, dtype, scalar): executions,
    operand bytes and ring bytes per step, and how many executions were asynchronous and had
    compute scheduled under them."""
    groups = collections.OrderedDict()
    for c in found:
        scalar = c.operand_bytes <= 8  # the loss and gradient norm, kept apart from the techniques
        key = (c.kind, c.axes, c.dtype, scalar)
        row = groups.setdefault(
            key,
            {
                "kind": c.kind,
                "axes": list(c.axes),
                "dtype": c.dtype,
                "scalar": scalar,
                "count": 0,
                "operand_bytes": 0.0,
                "bytes": 0.0,
                "async": 0,
                "overlapped": 0,
                "overlapped_flops": 0.0,
            },
        )
        row["count"] += c.executions
        row["operand_bytes"] += c.executions * c.operand_bytes
        row["bytes"] += c.executions * _ring_bytes(c)
        row["async"] += c.executions * int(c.is_async)
        row["overlapped"] += c.executions * int(c.overlapped_ops > 0)
        row["overlapped_flops"] += c.executions * c.overlapped_flops
    return list(groups.values())


def _ring_bytes(c) -> float:
    kind = "all_to_all" if c.kind == "ragged_all_to_all" else c.kind
    return cost_model.ring_bytes(kind, c.operand_bytes, c.group_size)


def collective_seconds(found: list, config, hw: hardware_lib.Hardware, peak_flops: float | None = None) -> list[dict]:
    """Per compiled collective (hlo.Collective), per step (its executions included): its ring
    time on its axes' links (`cost_model.axis_bandwidth`, the roofline's), the part hidden behind
    the matmuls scheduled between its start and done at `peak_flops` (default: the compute dtype's
    peak) and the rest, exposed. A synchronous collective hides nothing."""
    bandwidth = cost_model.axis_bandwidth({a: config.mesh[a] for a in MESH_AXES}, hw, dict(config.dcn))
    peak = peak_flops or hw.peak(config.model.compute_dtype)
    out = []
    for c in found:
        t = _ring_bytes(c) / min(bandwidth[a] for a in c.axes) if c.axes else 0.0
        hidden = min(t, c.overlapped_flops / peak) if c.is_async else 0.0
        out.append(
            {
                "time_s": c.executions * t,
                "hidden_s": c.executions * hidden,
                "exposed_s": c.executions * (t - hidden),
                "ring_bytes": c.executions * _ring_bytes(c),
            }
        )
    return out


def exposed_comm_s(found: list, config, hw: hardware_lib.Hardware) -> float:
    """Communication time the compiled schedule leaves exposed: each collective's ring time on its
    axes' links, less the matmul time of the compute scheduled between its start and done (all of
    it for a synchronous one)."""
    return sum(row["exposed_s"] for row in collective_seconds(found, config, hw))


def overlap_summary(source, config, hw: hardware_lib.Hardware, *, select=None, peak_flops: float | None = None) -> dict:
    """What a compiled schedule hides of its communication, per step and device: `source` is the
    compiled HLO text, an `hlo.Module` or a list of `hlo.Collective`; `select(collective) -> bool`
    keeps some (e.g. one axis, one loop). Per kind x axes (`rows`) and in total: executions, how
    many were asynchronous and had compute between start and done ("overlapped"), ring bytes, time
    at the links, hidden and exposed time (`collective_seconds`); `overlapped_fraction` is the share
    of ring bytes in asynchronous collectives with any compute between start and done,
    `beside_matmul_fraction` the share with matmul FLOPs there (what can hide a transfer)."""
    from jaxsys.analysis import hlo

    if isinstance(source, str):
        source = hlo.parse(source)
    if isinstance(source, hlo.Module):
        source = source.collectives({a: int(config.mesh[a]) for a in MESH_AXES}, dict(config.dcn))
    found = [c for c in source if select is None or select(c)]
    fields = ("count", "async", "overlapped", "ring_bytes", "async_bytes", "overlapped_bytes", "beside_matmul_bytes")
    times = ("time_s", "hidden_s", "exposed_s")
    groups: dict = collections.OrderedDict()
    total = dict.fromkeys(fields + times, 0.0)
    for c, sec in zip(found, collective_seconds(found, config, hw, peak_flops)):
        row = groups.setdefault(
            (c.kind, c.axes), {"kind": c.kind, "axes": list(c.axes), **dict.fromkeys(fields + times, 0.0)}
        )
        overlapped = c.is_async and c.overlapped_ops > 0
        add = {
            "count": c.executions,
            "async": c.executions * c.is_async,
            "overlapped": c.executions * overlapped,
            "ring_bytes": sec["ring_bytes"],
            "async_bytes": sec["ring_bytes"] * c.is_async,
            "overlapped_bytes": sec["ring_bytes"] * overlapped,
            "beside_matmul_bytes": sec["ring_bytes"] * (c.is_async and c.overlapped_flops > 0),
            **{k: sec[k] for k in times},
        }
        for key, value in add.items():
            row[key] += value
            total[key] += value
    for row in (*groups.values(), total):
        for key in ("count", "async", "overlapped"):
            row[key] = int(row[key])
    for key in ("overlapped", "beside_matmul"):
        total[f"{key}_fraction"] = total[f"{key}_bytes"] / total["ring_bytes"] if total["ring_bytes"] else 0.0
    return {"rows": sorted(groups.values(), key=lambda r: (r["kind"], r["axes"])), **total}


def overlap_report(found: list, config, hw: hardware_lib.Hardware, predicted: list, schedule: str) -> dict:
    """`overlap_summary` of a compiled step (`schedule` names whose), beside the cost model's
    communication time for the formula's collectives (`predicted`, cost_model.Row), which assumes
    all of it exposed: per kind x axes and in total (`cost_model.roofline`'s comm_s)."""
    summary = overlap_summary(found, config, hw)
    per_axes: dict = collections.defaultdict(float)
    by_kind: dict = collections.defaultdict(lambda: [0, 0.0])
    for r in predicted:
        per_axes[tuple(r.axes)] += r.bytes
        by_kind[(r.kind, tuple(r.axes))][0] += r.count
        by_kind[(r.kind, tuple(r.axes))][1] += r.bytes
    comm = lambda axes_bytes: cost_model.roofline(config, hw, 0.0, 0.0, axes_bytes)["comm_s"]
    summary["schedule"] = schedule
    summary["cost_model"] = {
        "comm_s": comm(per_axes),
        "exposed_s": comm(per_axes),  # the cost model hides nothing
        "rows": [
            {"kind": k, "axes": list(a), "count": n, "ring_bytes": b, "time_s": comm({a: b})}
            for (k, a), (n, b) in sorted(by_kind.items())
        ],
    }
    return summary


def _cost_analysis(compiled) -> dict:
    """XLA's cost analysis of a compiled program (each loop body counted once). Deviceless GPU
    executables return none; XLA's HloCostAnalysis run by the CPU client over the optimised module
    stands in (a private API: {} when it is not there)."""
    cost = compiled.cost_analysis()
    if cost:
        return cost[0] if isinstance(cost, list) else cost
    try:
        from jax._src.lib import _jax

        module = compiled.runtime_executable().hlo_modules()[0]
        return dict(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))
    except Exception:
        return {}


def target_analysis(config, target, devices=None) -> dict:
    """Compile `config`'s train step with the target's own compiler (the TPU compiler for a TPU
    slice, XLA:GPU for GPU nodes; `targets.Target`) and read what it made: memory per chip (device
    and host), the collectives of the optimised HLO (with loop trip counts, async and overlap),
    matmul FLOPs and HBM traffic, and a roofline on the chip. A program the TPU compiler refuses
    for lack of HBM is reported, not raised."""
    from jaxsys import program as program_lib
    from jaxsys.analysis import hlo, targets

    devices = targets.devices(target) if devices is None else devices
    hw = targets.hardware(target)
    mesh = make_mesh(config, devices)
    sizes = {a: int(config.mesh[a]) for a in MESH_AXES}
    program = program_lib.build(config, mesh)
    start = time.perf_counter()
    info = _target_info(target, hw)
    try:
        with targets.quiet_libtpu():
            compiled = program.train_step_fn().lower(program.abstract_state(), _batch(program)).compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e) or "HBM" not in str(e):
            raise
        return {
            **info,
            "compile_s": time.perf_counter() - start,
            "memory": {**_out_of_memory(str(e)), "hbm_bytes": hw.hbm_bytes},
        }
    compile_s = time.perf_counter() - start
    stats = compiled.memory_analysis()
    field = lambda name: int(getattr(stats, name, 0) or 0)
    device_peak = (
        field("argument_size_in_bytes")
        + field("output_size_in_bytes")
        - field("alias_size_in_bytes")
        + field("temp_size_in_bytes")
    )
    host_peak = (
        field("host_argument_size_in_bytes")
        + field("host_output_size_in_bytes")
        - field("host_alias_size_in_bytes")
        + field("host_temp_size_in_bytes")
    )
    memory = {
        "device": {
            "argument_bytes": field("argument_size_in_bytes"),
            "output_bytes": field("output_size_in_bytes"),
            "alias_bytes": field("alias_size_in_bytes"),
            "temp_bytes": field("temp_size_in_bytes"),
            "peak_bytes": device_peak,
        },
        "host": {
            "argument_bytes": field("host_argument_size_in_bytes"),
            "output_bytes": field("host_output_size_in_bytes"),
            "alias_bytes": field("host_alias_size_in_bytes"),
            "temp_bytes": field("host_temp_size_in_bytes"),
            "peak_bytes": host_peak,
        },
        "peak_bytes_per_chip": device_peak,
        "hbm_bytes": hw.hbm_bytes,
        "fits": device_peak <= hw.hbm_bytes,
        "headroom_bytes": hw.hbm_bytes - device_peak,
    }
    module = hlo.parse(compiled.as_text())
    found = module.collectives(sizes, {a: int(config.dcn[a]) for a in MESH_AXES})
    cost = _cost_analysis(compiled)
    matmul = module.matmul_flops()
    traffic = module.hbm_bytes()
    per_axes = collections.defaultdict(float)
    rows = collective_rows(found)
    for row in rows:
        per_axes[tuple(row["axes"])] += row["bytes"]
    roofline = cost_model.roofline(config, hw, matmul, traffic, per_axes)
    overlap = overlap_report(found, config, hw, cost_model.predicted_collectives(config)[0], info["compiler"])
    exposed = overlap["exposed_s"]
    roofline["comm_s_exposed"] = exposed
    roofline["step_s_schedule"] = max(roofline["compute_s"], roofline["memory_s"]) + exposed
    tokens = config.train.batch_size * config.data.seq_len
    model_flops = flops_lib.step_flops_per_token(config) * tokens
    peak_job = hw.job_peak(config.model.compute_dtype, math.prod(sizes.values()))
    step = roofline["step_s_schedule"]
    roofline["mfu_schedule"] = model_flops / (step * peak_job) if step else 0.0
    return {
        **info,
        "compile_s": compile_s,
        "memory": memory,
        "collectives": rows,
        "flops": {
            "matmul_flops_per_chip": matmul,
            "cost_analysis_flops": float(cost.get("flops", 0.0)),
            "cost_analysis_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "hbm_bytes_per_chip": traffic,
            "unknown_trip_counts": module.unknown_trip_counts,
            "conditionals_heaviest_branch": module.conditionals,
        },
        "roofline": roofline,
        "overlap": overlap,
    }


def _target_info(target, hw) -> dict:
    from jaxsys.analysis import targets

    return {
        "name": target.name,
        "platform": target.platform,
        "topology": target.topology,
        "slices": target.slices,
        "chips": target.chips,
        "chips_per_slice": target.chips_per_slice,
        "generation": target.chip.generation,
        "hbm_bytes": hw.hbm_bytes,
        "profile": hw.name,
        "compiler": targets.compiler_name(target),
    }


def analyze_target(config, target, cpu_devices=None, flops: bool = True) -> dict:
    """The target compiler's analysis of `config` on `target` (key "target"), beside the fake-CPU
    analysis on `cpu_devices` (as many as the target has chips; None skips it) and the formulas.
    A -1 mesh axis is resolved from the target's chip count, in `config` itself."""
    from jaxsys.analysis import targets
    from jaxsys.config import validate

    hw = targets.hardware(target)
    validate(config, num_devices=target.chips)
    compiled = target_analysis(config, target)
    if cpu_devices is None:
        predicted, caveats = cost_model.predicted_collectives(config)
        out = {
            "config": {
                "mesh": {a: int(config.mesh[a]) for a in MESH_AXES},
                "dcn": {a: int(config.dcn[a]) for a in MESH_AXES},
                "devices": target.chips,
                "hardware": hw.name,
                "zero_stage": config.train.zero_stage,
                "sequence_parallel": bool(config.parallel.sequence_parallel),
                "remat": config.model.remat,
            },
            "params_count": params_lib.count(train_specs(config)),
            "collectives_formula": [
                dict(technique=r.technique, kind=r.kind, axes=list(r.axes), count=r.count, bytes=r.bytes)
                for r in predicted
            ],
            "formula_caveats": caveats,
            "memory_formula": cost_model.zero_memory(config),
            "offload": offload_report(config, hw),
        }
    else:
        out = analyze(config, hw, cpu_devices, flops=flops)
        out["memory_formula"] = out["memory"]["formula"]
    tokens = config.train.batch_size * config.data.seq_len
    out["model_flops_per_device"] = flops_lib.step_flops_per_token(config) * tokens / target.chips
    out["target"] = compiled
    return out


def train_specs(config):
    """The parameter specs of `config`'s model (as program.build makes them)."""
    from jaxsys.models import transformer

    if config.model.kind == "flax":
        from jaxsys.models import flax_model

        return flax_model.specs_for(config)
    p = config.mesh.pipe
    return transformer.param_specs(config.model, chunks=config.train.virtual_stages if p > 1 else 1)


def startup_summary(program, compiled) -> str:
    """The one-line analysis a training run prints: memory from the step it compiled, collectives
    from the written-out step (tracing only, no second compile)."""
    memory = memory_report(program, compiled)
    sizes = dict(program.layout.mesh_sizes)
    rows = measured_collectives(collectives_lib.parse(lower_unrolled(program).as_text(), sizes), sizes)
    comm = sum(row["bytes"] for row in rows)
    kinds = ", ".join(f"{row['count']} {row['kind']}[{','.join(row['axes'])}]" for row in rows) or "no collectives"
    return (
        f"analysis: peak {_b(memory['peak_bytes_per_device'])}/device (params "
        f"{_b(memory['params_bytes'])}, optimizer {_b(memory['optimizer_bytes'])}); per step {kinds}; "
        f"{_b(comm)} sent/device"
    )


# ----------------------------------------------------------------------------- printing


def _b(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def _t(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def _overlap_lines(ov: dict | None) -> list[str]:
    """The "overlap" table: per kind x axes of the compiled schedule, executions, asynchronous ones,
    those with compute between start and done, ring bytes, time at the links, hidden and exposed;
    beside the cost model's time for the formula's collectives, all exposed."""
    if not ov:
        return []
    model = {(row["kind"], tuple(row["axes"])): row for row in ov["cost_model"]["rows"]}
    out = [
        "",
        f"overlap ({ov['schedule']} schedule; hidden = min(ring time, matmul FLOPs between start and done / peak))",
        "  collective                 count  async  overlapped    ring bytes        time      hidden     exposed"
        "  |  cost model: count    time (all exposed)",
    ]
    keys = [(row["kind"], tuple(row["axes"])) for row in ov["rows"]]
    rows = {key: row for key, row in zip(keys, ov["rows"])}
    for key in keys + sorted(set(model) - set(rows)):
        row, m = rows.get(key), model.get(key)
        name = f"{key[0]}[{','.join(key[1])}]"
        left = (
            f"{row['count']:>6} {row['async']:>6} {row['overlapped']:>11} {_b(row['ring_bytes']):>13} "
            f"{_t(row['time_s']):>11} {_t(row['hidden_s']):>11} {_t(row['exposed_s']):>11}"
            if row
            else f"{'-':>6} {'':>6} {'':>11} {'':>13} {'':>11} {'':>11} {'':>11}"
        )
        right = f"{m['count']:>17} {_t(m['time_s']):>11}" if m else f"{'-':>17}"
        out.append(f"  {name:<24} {left}  |  {right}")
    out.append(
        f"  per step: {_t(ov['time_s'])} of communication, {_t(ov['hidden_s'])} hidden, {_t(ov['exposed_s'])} "
        f"exposed; {ov['overlapped_fraction']:.0%} of ring bytes overlapped | cost model: "
        f"{_t(ov['cost_model']['comm_s'])}, all exposed"
    )
    return out


def format_report(r: dict) -> str:
    c, m = r["config"], r["memory"]
    layout = " x ".join(f"{a}={s}" for a, s in c["mesh"].items() if s > 1) or "1 device"
    out = [
        f"{r['params_count'] / 1e6:,.1f}M parameters on {layout} ({c['devices']} devices), "
        f"ZeRO stage {c['zero_stage']}, SP {c['sequence_parallel']}, remat {c['remat']}; "
        f"hardware profile {c['hardware']}",
        "",
        "memory per device        measured       formula (ZeRO)",
    ]
    f = m["formula"]
    out += [
        f"  parameters             {_b(m['params_bytes']):>12}   {_b(f['params']):>12}",
        f"  optimizer state        {_b(m['optimizer_bytes']):>12}   {_b(f['optimizer']):>12}",
        f"  gradients (as held)    {_b(m['grads_bytes']):>12}   {_b(f['grads']):>12}",
        f"  activations+workspace  {_b(m['activations_and_workspace_bytes']):>12}",
        f"  peak (XLA)             {_b(m['peak_bytes_per_device']):>12}   "
        f"{'fits' if r['fits'] else 'DOES NOT FIT'} in the device memory",
        "",
        "collectives per step (measured)      count   operand bytes   ring bytes/device",
    ]
    out += _collective_lines(r["collectives"])
    out += ["", "collectives per step (formula)"]
    for row in r["collectives_formula"]:
        name = f"{row['kind']}[{','.join(row['axes'])}]"
        out.append(f"  {row['technique']:<52} {name:<24} x{row['count']:<4} {_b(row['bytes']):>12}")
    out += [f"  (+ {r['metric_scalars_formula']} scalar all-reduces: loss and gradient norm)"]
    out += [f"  caveat: {text}" for text in r["formula_caveats"]]
    rl = r["roofline"]
    out += [
        "",
        f"FLOPs per device per step: XLA {r['flops_per_device']:.3e}, analytic "
        f"{r['flops_per_device_analytic']:.3e} (model FLOPs {r['model_flops_per_device']:.3e})",
        f"roofline: compute {rl['compute_s'] * 1e3:.2f} ms, memory {rl['memory_s'] * 1e3:.2f} ms, "
        f"communication {rl['comm_s'] * 1e3:.2f} ms -> step {rl['step_s_overlapped'] * 1e3:.2f} ms "
        f"(overlapped) .. {rl['step_s_serial'] * 1e3:.2f} ms (serial); MFU "
        f"{rl['mfu_overlapped']:.1%} .. {rl['mfu_serial']:.1%}",
    ]
    out += _overlap_lines(r.get("overlap"))
    return "\n".join(out + _format_offload(r.get("offload")))


def format_target_report(r: dict) -> str:
    """The text report of `analyze_target`: the target compiler's figures beside fake CPU and formula."""
    tgt, c = r["target"], r["config"]
    layout = " x ".join(f"{a}={s}" for a, s in c["mesh"].items() if s > 1) or "1 device"
    dcn = ", ".join(f"{a}={s}" for a, s in c.get("dcn", {}).items() if s > 1)
    where = (
        f"{tgt['topology']}" + (f" x {tgt['slices']} slices" if tgt["slices"] > 1 else "")
        if tgt["platform"] == "tpu"
        else f"{tgt['chips'] // tgt['chips_per_slice']} node(s) of {tgt['chips_per_slice']}"
    )
    chip = "chip" if tgt["platform"] == "tpu" else "GPU"
    out = [
        f"{r['params_count'] / 1e6:,.1f}M parameters, {layout}{f' (across slices/nodes: {dcn})' if dcn else ''} "
        f"on {tgt['name']} ({where}, {tgt['chips']} {chip}s, {_b(tgt['hbm_bytes'])} HBM each); "
        f"{tgt['compiler']}: {tgt['compile_s']:.1f} s",
        "",
    ]
    m, cpu = tgt["memory"], r.get("memory")
    f = r["memory_formula"]
    if "device" not in m:
        need = (
            (f"needs {_b(m['required_bytes'])}, has {_b(m['available_bytes'])} (over by {_b(m['over_bytes'])})")
            if "required_bytes" in m
            else ""
        )
        out += [f"memory: DOES NOT FIT: the compiler refused the program: {need}", f"  {m['error']}"]
    else:
        d, h = m["device"], m["host"]
        col = lambda key: _b(cpu[key]) if cpu else "-"
        state = _b(cpu["params_bytes"] + cpu["optimizer_bytes"]) if cpu else "-"
        out += [
            f"memory per {chip}                target compiler     fake CPU    formula (ZeRO)",
            f"  parameters + optimizer     (in the arguments)  {state:>12}  {_b(f['params'] + f['optimizer']):>14}",
            f"  arguments (device)       {_b(d['argument_bytes']):>14}  {col('argument_bytes'):>14}",
            f"  temporaries (device)     {_b(d['temp_bytes']):>14}  {col('temp_bytes'):>14}",
            f"  peak (device)            {_b(d['peak_bytes']):>14}  {col('peak_bytes_per_device'):>14}",
            f"  host memory (pinned)     {_b(h['peak_bytes']):>14}   (arguments {_b(h['argument_bytes'])}, "
            f"temporaries {_b(h['temp_bytes'])})",
            f"  HBM {_b(m['hbm_bytes'])}: "
            + (f"fits, {_b(m['headroom_bytes'])} free" if m["fits"] else f"DOES NOT FIT by {_b(-m['headroom_bytes'])}"),
        ]
    if "collectives" in tgt:
        compiled_rows = by_kind_axes(tgt["collectives"])
        cpu_rows = by_kind_axes(r["collectives"]) if "collectives" in r else {}
        formula = by_kind_axes(r["collectives_formula"])
        sync = collections.defaultdict(lambda: [0, 0])
        for row in tgt["collectives"]:
            if not row["scalar"]:
                key = (row["kind"], tuple(row["axes"]))
                sync[key][0] += row["async"]
                sync[key][1] += row["overlapped"]
        out += [
            "",
            f"collectives per step and {chip}   compiled: count  async  overlapped   ring bytes  |  "
            "fake CPU: count  ring bytes  |  formula: count  ring bytes",
        ]
        for key in sorted(set(compiled_rows) | set(cpu_rows) | set(formula)):
            name = f"{key[0]}[{','.join(key[1])}]"
            tc, tb = compiled_rows.get(key, (0, 0.0))
            cc, cb = cpu_rows.get(key, (0, 0.0))
            fc, fb = formula.get(key, (0, 0.0))
            out.append(
                f"  {name:<30} {tc:>14} {sync[key][0]:>6} {sync[key][1]:>11} {_b(tb):>12}  |  "
                f"{cc:>15} {_b(cb):>11}  |  {fc:>14} {_b(fb):>11}"
            )
        scalars = sum(row["count"] for row in tgt["collectives"] if row["scalar"])
        out.append(f"  (+ {scalars} scalar all-reduces: loss and gradient norm)")
        out += [f"  caveat: {text}" for text in r.get("formula_caveats", [])]
        fl, rl = tgt["flops"], tgt["roofline"]
        cpu_flops = f"{r['flops_per_device']:.3e}" if r.get("flops_per_device") else "-"
        out += [
            "",
            f"FLOPs per {chip} and step: compiled matmuls {fl['matmul_flops_per_chip']:.3e} (loop trip "
            f"counts applied) | compiler's cost analysis {fl['cost_analysis_flops']:.3e} (each loop body "
            f"once) | XLA:CPU {cpu_flops} | model {r['model_flops_per_device']:.3e}",
            f"roofline on {tgt['profile']}: compute {rl['compute_s'] * 1e3:.1f} ms, HBM "
            f"{rl['memory_s'] * 1e3:.1f} ms ({_b(fl['hbm_bytes_per_chip'])} moved, estimated), communication "
            f"{rl['comm_s'] * 1e3:.1f} ms, of which the compiled schedule leaves exposed "
            f"{rl['comm_s_exposed'] * 1e3:.1f} ms",
            f"  step {rl['step_s_overlapped'] * 1e3:.1f} ms (all hidden) .. {rl['step_s_schedule'] * 1e3:.1f} ms "
            f"(the compiler's overlap) .. {rl['step_s_serial'] * 1e3:.1f} ms (none hidden); MFU "
            f"{rl['mfu_overlapped']:.1%} .. {rl['mfu_schedule']:.1%} .. {rl['mfu_serial']:.1%}",
        ]
        out += _overlap_lines(tgt.get("overlap"))
        cpu_overlap = r.get("overlap")
        if cpu_overlap:
            out.append(
                f"  the same step on fake CPU devices (XLA:CPU schedule): {cpu_overlap['count']} collectives, "
                f"{cpu_overlap['async']} async, {_t(cpu_overlap['exposed_s'])} exposed of {_t(cpu_overlap['time_s'])}"
            )
    return "\n".join(out + _format_offload(r.get("offload")))
