"""Tokenize a config's corpus of documents once, into the memory-mapped shards training reads.

    python -m jaxsys.tokenize --config C [--verify] [--workers N] [--config.data.key=value ...]

For config.data.source jsonl, parquet or hf (docs/data.md): the documents are read, tokenized by
config.data.tokenizer in worker processes, one shard per unit of config.data.shard_docs records,
with a progress bar. Interrupted, the same command finishes the shards still missing; run on a
complete cache, it checks every shard against the ledger (`--verify`: also their SHA-256) and
rebuilds any damaged or missing one. Prints the cache directory and its totals. The work is
`jaxsys.data.shards.build`.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxsys.config import ConfigError, load_config, parse_with_overrides
from jaxsys.data import DataError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Tokenize a config's corpus of documents into shards.")
    parser.add_argument("--config", required=True, help="configs/<name>.py[:arg]")
    parser.add_argument("--verify", action="store_true", help="also check the SHA-256 of every finished shard")
    parser.add_argument(
        "--workers", type=int, default=None, help="worker processes (default config.data.tokenize_workers)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args, overrides = parse_with_overrides(parser, argv, "--config.data.path=corpus/*.jsonl")
    from jaxsys.data import shards

    try:
        config = load_config(args.config, overrides)
        if config.data.source not in shards.documents_sources():
            raise DataError(
                f"config.data.source={config.data.source!r} is not a corpus of documents: the tokenize command "
                f"builds the shards of {shards.documents_sources()} (stdlib, text and tokens are read as they are)"
            )
        directory = shards.build(config.data, progress=not args.quiet, verify=args.verify, workers=args.workers)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(f"{directory}/manifest.json") as f:
        manifest = json.load(f)
    print(
        f"jaxsys.tokenize: {manifest['docs']} documents, {manifest['tokens']} tokens in {manifest['shards']} "
        f"shards ({manifest['dtype']}), vocab_needed {manifest['vocab_needed']}: {directory}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
