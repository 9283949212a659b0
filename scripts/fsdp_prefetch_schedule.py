"""FSDP prefetch in the TPU compiler's schedule (config.parallel.fsdp_prefetch; docs/comm_overlap.md).

Compiles the train step of a small FSDP model ahead of time for a TPU target (libtpu, no TPU) with
and without prefetch and reads the scheduled HLO with `jaxsys.analysis.hlo` (which pairs the starts
and dones, also of the TPU's async collective fusions): for every collective over the fsdp axis,
whether it is asynchronous, which matmuls are scheduled between its start and done, and whether it
gathers the next layer's weights; times from `report.overlap_summary`. Prints one line per program
and, with --json, the figures.

    python scripts/fsdp_prefetch_schedule.py --target v5e-8 [--model big --batch 16 --seq-len 512]

With libtpu 0.0.48.1's default flags, v5e (Viperlite) makes all-gathers asynchronous (as
`async-collective-start` / continuation / `async-collective-done` fusions); v5p and v6e leave them
synchronous and refuse MaxText's async-collective-fusion flags ("supported only on Viperlite").
`--async-flags` adds those flags to LIBTPU_INIT_ARGS (before libtpu starts), for other versions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ASYNC_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
    "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
)
MODELS = {
    "tiny": {},
    "mid": dict(d_model=256, n_heads=8, n_kv_heads=8, d_ff=1024, n_layers=4),
    "big": dict(d_model=1024, n_heads=8, n_kv_heads=8, head_dim=128, d_ff=4096, n_layers=4),
}


def fsdp_collectives(module, mesh_sizes: dict) -> tuple[list, list[dict]]:
    """The collectives over the fsdp axis of a parsed scheduled HLO module (`hlo.Collective`, read
    by `jaxsys.analysis.hlo`: async or not, compute between start and done) and one row each: kind,
    bytes per step (the gathered result of an all-gather, the operand of a reduction), async, the
    matmul FLOPs scheduled between its start and done (per execution), the scope (forward or
    backward layer loop, or the step outside them) and whether it gathers the next layer's weights."""
    # the train step's loop bodies in schedule order: the layer scan's forward, then its backward
    loops = [
        inst.attr("body").lstrip("%")
        for comp, times in module.executions.items()
        if times == 1
        for inst in module.computations[comp]
        if inst.opcode == "while"
    ] + [None]
    found = [c for c in module.collectives(mesh_sizes) if "fsdp" in c.axes]
    rows = []
    for c in found:
        where, times = c.computation, c.executions
        scope = (
            "step"
            if times == 1
            else "forward loop"
            if where == loops[0]
            else "backward loop"
            if len(loops) > 1 and where == loops[1]
            else "other loop"
        )
        rows.append(
            dict(
                kind=c.kind,
                name=c.name,
                computation=where,
                scope=scope,
                executions=times,
                bytes=c.operand_bytes * (c.group_size if c.kind == "all_gather" else 1) * times,
                group=c.group_size,
                is_async=c.is_async,
                overlapped_flops=c.overlapped_flops,
                next_layer=c.is_async and times > 1 and _feeds_only_the_carry(module, where, c.done),
            )
        )
    return found, rows


def _feeds_only_the_carry(m, comp: str, done: str | None) -> bool:
    """Whether the result of `done` in loop body `comp` reaches the body's ROOT tuple (the carry of
    the next iteration) without any matmul of this iteration using it: a prefetched weight."""
    if done is None:
        return False
    insts = m.computations[comp]
    users = {}
    for x in insts:
        for o in x.operands:
            users.setdefault(o, []).append(x)
    seen, todo, to_root = set(), [done], False
    while todo:
        name = todo.pop()
        for u in users.get(name, []):
            if u.name in seen:
                continue
            seen.add(u.name)
            if u.root:
                to_root = True
            elif m.window_flops(comp, u) > 0:
                return False
            else:
                todo.append(u.name)
    return to_root


