"""Held-out loss and perplexity of a workdir's checkpoint: a trained run, a converted Hugging Face
model or a quantized one (`jaxsys.quantize`), on any mesh.

    python -m jaxsys.evaluate --workdir W [--step S] [--json] [--config.key=value ...]

The config is the checkpoint's own (saved with it); overrides change how it runs, not what it is:
the mesh (`--config.mesh.tensor=4`), the batches (`--config.train.eval_batches=16`), the kernels
(`--config.model.quant_impl=reference`, `--config.model.attention_impl=...`). The loss is the mean
token cross-entropy over `train.eval_batches` batches of the corpus's held-out split, the same
function training evaluates with (`Program.eval_loss_fn`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import data as data_lib
from jaxsys.config import ConfigError, parse_with_overrides


def evaluate_workdir(workdir: str, overrides=(), step: int | None = None) -> dict:
    """{"eval_loss", "perplexity", "tokens", "step", "quant", "param_bytes", ...} of `workdir`."""
    from jaxsys import program as program_lib
    from jaxsys import train
    from jaxsys.mesh import cpu_unless_accelerator, mesh_for

    cpu_unless_accelerator()
    config, step = checkpoint_lib.saved_config(workdir, overrides, step)
    mesh = mesh_for(config)
    corpus = data_lib.load_corpus(config.data)
    if not corpus.has_eval:
        raise data_lib.DataError(
            f"the corpus of {workdir} ({corpus.description}) has no held-out split: set --config.data.eval_fraction > 0"
        )
    program = program_lib.build(config, mesh)
    params, step = checkpoint_lib.restore_params(workdir, program.abstract_state().params, f"--workdir {workdir}")
    start = time.perf_counter()
    loss = train.evaluate(program, program.eval_loss_fn(), params, corpus)
    c = config
    return {
        "workdir": workdir,
        "step": int(step),
        "eval_loss": loss,
        "perplexity": math.exp(loss),
        "tokens": c.train.eval_batches * c.train.batch_size * c.data.seq_len,
        "quant": c.model.quant,
        "quant_group_size": c.model.quant_group_size,
        "quant_zero_point": c.model.quant_zero_point,
        "quant_impl": c.model.quant_impl,
        "param_bytes": sum(a.nbytes for a in jax.tree.leaves(params)),
        "mesh": {a: s for a, s in program.layout.mesh_sizes.items() if s > 1},
        "seconds": time.perf_counter() - start,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Held-out loss and perplexity of a jaxsys checkpoint.")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args, overrides = parse_with_overrides(parser, argv, "--config.mesh.tensor=4")
    try:
        result = evaluate_workdir(args.workdir, overrides, args.step)
    except (ConfigError, checkpoint_lib.CheckpointError, data_lib.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        quant = result["quant"] + (f" (G={result['quant_group_size']})" if result["quant"] == "w4a16" else "")
        print(
            f"{args.workdir} step {result['step']}: eval loss {result['eval_loss']:.4f}, perplexity "
            f"{result['perplexity']:.3f} over {result['tokens']:,} tokens; weights {quant}, "
            f"{result['param_bytes'] / 2**20:.2f} MiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
