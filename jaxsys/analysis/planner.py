"""The planner: choose the layout for a config on N devices: enumerate, prune by memory, rank by
step time, compile the best few, and name the winner as config overrides.

    result = planner.plan(config, 256, hardware.profile("h100"), top=3)   # from Python
    print(planner.table(result))

The command around it (jaxsys/plan.py) parses the flags, asks for fake CPU devices or the target's
compile-only devices, and writes the winner's overrides:

    python -m jaxsys.plan --config configs/llama_8b.py --devices 256 --hardware h100 --top 3
    python -m jaxsys.plan --config configs/llama_8b.py --target v5p-256 --top 3
    python -m jaxsys.plan --config configs/tiny.py --devices 8 --hardware cpu --out overrides.txt
    jaxsys train --config configs/tiny.py --workdir /tmp/t $(cat overrides.txt)

1. Enumerate: every assignment of the mesh axes (data, pipe, fsdp, expert, seq, tensor) whose
   product is N; for each, ZeRO stage 0-2 (with data > 1), remat none / dots / full, with a
   pipeline m in {p, 2p, 4p} micro-batches under 1F1B, and optionally the optimizer state on the
   host (`--offload`, where the device has host memory), and the overlap options where valid
   (`overlap_options`: collective matmul, FSDP prefetch, pipeline overlap, each off and on).
   `config.validate` decides what divides
   the model (heads, kv heads, layers, batch, sequence); what it refuses is pruned with its
   reason, grouped by the family of axes in use.
2. Prune by memory: `cost_model.predicted_memory` (ZeRO formula + FSDP's gathered layers +
   activations after Korthikanti et al. + batch) against the device's HBM (`--hbm` to override).
3. Rank by `cost_model.predicted_step`: compute and HBM time by the roofline, the pipeline
   bubble, every collective of `predicted_collectives` and the pipeline sends at its axis's
   bandwidth plus its latency (alpha-beta), less what the layout's overlap options hide, and a
   cost per kernel (docs/planner.md).
4. Compile the top k (`--top`): on N fake CPU devices (XLA:CPU's buffer assignment), or with the
   target's own compiler (`--target`, the TPU compiler through libtpu). A layout whose compiled
   memory passes the budget is marked, and the first that fits is the winner.

Bad input is named before anything compiles: a device count no layout divides, a budget nothing
fits (with the smallest need), an unknown hardware or target.
"""

from __future__ import annotations

import copy
import dataclasses
import time

from jaxsys.config import MESH_AXES, ConfigError, validate

REMATS = ("none", "dots", "full")
# The overlap variants (docs/comm_overlap.md), enumerated where valid (`overlap_options`)
OVERLAPS = ("parallel.collective_matmul", "parallel.fsdp_prefetch", "parallel.pipeline_overlap")
OVERLAP_TAGS = dict(zip(OVERLAPS, ("cm", "prefetch", "pp-overlap")))


@dataclasses.dataclass
class Candidate:
    overrides: dict  # config key (dotted, under config.) -> value
    config: object
    memory: dict  # cost_model.predicted_memory
    step: dict  # cost_model.predicted_step
    compiled: dict | None = None  # {"peak_bytes", "fits", "compile_s"} for the top k

    @property
    def name(self) -> str:
        o = self.overrides
        axes = " x ".join(f"{a}={o[f'mesh.{a}']}" for a in MESH_AXES if o[f"mesh.{a}"] > 1) or "1 device"
        extra = [f"zero{o['train.zero_stage']}"] if o["mesh.data"] > 1 else []
        extra.append(f"remat={o['model.remat']}")
        if o["mesh.pipe"] > 1:
            extra.append(f"m={o['train.microbatches']}")
        if o.get("offload.optimizer"):
            extra.append("opt->host")
        extra += [OVERLAP_TAGS[k] for k in OVERLAPS if o.get(k)]
        return f"{axes} ({', '.join(extra)})"

    @property
    def overlap(self) -> str:
        """The overlap options this layout turns on, as the table shows them ("-": none)."""
        return "+".join(OVERLAP_TAGS[k] for k in OVERLAPS if self.overrides.get(k)) or "-"

    def override_lines(self) -> list[str]:
        return [f"--config.{k}={v}" for k, v in self.overrides.items()]


