"""Serving throughput through HTTP: the FastAPI/uvicorn server (jaxsys/serve/server.py) against the
hand-written http.server it replaced (read from git), side by side in one run, on one engine.

    .venv/bin/python scripts/server_throughput.py [--old-ref c567574] [--requests 64] [--clients 8]

The same closed-loop replay goes to each server in turn (old, new, old, new, ...): `clients`
threads each send their share of `requests` completions (prompts of 16-64 random bytes, 32 greedy
tokens, every other one streamed; one connection per request) over stdlib http.client and wait
for each answer. Reports completion tokens per second, mean request latency, mean time to the
first streamed bytes and failed requests (connection errors) per round, and the median over
rounds per server. configs/tiny.py's model (random weights) on one CPU
device; the engine is compiled (warmup) before the first round.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def old_server(ref: str):
    """The server module as it was at git `ref` (http.server and an EngineLoop thread)."""
    source = subprocess.run(
        ["git", "-C", ROOT, "show", f"{ref}:jaxsys/serve/server.py"], check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType("old_server")
    exec(compile(source, f"{ref}:jaxsys/serve/server.py", "exec"), module.__dict__)
    return module


def replay(port: int, requests: int, clients: int, max_tokens: int, seed: int) -> dict:
    import random

    rng = random.Random(seed)
    work = [
        {"prompt": [rng.randrange(32, 127) for _ in range(rng.randrange(16, 65))], "stream": i % 2 == 1}
        for i in range(requests)
    ]
    tokens, latencies, ttfts = [], [], []
    lock = threading.Lock()

    errors = []

    def one(conn, w, start: float) -> tuple[int, float | None]:
        """(tokens received, seconds from `start` to the first streamed bytes)."""
        conn.request("POST", "/v1/completions", json.dumps({**w, "max_tokens": max_tokens, "temperature": 0}))
        r = conn.getresponse()
        if not w["stream"]:
            return len(json.loads(r.read())["choices"][0]["token_ids"]), None
        first, buf = None, b""
        while chunk := r.read1(65536):
            first = first if first is not None else time.perf_counter() - start
            buf += chunk
        events = [e for e in buf.decode().split("\n\n") if e.startswith("data: {")]
        return sum(len(json.loads(e[6:])["choices"][0]["token_ids"]) for e in events), first

    def client(mine):
        for w in mine:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)  # one per request, as both allow
            start = time.perf_counter()
            try:
                n, first = one(conn, w, start)
            except (OSError, http.client.HTTPException) as e:
                with lock:
                    errors.append(repr(e))
                continue
            finally:
                conn.close()
            with lock:
                tokens.append(n)
                latencies.append(time.perf_counter() - start)
                if first is not None:
                    ttfts.append(first)

    threads = [threading.Thread(target=client, args=(work[c::clients],)) for c in range(clients)]
    start = time.perf_counter()
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - start
    assert all(n == max_tokens for n in tokens), "a request came back short"
    return {
        "errors": len(errors),
        "tok_s": sum(tokens) / wall,
        "latency_s": statistics.mean(latencies),
        "ttft_s": statistics.mean(ttfts) if ttfts else float("nan"),
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-ref", default="c567574", help="git ref of the http.server version")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per server, alternating")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from jaxsys import train
    from jaxsys.mesh import make_mesh
    from jaxsys.serve import engine, server
    from jaxsys.tokenizer import ByteTokenizer
    from tests.helpers import config_file

    config = config_file("tiny")
    program = train.build(config, make_mesh(config, jax.devices()[:1]))
    eng = engine.Engine(program, program.init(0).params, num_pages=256, page_size=16, token_budget=256, max_seqs=16)
    eng.warmup()
    old = old_server(args.old_ref)
    servers = {
        "old http.server": lambda: old.serve(eng, True, "tiny", "127.0.0.1", 0),
        "new FastAPI/uvicorn": lambda: server.serve(eng, ByteTokenizer(), "tiny", "127.0.0.1", 0),
    }
    results: dict = {name: [] for name in servers}
    for r in range(args.rounds):
        for name, start in servers.items():
            httpd, loop = start()
            threading.Thread(target=httpd.serve_forever, daemon=True).start()
            replay(httpd.server_address[1], 8, 4, 4, seed=99)  # warm the connection paths
            got = replay(httpd.server_address[1], args.requests, args.clients, args.max_tokens, seed=r)
            (old if name.startswith("old") else server).shutdown(httpd, loop)
            results[name].append(got)
            print(
                f"round {r} {name:22s} {got['tok_s']:8.1f} tok/s  latency {got['latency_s']:.3f} s  "
                f"TTFT {got['ttft_s']:.3f} s  ({got['wall_s']:.1f} s, {got['errors']} failed requests)",
                flush=True,
            )
    print(
        f"\n{args.requests} requests, {args.clients} clients, {args.max_tokens} tokens each; median of {args.rounds}:"
    )
    for name, rounds in results.items():
        med = lambda key: statistics.median(x[key] for x in rounds)
        failed = sum(x["errors"] for x in rounds)
        print(
            f"  {name:22s} {med('tok_s'):8.1f} tok/s  latency {med('latency_s'):.3f} s  TTFT {med('ttft_s'):.3f} s"
            f"  ({failed} failed requests in all)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
