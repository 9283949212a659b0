"""An HTTP endpoint over the engine, for local use: completions in the shape of OpenAI's API.

    python -m jaxsys.serve --workdir W [--port 8000] [--pages 256 --page-size 16 --token-budget 256
        --chunk-size 64 --max-seqs 16] [--config.key=value ...]
    curl localhost:8000/v1/completions -d '{"prompt": "def main(", "max_tokens": 32, "stream": true}'

POST /v1/completions takes {"prompt": str (text for a byte-level model, else a list of token
ids), "max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int,
"stream": bool}; it answers {"id", "object": "text_completion", "created", "model", "choices":
[{"index": 0, "text", "token_ids", "finish_reason": "length"}], "usage": {...}}, or with "stream"
server-sent events, one `data: {...}` chunk per token and `data: [DONE]`. GET /health answers
{"status": "ok", ...}. A bad request gets 400 with {"error": {"message": ...}} and the server
goes on. One thread runs the engine's steps; each request waits on its own queue.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jaxsys import data as data_lib
from jaxsys.serve.engine import EngineAPI
from jaxsys.serve.sampling import Sampling

FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "model"}


class BadRequest(ValueError):
    pass


class EngineLoop:
    """The engine, stepped by one thread; `submit` returns a queue of (token, finished) items."""

    def __init__(self, engine: EngineAPI):
        self.engine = engine
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.queues: dict = {}
        self.ids = itertools.count()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def submit(self, prompt, max_tokens, sampling) -> tuple[str, queue.Queue]:
        rid = f"cmpl-{next(self.ids)}"
        out = queue.Queue()
        with self.lock:
            self.engine.submit(rid, prompt, max_tokens, sampling)  # ValueError: refused
            self.queues[rid] = out
        self.wake.set()
        return rid, out

    def _run(self):
        while not self.stopped:
            with self.lock:
                idle = self.engine.idle
            if idle:
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            with self.lock:
                try:
                    work, sampled = self.engine.step()
                except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
                    for q in self.queues.values():
                        q.put(e)
                    self.queues.clear()
                    continue
                for w in work:
                    rid = w.request.id
                    if rid in sampled and rid in self.queues:
                        q = self.queues[rid]
                        out = sampled[rid] if isinstance(sampled[rid], list) else [sampled[rid]]  # speculative: several
                        for j, token in enumerate(out):
                            q.put((token, w.request.done and j == len(out) - 1))
                        if w.request.done:
                            del self.queues[rid]

    def stop(self):
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=5)


def parse_request(body: bytes, byte_level: bool, vocab: int) -> dict:
    """The completion request's fields, checked; BadRequest names what is wrong."""
    try:
        req = json.loads(body or b"{}")
    except ValueError as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(req, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(req) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown fields {unknown}; this endpoint takes {sorted(FIELDS)}")
    prompt = req.get("prompt")
    if byte_level and isinstance(prompt, str):
        ids = data_lib.byte_encode(prompt).astype(int).tolist()
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = prompt
    else:
        raise BadRequest(
            "prompt must be a string"
            + (" or " if byte_level else ": no, ")
            + "a list of token ids"
            + ("" if byte_level else " (this model has no text tokenizer)")
        )
    if not ids:
        raise BadRequest("prompt is empty: give at least one token of context")
    if any(not 0 <= t < vocab for t in ids):
        raise BadRequest(f"token ids must lie in [0, {vocab})")
    fields = {
        "max_tokens": (int, 16),
        "temperature": ((int, float), 0.0),
        "top_p": ((int, float), 1.0),
        "top_k": (int, 0),
        "seed": (int, 0),
        "stream": (bool, False),
    }
    out = {"prompt": ids}
    for name, (kind, default) in fields.items():
        value = req.get(name, default)
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise BadRequest(f"{name} must be {getattr(kind, '__name__', 'a number')}; got {value!r}")
        out[name] = value
    if out["max_tokens"] < 1:
        raise BadRequest(f"max_tokens={out['max_tokens']} must be >= 1")
    if out["temperature"] < 0 or out["top_k"] < 0 or not 0 < out["top_p"] <= 1:
        raise BadRequest("sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
    return out


def make_handler(loop: EngineLoop, byte_level: bool, vocab: int, model_name: str):
    def text_of(ids):
        return data_lib.byte_decode(ids) if byte_level else ""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: the tests and the terminal stay readable
            pass

        def _json(self, status: int, payload: dict):
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._json(200, {"status": "ok", "model": model_name})
            else:
                self._json(404, {"error": {"message": f"no route GET {self.path}; try POST /v1/completions"}})

        def do_POST(self):
            if self.path != "/v1/completions":
                self._json(404, {"error": {"message": f"no route POST {self.path}; use /v1/completions"}})
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                req = parse_request(body, byte_level, vocab)
                sampling = Sampling(float(req["temperature"]), req["top_k"], float(req["top_p"]), req["seed"])
                rid, tokens = loop.submit(req["prompt"], req["max_tokens"], sampling)
            except ValueError as e:  # BadRequest, or the engine's refusal (too long for the pool)
                self._json(400, {"error": {"message": str(e), "type": "invalid_request_error"}})
                return
            created = int(time.time())
            if req["stream"]:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
            ids = []
            while True:
                item = tokens.get(timeout=600)
                if isinstance(item, Exception):
                    self._json(500, {"error": {"message": f"the engine failed: {item}"}})
                    return
                token, done = item
                ids.append(token)
                if req["stream"]:
                    chunk = {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "choices": [
                            {
                                "index": 0,
                                "text": text_of([token]),
                                "token_ids": [token],
                                "finish_reason": "length" if done else None,
                            }
                        ],
                    }
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                if done:
                    break
            if req["stream"]:
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                return
            self._json(
                200,
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [{"index": 0, "text": text_of(ids), "token_ids": ids, "finish_reason": "length"}],
                    "usage": {
                        "prompt_tokens": len(req["prompt"]),
                        "completion_tokens": len(ids),
                        "total_tokens": len(req["prompt"]) + len(ids),
                    },
                },
            )

    return Handler


def serve(engine: EngineAPI, byte_level: bool, model_name: str, host: str = "127.0.0.1", port: int = 8000):
    """Start the server (port 0: any free port). Returns (server, loop); `server.serve_forever()`
    blocks, or run it in a thread; `shutdown(server, loop)` stops both."""
    loop = EngineLoop(engine)
    handler = make_handler(loop, byte_level, engine.program.config.model.vocab_size, model_name)
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server, loop


def shutdown(server, loop) -> None:
    server.shutdown()
    server.server_close()
    loop.stop()
