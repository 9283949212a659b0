"""The `jaxsys` command: one entry point for every `python -m jaxsys.<module>` command.

    jaxsys train --config configs/tiny.py --workdir /tmp/tiny
    jaxsys analyze --config configs/llama_1b.py --target v5p-16
    jaxsys <command> --help

Each subcommand hands the rest of the line, unchanged, to the module's own parser, so
`jaxsys train ...` and `python -m jaxsys.train ...` take the same flags. Modules are imported only
when their command runs (most of them start JAX).
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, entry function taking argv, one line of help)
COMMANDS = {
    "train": ("jaxsys.train", "cli", "train a config (checkpoints, metrics, resume)"),
    "tokenize": ("jaxsys.tokenize", "main", "tokenize a corpus of documents once into memory-mapped shards"),
    "analyze": ("jaxsys.analyze", "main", "memory, FLOPs and communication of a config, ahead of time"),
    "plan": ("jaxsys.plan", "main", "choose a layout for N devices: enumerate, prune, rank, compile the best"),
    "evaluate": ("jaxsys.evaluate", "main", "held-out loss and perplexity of a checkpoint"),
    "generate": ("jaxsys.generate", "main", "continue a prompt from a checkpoint"),
    "serve": ("jaxsys.serve.__main__", "main", "the HTTP server over the continuous-batching engine"),
    "bench-serve": ("jaxsys.bench_serve", "main", "replay a request trace against the engine (TTFT/TPOT)"),
    "quantize": ("jaxsys.quantize", "main", "RTN or GPTQ weight quantization into a new workdir"),
    "convert": ("jaxsys.convert", "main", "Hugging Face Llama safetensors to and from jaxsys checkpoints"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {doc}" for name, (_, _, doc) in COMMANDS.items()]
    return "usage: jaxsys <command> [flags]   (jaxsys <command> --help for its flags)\n\ncommands:\n" + "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"jaxsys: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, entry, _ = COMMANDS[name]
    sys.argv = [f"jaxsys {name}", *rest]  # so that each parser's usage line names the command
    result = getattr(importlib.import_module(module), entry)(rest)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
