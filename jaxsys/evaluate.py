"""Held-out loss and perplexity of a workdir's checkpoint: a trained run, a converted Hugging Face
model or a quantized one (`jaxsys.quantize`), on any mesh.

    python -m jaxsys.evaluate --workdir W [--step S] [--text FILE] [--json] [--config.key=value ...]

The config is the checkpoint's own (saved with it); overrides change how it runs, not what it is:
the mesh (`--config.mesh.tensor=4`), the batches (`--config.train.eval_batches=16`), the kernels
(`--config.model.quant_impl=reference`, `--config.model.attention_impl=...`). The loss is the mean
token cross-entropy over `train.eval_batches` batches of the corpus's held-out split, the same
function training evaluates with (`Program.eval_loss_fn`). The corpus is read as the model reads
text (jaxsys/tokenizer.py): bytes for a byte-level model, through the workdir's Hugging Face
tokenizer for a converted one (a text corpus for a model without a tokenizer is refused: its ids
are not bytes). `--text FILE` scores a text file instead: the file through the model's tokenizer is
the held-out split. The work is `jaxsys.train.evaluate_workdir`
(the checkpoint read by `jaxsys.checkpoint.load`); this module parses the command line and prints.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import data as data_lib
from jaxsys.config import ConfigError, parse_with_overrides
from jaxsys.tokenizer import TokenizerError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Held-out loss and perplexity of a jaxsys checkpoint.")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--text", metavar="FILE", help="score this text file (through the model's tokenizer)")
    args, overrides = parse_with_overrides(parser, argv, "--config.mesh.tensor=4")
    from jaxsys import train

    try:
        result = train.evaluate_workdir(args.workdir, overrides, args.step, args.text)
    except (ConfigError, checkpoint_lib.CheckpointError, data_lib.DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        quant = result["quant"] + (f" (G={result['quant_group_size']})" if result["quant"].startswith("w4") else "")
        print(
            f"{args.workdir} step {result['step']}{' on ' + args.text if args.text else ''}: eval loss {result['eval_loss']:.4f}, perplexity "
            f"{result['perplexity']:.3f} over {result['tokens']:,} tokens; weights {quant}, "
            f"{result['param_bytes'] / 2**20:.2f} MiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