def summarize(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        s = out.setdefault(
            r["kind"], dict(count=0, bytes=0.0, async_bytes=0.0, overlapped_bytes=0.0, next_layer_overlapped_bytes=0.0)
        )
        s["next_layer_overlapped_bytes"] += r["bytes"] * (r["next_layer"] and r["overlapped_flops"] > 0)
        s["count"] += r["executions"]
        s["bytes"] += r["bytes"]
        s["async_bytes"] += r["bytes"] * r["is_async"]
        s["overlapped_bytes"] += r["bytes"] * (r["is_async"] and r["overlapped_flops"] > 0)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="v5e-8")
    p.add_argument("--model", default="mid", choices=list(MODELS))
    p.add_argument("--remat", default="full,none")
    p.add_argument("--async-flags", action="store_true")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the tiny test config's 8)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default 32)")
    p.add_argument("--json", default=None)
    p.add_argument("--dump", default=None, help="a folder: write each scheduled HLO there")
    args = p.parse_args(argv)
    if args.async_flags:
        os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " " + ASYNC_FLAGS).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import numpy as np

    from jaxsys import train
    from jaxsys.analysis import hlo, report, targets
    from jaxsys.analysis.report import overlap_summary
    from jaxsys.mesh import make_mesh
    from tests.helpers import small_config

    target = targets.parse(args.target)
    devices = targets.devices(target)
    hw = targets.hardware(target)
    mesh = dict(fsdp=8)
    sizes = {a: mesh.get(a, 1) for a in ("data", "pipe", "fsdp", "expert", "seq", "tensor")}
    results = []
    for remat in args.remat.split(","):
        for prefetch in (False, True):
            c = small_config(mesh, remat=remat, **MODELS[args.model])
            c.parallel.fsdp_prefetch = prefetch
            c.train.batch_size = args.batch or c.train.batch_size
            c.data.seq_len = args.seq_len or c.data.seq_len
            n = int(np.prod([c.mesh[a] for a in c.mesh]))
            program = train.build(c, make_mesh(c, devices[:n]))
            t = time.time()
            with targets.quiet_libtpu():
                compiled = program.train_step_fn().lower(program.abstract_state(), report._batch(program)).compile()
            seconds = time.time() - t
            found, rows = fsdp_collectives(hlo.parse(compiled.as_text()), sizes)
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(
                    os.path.join(args.dump, f"{args.target}-{args.model}-{remat}-prefetch{int(prefetch)}.hlo"), "w"
                ) as f:
                    f.write(compiled.as_text())
            temp = compiled.memory_analysis().temp_size_in_bytes
            result = dict(
                target=args.target,
                model=args.model,
                batch=c.train.batch_size,
                seq_len=c.data.seq_len,
                remat=remat,
                prefetch=prefetch,
                async_flags=args.async_flags,
                temp_bytes=temp,
                rows=rows,
                scopes={},
            )
            print(
                f"{args.target} {args.model} B={c.train.batch_size} T={c.data.seq_len} remat={remat} prefetch={prefetch}: temp {temp / 2**20:.2f} MiB, "
                f"compiled in {seconds:.0f} s",
                flush=True,
            )
            for scope in ("all", "forward loop", "backward loop", "step"):
                chosen = [r for r in rows if scope == "all" or r["scope"] == scope]
                # ring time on the fsdp axis's links, hidden up to the matmuls between start and done
                # at the bf16 peak (TPU dots at default precision read bf16, also in an fp32 program)
                gathers = overlap_summary(
                    [
                        k
                        for k, r in zip(found, rows)
                        if k.kind == "all_gather" and (scope == "all" or r["scope"] == scope)
                    ],
                    c,
                    hw,
                    peak_flops=targets.hardware(target).peak("bfloat16"),
                )
                comm, hidden = gathers["time_s"], gathers["hidden_s"]
                summary = summarize(chosen)
                result["scopes"][scope] = dict(summary=summary, all_gather_s=comm, all_gather_hidden_s=hidden)
                line = "; ".join(
                    f"{k} x{v['count']} {v['bytes'] / 2**20:.2f} MiB: async {v['async_bytes'] / v['bytes']:.0%}, "
                    f"beside matmuls {v['overlapped_bytes'] / v['bytes']:.0%} "
                    f"(next layer's {v['next_layer_overlapped_bytes'] / v['bytes']:.0%})"
                    for k, v in sorted(summary.items())
                )
                print(
                    f"    {scope:13s} | {line} | all-gather time hidden {hidden / comm if comm else 0:.0%} of "
                    f"{comm * 1e6:.1f} us",
                    flush=True,
                )
            results.append(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
