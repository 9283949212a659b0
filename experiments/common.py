"""What every experiment's run.py shares:

workers   run a worker in a fresh subprocess (each needs its own device count or memory) and
          collect the JSON results it prints: `run_worker`, `emit`, `worker_devices`
timing    seconds per train step of a config on some devices: `train_step_seconds`
losses    loss curves of configs/tiny.py under a few train settings: `loss_curves`
command   the flags of a sweep (--quick, --replot, the hidden --worker N): `parse_args`
results   results.json next to the run.py: `save_results`, `load_results`
tables    a markdown table from header, alignment and rows: `markdown_table`
plots     matplotlib without a display, the usual axis styling, and the save: `pyplot`,
          `style_axes`, `save_figure`
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "@@RESULT@@"


def emit(result: dict) -> None:
    """Called in a worker: hand one result back to the parent."""
    print(MARK + json.dumps(result), flush=True)


def run_worker(script: str, n: int, jobs: list, timeout: int = 1800, what: str = "N") -> list[dict]:
    """Run `script --worker n` with `jobs` as JSON on stdin, without the parent's XLA_FLAGS (the
    worker sets its own device count); return what it `emit`ted."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(script), "--worker", str(n)],
        input=json.dumps(jobs),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"worker for {what}={n} failed (rc {proc.returncode})")
    return [json.loads(line[len(MARK) :]) for line in proc.stdout.splitlines() if line.startswith(MARK)]


def worker_devices(n: int) -> None:
    """In a worker, before jax is imported: run on n simulated CPU devices."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def train_step_seconds(config, devices, clock=None, repeats: int = 3, steps: int = 5) -> list[float]:
    """Seconds per train step of `config` on `devices` (random tokens): compiled ahead of time, two
    warm-up steps, then `repeats` runs of `steps` steps, one figure per run. `clock`: time.perf_counter
    (wall, the default) or time.process_time (the process's CPU seconds: the work, whatever else
    shares the cores)."""
    import time

    import jax
    import numpy as np

    from jaxsys import program as program_lib
    from jaxsys.mesh import make_mesh

    clock = clock or time.perf_counter
    program = program_lib.build(config, make_mesh(config, devices))
    state = program.init()
    tokens = np.random.default_rng(0).integers(
        0, config.model.vocab_size, (config.train.batch_size, config.data.seq_len + 1), dtype=np.int32
    )
    batch = jax.device_put(tokens, program.batch_sharding)
    step = program.train_step_fn().lower(state, batch).compile()
    for _ in range(2):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    runs = []
    for _ in range(repeats):
        start = clock()
        for _ in range(steps):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        runs.append((clock() - start) / steps)
    return runs


# ----------------------------------------------------------------------------- command


def loss_curves(runs: dict, steps: int, log_every: int = 10, config: str = "configs/tiny.py") -> dict:
    """Train `config` once per entry of `runs` {name: {train key: value}} for `steps` steps in a
    temporary workdir (eval three times); {name: overrides, seconds, steps, curve [{step, loss,
    eval_loss where evaluated}]}, a line printed per run."""
    import tempfile
    import time

    from jaxsys import train
    from jaxsys.config import load_config

    out = {}
    for name, keys in runs.items():
        c = load_config(
            config,
            [f"--config.train.{k}={v}" for k, v in keys.items()]
            + [
                f"--config.train.steps={steps}",
                f"--config.train.log_every={log_every}",
                "--config.train.progress=false",
                f"--config.train.eval_every={max(steps // 3, 1)}",
            ],
        )
        with tempfile.TemporaryDirectory() as workdir:
            t0 = time.time()
            records = train.main(c, workdir)
            seconds = time.time() - t0
        out[name] = dict(
            overrides=keys,
            seconds=seconds,
            steps=steps,
            curve=[
                dict(step=r["step"], loss=r["loss"], **({"eval_loss": r["eval_loss"]} if "eval_loss" in r else {}))
                for r in records
            ],
        )
        last = records[-1]
        print(
            f"loss {name}: step {last['step']} loss {last['loss']:.3f} "
            f"eval {last.get('eval_loss', float('nan')):.3f} ({seconds:.0f} s)",
            flush=True,
        )
    return out


def parse_args(
    doc: str, worker, quick: str, replot: str = "tables and plot from results.json", add=None
) -> argparse.Namespace:
    """The flags of a sweep: --quick (help `quick`), --replot (help `replot`) and the hidden
    --worker N, which runs `worker(N, jobs read as JSON from stdin)` and exits. `add(parser)` adds
    the experiment's own flags. The description is the first paragraph of `doc`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--replot", action="store_true", help=replot)
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    if add is not None:
        add(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, json.loads(sys.stdin.read()))
        sys.exit(0)
    return args


# ----------------------------------------------------------------------------- results


def save_results(here: str, results: dict, name: str = "results.json") -> str:
    """Write `results` as indented JSON to here/name; return the path."""
    path = os.path.join(here, name)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    return path


def load_results(here: str, name: str = "results.json") -> dict:
    with open(os.path.join(here, name)) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- tables


def markdown_table(header: list[str], align: str, rows) -> list[str]:
    """The lines of a markdown table: `header` the column titles, `align` one letter a column
    ("l" left, "r" right), `rows` lists of cells (each written with str)."""
    if len(align) != len(header):
        raise ValueError(f"{len(header)} columns, {len(align)} alignments")
    rule = {"l": "---", "r": "---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "".join(rule[a] + "|" for a in align)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


# ----------------------------------------------------------------------------- plots


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def style_axes(
    ax,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    xlog: int | None = None,
    ylog: int | None = None,
    grid: str = "both",
    legend: int | None = 8,
) -> None:
    """Log scales (base `xlog` / `ylog`, None: linear), labels, title, a light grid on `grid`'s
    ticks (None: no grid) and a legend of font size `legend` (None: no legend)."""
    if xlog:
        ax.set_xscale("log", base=xlog)
    if ylog:
        ax.set_yscale("log", base=ylog)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title)
    if grid is not None:
        ax.grid(True, which=grid, alpha=0.3)
    if legend is not None:
        ax.legend(fontsize=legend)


def save_figure(fig, path: str, dpi: int = 110, rect=None) -> None:
    """Tight layout (within `rect`, if given) and save."""
    if rect is None:
        fig.tight_layout()
    else:
        fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=dpi)
