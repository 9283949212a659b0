"""FSDP prefetch in the TPU compiler's schedule (config.parallel.fsdp_prefetch; docs/comm_overlap.md).

Compiles the train step of a small FSDP model ahead of time for a TPU target (libtpu, no TPU) with
and without prefetch and reads the scheduled HLO: for every collective over the fsdp axis, whether
it is asynchronous (a `*-start`/`*-done` pair, or the TPU's `async-collective-start` /
`async-collective-done` fusions) and which matmuls are scheduled between its start and done. Prints
one line per program and, with --json, the figures.

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
KINDS = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter", "all-reduce": "all_reduce"}
MODELS = {
    "tiny": {},
    "mid": dict(d_model=256, n_heads=8, n_kv_heads=8, d_ff=1024, n_layers=4),
    "big": dict(d_model=1024, n_heads=8, n_kv_heads=8, head_dim=128, d_ff=4096, n_layers=4),
}


def fsdp_collectives(text: str, mesh_sizes: dict) -> list[dict]:
    """Each collective over the fsdp axis in scheduled HLO `text`: kind, bytes per step (the
    gathered result of an all-gather, the operand of a reduction), async, and the matmul FLOPs
    scheduled between its start and done (per execution)."""
    from jaxsys.analysis import hlo

    m = hlo.parse(text)
    starts, inside = {}, set()  # computation called by an async start -> (its computation, the start)
    for comp in m.executions:
        for inst in m.computations[comp]:
            if inst.opcode == "async-start" or inst.name.startswith("async-collective-start"):
                for callee in inst.called():
                    starts[callee] = (comp, inst)
            elif inst.name.startswith("async-collective-done") or comp in inside:
                inside.update(inst.called())
            elif inst.name.startswith("async-collective-start") is False and any(
                c.startswith("async_collective_fusion") for c in inst.called()
            ):
                inside.update(inst.called())  # a continuation step of an async collective fusion
    inside.update(c for c in m.computations if c.startswith("async_collective_fusion"))
    # the train step's loop bodies in schedule order: the layer scan's forward, then its backward
    loops = [
        inst.attr("body").lstrip("%")
        for comp, times in m.executions.items()
        if times == 1
        for inst in m.computations[comp]
        if inst.opcode == "while"
    ] + [None]
    out = []
    for comp, times in m.executions.items():
        if comp in inside:  # a later step of a collective counted at its start
            continue
        insts = m.computations[comp]
        for k, inst in enumerate(insts):
            base = inst.opcode[: -len("-start")] if inst.opcode.endswith("-start") else inst.opcode
            if base not in KINDS or inst.opcode.endswith("-done"):
                continue
            axes, _ = hlo._group(inst, mesh_sizes)
            if "fsdp" not in axes:
                continue
            if comp in starts:  # inside an async fusion: time it from the fusion's start to its done
                host, start = starts[comp]
                host_insts = m.computations[host]
                position = next(i for i, x in enumerate(host_insts) if x.name == start.name)
                if start.name.startswith("async-collective-start"):  # TPU: paired by name suffix
                    done_name = start.name.replace("async-collective-start", "async-collective-done")
                else:
                    done_name = hlo.Module._done_of(host_insts, position, start)
                done = next((i for i, x in enumerate(host_insts) if x.name == done_name), None)
                between, times = host_insts[position + 1 : done] if done else [], m.executions[host]
                where = host
            elif inst.opcode.endswith("-start"):
                done = hlo.Module._done_of(insts, k, inst)
                done_name = done
                end = next(i for i, x in enumerate(insts) if x.name == done) if done else k
                between, where = insts[k + 1 : end], comp
            else:
                between, where, done_name = None, comp, None
            shape = inst.shape if base == "all-gather" else m.by_name[comp][inst.operands[0]].shape
            nbytes = sum(a.bytes for a in hlo.arrays(shape))
            flops = sum(m._flops_of(where, b) for b in between) if between else 0.0
            prefetched = between is not None and times > 1 and _feeds_only_the_carry(m, where, done_name)
            scope = (
                "step"
                if times == 1
                else "forward loop"
                if where == loops[0]
                else "backward loop"
                if len(loops) > 1 and where == loops[1]
                else "other loop"
            )
            out.append(
                dict(
                    kind=KINDS[base],
                    name=inst.name,
                    computation=comp,
                    scope=scope,
                    executions=times,
                    bytes=nbytes * times,
                    group=_,
                    is_async=between is not None,
                    overlapped_flops=flops,
                    next_layer=prefetched,
                )
            )
    return out


def hidden_time(rows: list[dict], link_bytes_per_s: float, peak_flops: float) -> tuple[float, float]:
    """(communication seconds, of which hidden) per step: each collective's ring time over the two
    links of its torus axis, hidden up to the matmul time scheduled between its start and done."""
    total = hidden = 0.0
    for r in rows:
        n = r["group"]
        t = r["bytes"] * (n - 1) / n / (2 * link_bytes_per_s)
        total += t
        if r["is_async"]:
            hidden += min(t, r["executions"] * r["overlapped_flops"] / peak_flops)
    return total, hidden


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
            elif m._flops_of(comp, u) > 0:
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
    from jaxsys.analysis import report, targets
    from jaxsys.mesh import make_mesh
    from tests.helpers import small_config

    target = targets.parse(args.target)
    devices = targets.devices(target)
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
            rows = fsdp_collectives(compiled.as_text(), sizes)
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
                comm, hidden = hidden_time(
                    [r for r in chosen if r["kind"] == "all_gather"],
                    target.chip.ici_link_bytes_per_s,
                    target.chip.peak_flops_bf16,
                )
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
