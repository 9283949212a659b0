"""Training throughput of jaxsys next to the same model as a plain `jax.jit` + GSPMD program.

    PYTHONPATH=. python benchmarks/spine_throughput.py [--steps 30] [--warmup 3] [--repeats 3]
                                                       [--layouts 1dev,dp8,...] [--json PATH]

Both programs train configs/tiny.py (d_model 128, 4 layers, T=128, B=16) on the same mesh, from
the same initial parameters, on the same pre-built batches:

  jaxsys  `jaxsys.train.build(config, mesh).train_step_fn()`: one shard_map over the mesh whose
          collectives are exactly the ones jaxsys writes (Megatron TP, FSDP, DP/ZeRO).
  plain   one `jax.jit` of the same model math with the one-device Layout (all mesh axes 1, so the
          model code emits no collectives), `jax.value_and_grad`, and
          `optax.chain(clip_by_global_norm, optimizer.make_optimizer)`; parameters, optimizer state and
          batch carry the NamedShardings of the jaxsys Program, and GSPMD decides the communication.

Layouts: 1dev (one device), dp8 (data=8), fsdp8 (fsdp=8), tp8 (tensor=8, n_kv_heads=8 so the
key/value heads divide), hybrid8 (data=2, fsdp=2, tensor=2). The 8-device layouts run on 8
simulated XLA CPU devices (`--xla_force_host_platform_device_count=8`, set below before jax is
imported), which share the host's cores.

Timing: both steps are compiled first (`.lower().compile()`), warmed up, then timed alternately
(jaxsys, plain, jaxsys, plain, ...) `--repeats` times, each run `--steps` steps ending in
`jax.block_until_ready`; the median tokens/s of each is reported with the ratio jaxsys/plain.
As a check that both compute the same thing, the first-step losses must agree (rtol 1e-4); the
loss after the warm-up steps (which includes the updates) is reported as well.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from jaxsys import data as data_lib  # noqa: E402
from jaxsys import train as train_lib  # noqa: E402
from jaxsys.config import MESH_AXES, load_config  # noqa: E402
from jaxsys.mesh import make_mesh  # noqa: E402
from jaxsys.models import params as params_lib  # noqa: E402
from jaxsys.models import transformer  # noqa: E402
from jaxsys.optim import optimizer as optimizer_lib  # noqa: E402
from jaxsys.sharding import Layout  # noqa: E402

# name -> (mesh sizes, model overrides)
LAYOUTS = {
    "1dev": ({}, {}),
    "dp8": ({"data": 8}, {}),
    "fsdp8": ({"fsdp": 8}, {}),
    "tp8": ({"tensor": 8}, {"n_kv_heads": 8}),
    "hybrid8": ({"data": 2, "fsdp": 2, "tensor": 2}, {}),
}
LOSS_RTOL = 1e-4
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def _is_p(x) -> bool:
    return isinstance(x, P)


def layout_config(base, name):
    mesh_sizes, model = LAYOUTS[name]
    c = copy.deepcopy(base)
    for axis in MESH_AXES:
        c.mesh[axis] = mesh_sizes.get(axis, 1)
    for key, value in model.items():
        c.model[key] = value
    return c


def collective_counts(compiled) -> dict[str, int]:
    """Collective ops in the optimized HLO of a compiled step (async pairs counted once)."""
    text = compiled.as_text()
    counts = {}
    for op in COLLECTIVES:
        # `all-reduce(`, `all-reduce-start(`; not the `-done` half of an async pair.
        counts[op] = len(re.findall(rf"\s{re.escape(op)}(?:-start)?\(", text))
    return {k: v for k, v in counts.items() if v}


class Plain:
    """The same model and optimizer as one jitted GSPMD program."""

    def __init__(self, program: train_lib.Program):
        c = program.config
        self.program = program
        one = copy.deepcopy(c)
        for axis in MESH_AXES:
            one.mesh[axis] = 1
        self.layout = Layout.from_config(one)  # no collectives in the model code
        specs = program.specs
        self.tx = optax.chain(
            optax.clip_by_global_norm(c.train.grad_clip), optimizer_lib.make_optimizer(c.train, specs)
        )
        abstract = params_lib.abstract_params(specs, jnp.dtype(c.model.param_dtype))
        opt_pspecs = optax.tree_map_params(
            self.tx,
            lambda _, spec: spec,
            jax.eval_shape(self.tx.init, abstract),
            program.param_pspecs,
            transform_non_params=lambda _: P(),
            is_leaf=_is_p,
        )
        self.state_shardings = program.shardings((program.param_pspecs, opt_pspecs))
        replicated = NamedSharding(program.mesh, P())

        def step(state, tokens):
            params, opt_state = state

            def loss_fn(p):
                return jnp.mean(transformer.token_losses(p, tokens, c.model, self.layout, specs)[0])

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        self.step = jax.jit(
            step,
            in_shardings=(self.state_shardings, program.batch_sharding),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
        )

    def init(self):
        """The jaxsys initial parameters (same key as `Program.init`) and a fresh optimizer state."""
        c = self.program.config
        dtype = jnp.dtype(c.model.param_dtype)

        def init(key):
            params = params_lib.init_params(self.program.specs, key, dtype)
            return params, self.tx.init(params)

        return jax.jit(init, out_shardings=self.state_shardings)(jax.random.fold_in(jax.random.key(c.seed), 0))


def _loss(x) -> float:
    return float(np.asarray(x.addressable_data(0)))


def run_steps(step, state, batches, loss_of):
    for tokens in batches:
        state, out = step(state, tokens)
    jax.block_until_ready((state, out))
    return state, loss_of(out)


def bench_layout(base, name, corpus, args) -> dict:
    c = layout_config(base, name)
    devices = jax.devices()[:1] if name == "1dev" else jax.devices()[:8]
    mesh = make_mesh(c, devices)
    program = train_lib.build(c, mesh)
    plain = Plain(program)
    t = c.train
    tokens_per_step = t.batch_size * c.data.seq_len

    n_batches = max(args.steps, args.warmup)
    batches = [
        data_lib.global_batch(corpus, program.batch_sharding, c.seed, i, t.batch_size, c.data.seq_len)
        for i in range(n_batches)
    ]
    jax.block_until_ready(batches)

    j_state, p_state = program.init(), plain.init()
    start = time.perf_counter()
    j_step = program.train_step_fn().lower(j_state, batches[0]).compile()
    j_compile = time.perf_counter() - start
    start = time.perf_counter()
    p_step = plain.step.lower(p_state, batches[0]).compile()
    p_compile = time.perf_counter() - start

    j_loss_of = lambda metrics: _loss(metrics["loss"])
    p_loss_of = _loss

    # Warm-up, step by step, recording the losses (the first is the sanity check).
    j_losses, p_losses = [], []
    for i in range(args.warmup):
        j_state, loss = run_steps(j_step, j_state, batches[i : i + 1], j_loss_of)
        j_losses.append(loss)
        p_state, loss = run_steps(p_step, p_state, batches[i : i + 1], p_loss_of)
        p_losses.append(loss)
    first_match = bool(np.isclose(j_losses[0], p_losses[0], rtol=LOSS_RTOL, atol=0.0))

    timed = batches[: args.steps]
    j_times, p_times, j_cpu, p_cpu = [], [], [], []
    for _ in range(args.repeats):  # ABAB...: machine drift hits both alike
        start, cpu = time.perf_counter(), time.process_time()
        j_state, _ = run_steps(j_step, j_state, timed, j_loss_of)
        j_times.append(time.perf_counter() - start)
        j_cpu.append(time.process_time() - cpu)
        start, cpu = time.perf_counter(), time.process_time()
        p_state, _ = run_steps(p_step, p_state, timed, p_loss_of)
        p_times.append(time.perf_counter() - start)
        p_cpu.append(time.process_time() - cpu)

    j_tps = [args.steps * tokens_per_step / s for s in j_times]
    p_tps = [args.steps * tokens_per_step / s for s in p_times]
    j_med, p_med = statistics.median(j_tps), statistics.median(p_tps)
    sizes = {a: s for a, s in c.mesh.items() if s > 1}
    return {
        "layout": name,
        "mesh": sizes,
        "devices": len(devices),
        "n_kv_heads": c.model.n_kv_heads,
        "jaxsys_tokens_per_s": j_med,
        "plain_tokens_per_s": p_med,
        "ratio": j_med / p_med,
        "ratio_best": max(j_tps) / max(p_tps),
        # Each jaxsys run against the plain run right after it: robust to slow drift of the machine.
        "ratio_paired_median": statistics.median(j / p for j, p in zip(j_tps, p_tps)),
        "jaxsys_tokens_per_s_runs": j_tps,
        "plain_tokens_per_s_runs": p_tps,
        # CPU seconds of this process (all its threads) per step: less sensitive than wall time to
        # other processes sharing the cores, though it counts time spent spinning in collectives.
        "cpu_s_per_step_jaxsys": statistics.median(j_cpu) / args.steps,
        "cpu_s_per_step_plain": statistics.median(p_cpu) / args.steps,
        "first_loss_jaxsys": j_losses[0],
        "first_loss_plain": p_losses[0],
        "first_loss_match": first_match,
        "warmup_last_loss_jaxsys": j_losses[-1],
        "warmup_last_loss_plain": p_losses[-1],
        "compile_s_jaxsys": j_compile,
        "compile_s_plain": p_compile,
        "collectives_jaxsys": collective_counts(j_step),
        "collectives_plain": collective_counts(p_step),
    }


def markdown_table(results) -> str:
    lines = [
        "| layout | devices | jaxsys tokens/s | plain GSPMD tokens/s | ratio | loss match |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        mesh = ", ".join(f"{a}={s}" for a, s in r["mesh"].items()) or "-"
        match = "yes" if r["first_loss_match"] else "NO"
        lines.append(
            f"| {r['layout']} ({mesh}) | {r['devices']} | {r['jaxsys_tokens_per_s']:,.0f} | "
            f"{r['plain_tokens_per_s']:,.0f} | {r['ratio']:.2f}x | {match} "
            f"({r['first_loss_jaxsys']:.6f} vs {r['first_loss_plain']:.6f}) |"
        )
    return "\n".join(lines)


def collectives_table(results) -> str:
    fmt = lambda d: ", ".join(f"{k} {v}" for k, v in d.items()) or "none"
    lines = ["| layout | jaxsys collectives (compiled HLO) | plain GSPMD collectives (compiled HLO) |", "|---|---|---|"]
    for r in results:
        lines.append(f"| {r['layout']} | {fmt(r['collectives_jaxsys'])} | {fmt(r['collectives_plain'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per timed run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling (>= 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each program")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {','.join(LAYOUTS)}")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1:
        parser.error("--steps, --warmup and --repeats must be >= 1")
    if len(jax.devices()) < 8 and any(n != "1dev" for n in names):
        parser.error(f"the 8-device layouts need 8 devices, found {len(jax.devices())} ({jax.default_backend()})")

    base = load_config(os.path.join(_ROOT, "configs", "tiny.py"))
    corpus = data_lib.load_corpus(base.data)
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, {len(jax.devices())} devices, "
        f"{os.cpu_count()} host cores; tiny config: d_model {base.model.d_model}, "
        f"{base.model.n_layers} layers, T={base.data.seq_len}, B={base.train.batch_size}; "
        f"{args.steps} steps x {args.repeats} repeats after {args.warmup} warm-up steps",
        flush=True,
    )

    results = []
    for name in names:
        start = time.perf_counter()
        r = bench_layout(base, name, corpus, args)
        results.append(r)
        print(
            f"{name}: jaxsys {r['jaxsys_tokens_per_s']:,.0f} tok/s, plain "
            f"{r['plain_tokens_per_s']:,.0f} tok/s (medians), ratio {r['ratio']:.2f}x "
            f"(paired {r['ratio_paired_median']:.2f}x, best-of {r['ratio_best']:.2f}x); runs jaxsys "
            f"{[round(x) for x in r['jaxsys_tokens_per_s_runs']]} plain "
            f"{[round(x) for x in r['plain_tokens_per_s_runs']]}; CPU s/step jaxsys "
            f"{r['cpu_s_per_step_jaxsys']:.3f} plain {r['cpu_s_per_step_plain']:.3f}; first loss "
            f"{r['first_loss_jaxsys']:.6f} / {r['first_loss_plain']:.6f} "
            f"({'match' if r['first_loss_match'] else 'MISMATCH'}), loss after warm-up "
            f"{r['warmup_last_loss_jaxsys']:.6f} / {r['warmup_last_loss_plain']:.6f} "
            f"[{time.perf_counter() - start:.0f}s]",
            flush=True,
        )

    print()
    print(markdown_table(results))
    print()
    print(collectives_table(results))
    if args.json:
        meta = {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "host": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "tokens_per_step": base.train.batch_size * base.data.seq_len,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0 if all(r["first_loss_match"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