def factorizations(n: int, k: int):
    """Every k-tuple of positive integers whose product is n."""
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorizations(n // d, k - 1):
                yield (d, *rest)


def _family(sizes: dict) -> str:
    return " x ".join(a for a in MESH_AXES if sizes[a] > 1) or "one device"


def _apply(base, overrides: dict):
    c = copy.deepcopy(base)
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


def overlap_options(base, sizes: dict, offload_params: bool = False) -> list[dict]:
    """Every combination of the overlap options valid for a layout of these mesh sizes, the plain
    one (all off) first: collective_matmul with tensor > 1 under sequence parallelism (the base
    config's), fsdp_prefetch with fsdp > 1 (not with offloaded parameters), pipeline_overlap with
    pipe > 1 (where the config has the key). An option not valid here is left out of the overrides."""
    par = base.parallel
    valid = {
        "parallel.collective_matmul": sizes["tensor"] > 1
        and bool(par.sequence_parallel)
        and "collective_matmul" in par,
        "parallel.fsdp_prefetch": sizes["fsdp"] > 1 and "fsdp_prefetch" in par and not offload_params,
        "parallel.pipeline_overlap": sizes["pipe"] > 1 and "pipeline_overlap" in par,
    }
    options: list[dict] = [{}]
    for key in OVERLAPS:
        if valid[key]:
            options = [{**o, key: on} for on in (False, True) for o in options]
    return options


def enumerate_layouts(base, devices: int, offload: bool = False) -> tuple[list[tuple[dict, object]], dict]:
    """(valid (overrides, config) pairs, {family: {"count": pruned, "reason": one reason}}): every
    layout of `devices` that `config.validate` accepts, once, and what it refused. The overlap
    variants of a layout (`overlap_options`) are tried once its plain form is valid."""
    from jaxsys.models import transformer

    moe = transformer.layer_counts(base.model)["moe"] > 0
    pruned: dict = {}

    def prune(family: str, reason: str) -> None:
        entry = pruned.setdefault(family, {"count": 0, "reason": reason})
        entry["count"] += 1

    valid = []
    for sizes_tuple in factorizations(devices, len(MESH_AXES)):
        sizes = dict(zip(MESH_AXES, sizes_tuple))
        family = _family(sizes)
        if sizes["expert"] > 1 and not moe:
            prune(family, "the model has no MoE layer: nothing to split over `expert`")
            continue
        mesh_overrides = {f"mesh.{a}": sizes[a] for a in MESH_AXES}
        p = sizes["pipe"]
        overlaps = overlap_options(base, sizes, bool(base.offload.params))
        pipeline_options = (
            [{"train.microbatches": m * p, "train.pipeline_schedule": "1f1b"} for m in (1, 2, 4)]
            if p > 1
            else [{"train.microbatches": base.train.microbatches}]
        )
        for zero in (0, 1, 2) if sizes["data"] > 1 else (0,):
            for remat in REMATS:
                for pipe_opts in pipeline_options:
                    for host in (False, True) if offload else (False,):
                        overrides = {
                            **mesh_overrides,
                            "train.zero_stage": zero,
                            "model.remat": remat,
                            **pipe_opts,
                            "offload.optimizer": host,
                        }
                        for i, overlap in enumerate(overlaps):
                            config = _apply(base, {**overrides, **overlap})
                            try:
                                validate(config, num_devices=devices)
                            except ConfigError as e:
                                prune(family, str(e).splitlines()[0])
                                if i == 0:  # the plain form refused: so are its overlap variants
                                    break
                                continue
                            valid.append(({**overrides, **overlap}, config))
    return valid, pruned


def predict(valid, hw) -> list[Candidate]:
    from jaxsys.analysis import cost_model

    return [Candidate(o, c, cost_model.predicted_memory(c), cost_model.predicted_step(c, hw)) for o, c in valid]


def compile_memory(candidate: Candidate, devices, target=None) -> dict:
    """The compiler's peak bytes per device for the candidate's train step."""
    from jaxsys.analysis import report

    start = time.perf_counter()
    if target is not None:
        memory = report.target_analysis(candidate.config, target, devices)["memory"]
        peak = memory.get("peak_bytes_per_chip", memory.get("required_bytes", float("inf")))
        return {"peak_bytes": peak, "compile_s": time.perf_counter() - start, "compiler": "target"}
    from jaxsys import program as program_lib
    from jaxsys.mesh import make_mesh

    # what XLA:CPU cannot build (a pipeline's collective matmul or ring attention) compiles in its
    # nearest CPU form, named in the result
    config, stand_in = program_lib.cpu_stand_in(candidate.config)
    program = program_lib.build(config, make_mesh(config, devices))
    compiled = program.train_step_fn().lower(program.abstract_state(), report._batch(program)).compile()
    peak = report.memory_report(program, compiled)["peak_bytes_per_device"]
    return {"peak_bytes": peak, "compile_s": time.perf_counter() - start, "compiler": "xla:cpu", "stand_in": stand_in}


def plan(
    base,
    devices: int,
    hw,
    top: int = 3,
    budget: float | None = None,
    offload: bool = False,
    compile_devices=None,
    target=None,
    log=print,
) -> dict:
    """The whole plan as a dict: "ranked" candidates (fitting by the formula, best first, the top k
    compiled), "pruned" families with reasons, "too_big" (the smallest that did not fit), "winner"."""
    budget = hw.hbm_bytes if budget is None else budget
    start = time.perf_counter()
    valid, pruned = enumerate_layouts(base, devices, offload)
    if not valid:
        reasons = "; ".join(f"{f}: {e['reason']}" for f, e in list(pruned.items())[:4])
        raise ConfigError(
            f"no layout of {devices} devices divides this model ({reasons}): try a device count "
            "that the batch, heads and layers divide"
        )
    candidates = predict(valid, hw)
    fits = [c for c in candidates if c.memory["total"] <= budget]
    too_big = [c for c in candidates if c.memory["total"] > budget]
    for c in too_big:
        family = "memory: " + _family({a: c.overrides[f"mesh.{a}"] for a in MESH_AXES})
        entry = pruned.setdefault(family, {"count": 0, "reason": ""})
        entry["count"] += 1
        entry["reason"] = (
            f"needs {c.memory['total'] / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB by the formula (e.g. {c.name})"
        )
    if not fits:
        smallest = min(candidates, key=lambda c: c.memory["total"])
        raise ConfigError(
            f"no layout of {devices} devices fits {budget / 2**30:.1f} GiB per device: the smallest "
            f"need is {smallest.memory['total'] / 2**30:.1f} GiB ({smallest.name}); raise --hbm, add "
            "devices, or shrink the batch or sequence"
        )
    fits.sort(key=lambda c: c.step["step_s"])
    log(
        f"plan: {len(candidates)} layouts valid, {len(fits)} fit by the formula "
        f"({time.perf_counter() - start:.1f}s); compiling the top {min(top, len(fits))}"
    )
    winner = None
    for c in fits[:top]:
        try:
            c.compiled = compile_memory(c, compile_devices, target)
            c.compiled["fits"] = c.compiled["peak_bytes"] <= budget
        except Exception as e:  # noqa: BLE001 - one layout failing to compile must not stop the plan
            c.compiled = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", "fits": False}
        log(
            f"  compiled {c.name}: "
            + (
                f"{c.compiled['peak_bytes'] / 2**30:.2f} GiB in {c.compiled['compile_s']:.0f}s"
                + (
                    f" (XLA:CPU compiled it with {', '.join(c.compiled['stand_in'])})"
                    if c.compiled.get("stand_in")
                    else ""
                )
                if "peak_bytes" in c.compiled
                else c.compiled["error"]
            )
        )
        if winner is None and c.compiled["fits"]:
            winner = c
    if winner is None and top == 0:
        winner = fits[0]
    return {
        "ranked": fits,
        "pruned": pruned,
        "too_big": too_big,
        "winner": winner,
        "budget": budget,
        "devices": devices,
        "hardware": hw.name,
    }


def table(result: dict, rows: int = 10) -> str:
    gib = lambda b: f"{b / 2**30:.2f}"
    lines = [
        f"layouts for {result['devices']} x {result['hardware']}, budget {gib(result['budget'])} GiB per device",
        "",
        "| # | layout | step ms (pred.) | MFU (pred.) | overlap | comm ms exposed / hidden | "
        "memory GiB (formula) | memory GiB (compiled) | fits |",
        "|---:|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for i, c in enumerate(result["ranked"][:rows], 1):
        comp = c.compiled or {}
        compiled = gib(comp["peak_bytes"]) if "peak_bytes" in comp else (comp.get("error", "-")[:40] if comp else "-")
        if comp.get("stand_in"):  # compiled in its nearest CPU-buildable form (program.cpu_stand_in)
            compiled += "*"
        fits = "-" if not comp else ("yes" if comp.get("fits") else "**no**")
        lines.append(
            f"| {i} | {c.name} | {c.step['step_s'] * 1e3:.1f} | {c.step['mfu']:.1%} | {c.overlap} | "
            f"{c.step['comm_exposed_s'] * 1e3:.1f} / {sum(c.step['comm_hidden_s'].values()) * 1e3:.1f} | "
            f"{gib(c.memory['total'])} | {compiled} | {fits} |"
        )
    if any((c.compiled or {}).get("stand_in") for c in result["ranked"][:rows]):
        lines += [
            "",
            "* compiled with what XLA:CPU cannot build replaced by its nearest CPU form (the log names it; "
            "program.cpu_stand_in): collective matmul under a pipeline by the plain collectives, ring "
            "attention under a pipeline by allgather (an upper bound). --target compiles the layout as it is.",
        ]
    lines += ["", "pruned:"]
    for family, entry in result["pruned"].items():
        lines.append(f"  {family}: {entry['count']} ({entry['reason']})")
    w = result["winner"]
    lines += ["", f"winner: {w.name}" if w else "winner: none of the compiled layouts fits; raise --top"]
    return "\n".join(lines)


def to_json(result: dict) -> dict:
    """The plan as JSON-ready data: every ranked layout (overrides, memory, step, compiled), the
    pruned families, the budget and the winner's name."""
    rows = [
        dict(layout=c.name, overrides=c.overrides, memory=c.memory, step=c.step, compiled=c.compiled)
        for c in result["ranked"]
    ]
    return {
        "ranked": rows,
        "pruned": result["pruned"],
        "budget": result["budget"],
        "winner": result["winner"].name if result["winner"] else None,
    }
