"""The HTTP server over the engine: OpenAI's completions and chat completions API (FastAPI on
uvicorn, as vLLM and SGLang serve), for local use and for evaluation harnesses.

    python -m jaxsys.serve --workdir W [--port 8000] [--api-key K] [--served-model-name NAME]
    curl localhost:8000/v1/completions -d '{"prompt": "def main(", "max_tokens": 32, "stream": true}'

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, and vLLM's
tokenizer routes (GET /tokenizer_info, POST /tokenize, POST /detokenize; lm-evaluation-harness's
"remote" tokenizer reads them). Requests and their bounds are jaxsys/serve/protocol.py; every bad
request is a 4xx {"error": {"message", "type", "param", "code"}} naming the field.

Threads: one thread (`EngineLoop`) owns the engine: it takes submissions and aborts from a command
queue between steps, steps the engine, and hands each request's new tokens, detokenized, with stop
strings matched and logprobs, to that request's queue on the event loop. Requests wait on their own
queues; nothing else touches the engine. A client that disconnects has its requests aborted (pages
freed at the next command drain). A step that fails fails its requests only (the engine marks them
finished with finish_reason "error"); the server goes on serving.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import inspect
import itertools
import logging
import math
import queue
import secrets
import socket
import threading
import time
import uuid
from typing import Any, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from jaxsys.serve import protocol
from jaxsys.serve.engine import EngineAPI
from jaxsys.serve.protocol import ApiError
from jaxsys.serve.sampling import Sampling

log = logging.getLogger("jaxsys.serve")

MAX_BODY = 16 << 20  # bytes of a request body (--max-body-bytes)
MAX_QUEUE = 256  # requests waiting for their first token (--max-queue)


def context_length(engine) -> int:
    """The most tokens (prompt + generated) one sequence can hold: the engine's max_len, at most
    one batch shard's pool (a disaggregated engine: its decode side's)."""
    eng = getattr(engine, "decode", engine)
    pool = eng.pools[0]
    return min(eng.max_len, pool.num_pages * pool.page_size)


# ----------------------------------------------------------------------------- the engine's thread


@dataclasses.dataclass
class Piece:
    """What one sequence gave since it was last looked at: one generated token (None: a finish
    without a new token), the text that token releases (complete characters, nothing that could
    still become a stop string), its logprob and top alternatives [(id, logprob)], and on the last
    piece the finish_reason ("stop", "length", "error") and the error. A sequence's first piece
    carries its prompt's logprobs when they were asked for."""

    token: int | None
    text: str = ""
    logprob: float | None = None
    top: list | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_logprobs: list | None = None
    prompt_top: list | None = None  # per prompt token, its top alternatives [(id, logprob)]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class SeqSpec:
    """One engine request to submit: `sink(pieces)` is called from the engine's thread with each
    batch of new pieces; `stop`: stop strings; `fork_of`: a request of the same submission with
    the same prompt whose prefill this one shares (n > 1)."""

    rid: str
    prompt: list
    max_new_tokens: int
    sampling: Sampling
    sink: Callable[[list], None]
    stop: tuple = ()
    fork_of: str | None = None


class _Seq:
    """A live request as the engine's thread follows it: detokenizes its new tokens incrementally,
    matches stop strings across token boundaries, and holds back text that could still begin one."""

    def __init__(self, spec: SeqSpec, request, tokenizer):
        self.spec, self.request = spec, request
        self.detok = tokenizer.detokenizer() if tokenizer is not None else None
        self.stops = tuple(spec.stop)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.stop_ids = frozenset(spec.sampling.stop_ids)
        self.text = ""  # the detokenized generation so far (cut where a stop string begins)
        self.sent = 0  # characters of it delivered
        self.seen = 0  # generated tokens looked at
        self.first = True

    def advance(self) -> tuple[list[Piece], bool, bool]:
        """(the new pieces, finished, a stop string ended it while the engine still runs it)."""
        r = self.request
        reason = r.finish_reason or ("length" if r.done else None)  # an engine that sets no reason: its length
        new = r.generated[self.seen :]
        pieces: list[Piece] = []
        for j, token in enumerate(new):
            i = self.seen
            self.seen += 1
            eos = reason == "stop" and j == len(new) - 1 and token in self.stop_ids
            matched = self._append("" if eos or self.detok is None else self.detok.push([int(token)]))
            logprob = r.logprobs[i] if i < len(r.logprobs) else None
            top = r.top_logprobs[i] if i < len(r.top_logprobs) else None
            pieces.append(Piece(int(token), self._release(final=matched), logprob, top))
            if matched:  # a stop string: the tokens after it (a speculative step's) are dropped
                pieces[-1].finish_reason = "stop"
                return self._first(pieces), True, reason is None
        if reason is None:
            return self._first(pieces), False, False
        matched = self._append(self.detok.flush() if self.detok is not None else "")
        if not pieces or pieces[-1].token is None:
            pieces.append(Piece(None))
        last = pieces[-1]
        last.text += self._release(final=True)
        last.finish_reason = "stop" if matched else reason
        last.error = r.error if reason == "error" else None
        return self._first(pieces), True, False

    def _first(self, pieces: list[Piece]) -> list[Piece]:
        if pieces and self.first:
            self.first = False
            if self.spec.sampling.prompt_logprobs:
                lps = list(self.request.prompt_logprobs)
                whole = len(lps) == len(self.request.prompt)
                pieces[0].prompt_logprobs = lps if whole else None
                pieces[0].prompt_top = list(self.request.prompt_top_logprobs) if whole else None
        return pieces

    def _append(self, delta: str) -> bool:
        """Add detokenized text; True if a stop string now occurs (the text is cut where it begins)."""
        if not delta:
            return False
        before = len(self.text)
        self.text += delta
        if not self.stops:
            return False
        start = max(0, before - self.longest + 1)  # a new match ends in the new text
        hits = [k for k in (self.text.find(s, start) for s in self.stops) if k >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string (not yet deliverable)."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, final: bool) -> str:
        end = len(self.text) - (0 if final else self._held())
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out


class EngineLoop:
    """The engine, owned by one thread. Other threads call `submit_group`, `abort` (commands, run
    between steps) or `submit` (blocking, for callers on a thread); pieces go to each spec's sink."""

    def __init__(self, engine: EngineAPI, tokenizer=None):
        self.engine, self.tokenizer = engine, tokenizer
        # n > 1 shares the prompt's prefill where the engine can (Engine.submit's fork_of)
        self.forks = "fork_of" in inspect.signature(engine.submit).parameters
        self.commands: collections.deque = collections.deque()
        self.wake = threading.Event()
        self.live: dict[str, _Seq] = {}
        self.ids = itertools.count()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="jaxsys-engine", daemon=True)
        self.thread.start()

    # -- from other threads
    def submit_group(self, specs: list[SeqSpec], done: Callable[[Exception | None], None]) -> None:
        """Submit `specs` together (all or none): `done(None)`, or `done(error)` if the engine
        refused one (a ValueError naming why); called from the engine's thread."""
        self.commands.append(("submit", specs, done))
        self.wake.set()

    def abort(self, rids) -> None:
        """Drop these requests wherever they are (pages freed); no more pieces for them."""
        self.commands.append(("abort", list(rids), None))
        self.wake.set()

    def submit(self, prompt: list, max_tokens: int, sampling: Sampling, stop=()) -> tuple[str, queue.Queue]:
        """Submit one request from a thread other than the engine's: (its id, a queue of its
        `Piece`s); ValueError if the engine refuses it."""
        rid = f"req-{next(self.ids)}"
        out: queue.Queue = queue.Queue()
        result: list = []
        accepted = threading.Event()

        def sink(pieces: list) -> None:
            for p in pieces:
                out.put(p)

        def done(error: Exception | None) -> None:
            result.append(error)
            accepted.set()

        self.submit_group([SeqSpec(rid, list(prompt), max_tokens, sampling, sink, tuple(stop))], done)
        while not accepted.wait(1.0):
            if not self.thread.is_alive():
                raise RuntimeError("the engine's thread has stopped")
        if result[0] is not None:
            raise result[0]
        return rid, out

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=5)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopped

    # -- the engine's thread
    def _run(self) -> None:
        while not self.stopped:
            try:
                self.wake.clear()
                self._commands()
                if self.engine.idle:
                    self.wake.wait(0.05)
                    continue
                try:
                    self.engine.step()
                except Exception as e:  # the engine fails its step's requests itself; if not, all
                    log.exception("engine step failed; failing every request in flight")
                    self._fail_all(f"the engine failed: {type(e).__name__}: {e}")
                self._publish()
                self.engine.forget_finished()  # the server holds what it still streams
            except Exception:  # a bug here must not stop the server: fail what is in flight
                log.exception("engine loop error; failing every request in flight")
                self._fail_all("the server failed while following this request")

    def _commands(self) -> None:
        while self.commands:
            kind, payload, done = self.commands.popleft()
            if kind == "abort":
                for rid in payload:
                    if self.live.pop(rid, None) is not None:
                        self.engine.abort(rid)
                continue
            error, accepted = None, []
            try:
                for spec in payload:
                    fork = {"fork_of": spec.fork_of} if spec.fork_of is not None and self.forks else {}
                    request = self.engine.submit(spec.rid, spec.prompt, spec.max_new_tokens, spec.sampling, **fork)
                    accepted.append(spec.rid)
                    self.live[spec.rid] = _Seq(spec, request, self.tokenizer)
            except Exception as e:  # noqa: BLE001 - a refusal (ValueError) or a failure: the caller answers it
                error = e
                for rid in accepted:
                    self.live.pop(rid, None)
                    self.engine.abort(rid)
            try:
                done(error)
            except Exception:  # noqa: BLE001 - the caller is gone (its event loop closed)
                for spec in payload:
                    if self.live.pop(spec.rid, None) is not None:
                        self.engine.abort(spec.rid)

    def _publish(self) -> None:
        for rid, seq in list(self.live.items()):
            try:
                pieces, finished, stop_now = seq.advance()
            except Exception as e:  # noqa: BLE001 - e.g. a token the tokenizer cannot decode
                log.exception("request %s failed while being detokenized", rid)
                pieces, finished, stop_now = (
                    [Piece(None, finish_reason="error", error=f"{type(e).__name__}: {e}")],
                    True,
                    False,
                )
                self.engine.abort(rid)
            if stop_now:
                self.engine.finish(rid, "stop")
            if finished:
                del self.live[rid]
            if pieces:
                _deliver(seq.spec, pieces)

    def _fail_all(self, message: str) -> None:
        for rid, seq in list(self.live.items()):
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
            _deliver(seq.spec, [Piece(None, finish_reason="error", error=message)])
        self.live.clear()


def _deliver(spec: SeqSpec, pieces: list) -> None:
    try:
        spec.sink(pieces)
    except Exception:  # noqa: BLE001 - the waiting side is gone (event loop closed at shutdown)
        pass


# ----------------------------------------------------------------------------- text


def token_text(tokenizer, token: int) -> str:
    """A token as OpenAI's logprobs name it: its text, or "token_id:<id>" where it is not text on
    its own (no tokenizer, or part of a multi-byte character)."""
    if tokenizer is None:
        return f"token_id:{token}"
    text = tokenizer.decode([token])
    return f"token_id:{token}" if "\ufffd" in text or not text else text


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt ids of a conversation, by the tokenizer's chat template (`encode_chat`: the
    template writes its own special tokens); ApiError(400) naming the problem when the model has no
    tokenizer or its tokenizer no template, or the template refuses the conversation."""
    from jaxsys.tokenizer import TokenizerError

    name = getattr(tokenizer, "name", "none") if tokenizer is not None else "none"
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            400,
            f"messages: this model's tokenizer ({name}) has no chat template, so /v1/chat/completions cannot "
            "render a conversation; use /v1/completions with the prompt text",
            param="messages",
        )
    try:
        return [int(t) for t in tokenizer.encode_chat(messages, add_generation_prompt=True)]
    except TokenizerError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None


def _finite(x):
    """JSON has no -inf: a logprob of an impossible token is reported as -9999.0 (as vLLM does)."""
    return x if x is None or math.isfinite(x) else -9999.0


# ----------------------------------------------------------------------------- one HTTP request's generation


class Generation:
    """The engine requests of one HTTP request (prompts x n choices) and their pieces, on the
    event loop: `start` submits them (ApiError 400 if refused, 429 if the queue is full), `events`
    yields (choice index, pieces) until every choice has finished, `close` aborts what has not."""

    def __init__(self, state: "ServerState", specs: list[tuple[int, SeqSpec]]):
        self.state, self.specs = state, specs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.aloop = asyncio.get_running_loop()
        self.open = {index for index, _ in specs}
        self.waiting = False
        self.gone = False  # the client disconnected
        for index, spec in specs:
            spec.sink = lambda pieces, index=index: self.aloop.call_soon_threadsafe(
                self.queue.put_nowait, (index, pieces)
            )

    async def start(self) -> None:
        st = self.state
        if st.waiting >= st.max_queue:
            raise ApiError(
                429,
                f"the server has {st.waiting} requests waiting for their first token (--max-queue "
                f"{st.max_queue}); retry later",
            )
        st.waiting += 1
        self.waiting = True
        submitted: asyncio.Future = self.aloop.create_future()
        settle = lambda error: None if submitted.done() else submitted.set_result(error)
        st.loop.submit_group([s for _, s in self.specs], lambda e: self.aloop.call_soon_threadsafe(settle, e))
        error = await submitted
        if error is not None:
            self.open.clear()
            self._unwait()
            if isinstance(error, ValueError):
                raise ApiError(400, str(error))
            raise ApiError(500, f"the engine could not take the request: {type(error).__name__}: {error}")

    def _unwait(self) -> None:
        if self.waiting:
            self.waiting = False
            self.state.waiting -= 1

    async def events(self):
        while self.open and not self.gone:
            index, pieces = await self.queue.get()
            if index < 0:
                return
            self._unwait()
            if any(p.done for p in pieces):
                self.open.discard(index)
            yield index, pieces

    def disconnected(self) -> None:
        """The client has gone: abort, and wake `events`."""
        self.gone = True
        self.close()
        self.queue.put_nowait((-1, []))

    def close(self) -> None:
        self._unwait()
        if self.open:
            self.state.loop.abort([s.rid for index, s in self.specs if index in self.open])
            self.open.clear()


async def _disconnected(raw) -> None:
    """Returns when the client has gone (the request body was read before)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(raw, work):
    """`work`'s result, or None if the client disconnected first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


# ----------------------------------------------------------------------------- the app


@dataclasses.dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: Any
    model_name: str
    context: int
    vocab: int
    api_key: str | None = None
    max_queue: int = MAX_QUEUE
    max_body: int = MAX_BODY
    waiting: int = 0  # requests waiting for their first token (the event loop's count)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def build_app(state: ServerState):
    """The FastAPI app over `state.loop`."""
    app = FastAPI(title="jaxsys.serve", version="1", docs_url=None, redoc_url=None)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(raw, e: HTTPException):
        message = f"no route {raw.method} {raw.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse(ApiError(e.status_code, message).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        return JSONResponse(ApiError(400, str(e.errors()[:1])).body(), status_code=400)

    def authorized(raw: Request) -> None:
        if state.api_key is None:
            return
        got = raw.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {state.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'")

    auth = [Depends(authorized)]

    async def body_of(raw: Request) -> bytes:
        declared = raw.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > state.max_body:
            raise ApiError(413, f"the request body has {declared} bytes; this server takes at most {state.max_body}")
        chunks, size = [], 0
        async for chunk in raw.stream():
            size += len(chunk)
            if size > state.max_body:
                raise ApiError(413, f"the request body exceeds {state.max_body} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist: this server serves `{state.model_name}` (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            return JSONResponse(ApiError(503, "the engine's thread has stopped").body(), status_code=503)
        return {"status": "ok", "model": state.model_name}

    @app.get("/v1/models", dependencies=auth)
    async def models():
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "jaxsys"}
        return {"object": "list", "data": [{**card, "max_model_len": state.context}]}

    @app.get("/tokenizer_info", dependencies=auth)
    async def tokenizer_info():
        tok = state.tokenizer
        if tok is None:
            raise ApiError(404, "this model has no text tokenizer")
        eos = tok.decode(list(tok.eos_ids[:1])) if tok.eos_ids else None
        return {
            "tokenizer_class": type(tok).__name__,
            "name": tok.name,
            "eos_token": eos,
            "bos_token": None,
            "pad_token": None,
            "chat_template": tok.chat_template,
            "model_max_length": state.context,
        }

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(raw: Request):
        req = protocol.parse(protocol.TokenizeRequest, await body_of(raw))
        check_model(req.model)
        if req.messages is not None:
            ids = render_chat(state.tokenizer, _messages(req.messages))
        else:
            ids = _text_ids(state.tokenizer, req.prompt or "", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.context}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(raw: Request):
        req = protocol.parse(protocol.DetokenizeRequest, await body_of(raw))
        check_model(req.model)
        if state.tokenizer is None:
            raise ApiError(400, "tokens: this model has no text tokenizer", param="tokens")
        _check_ids(req.tokens, state.vocab, "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(raw: Request):
        req = protocol.parse(protocol.CompletionRequest, await body_of(raw))
        check_model(req.model)
        if req.best_of not in (None, req.n):
            raise ApiError(400, "best_of: only best_of == n is served (no reranking)", param="best_of")
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        prompts = []
        for p in req.prompts():
            ids = _text_ids(state.tokenizer, p, "prompt") if isinstance(p, str) else list(p)
            _check_ids(ids, state.vocab, "prompt")
            prompts.append((ids, p if isinstance(p, str) else None))
        k = req.logprobs
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens=0: generate at least one token (0 only with echo, to score the prompt)")
        specs = _specs(state, req, [ids for ids, _ in prompts], k, req.echo and k is not None, "prompt")
        gen = Generation(state, specs)
        shape = _CompletionShape(state, req, prompts, gen_id=f"cmpl-{uuid.uuid4().hex}")
        return await _respond(raw, gen, shape, req)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(raw: Request):
        req = protocol.parse(protocol.ChatRequest, await body_of(raw))
        check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        if req.max_tokens == 0:
            raise ApiError(400, "max_tokens=0: generate at least one token", param="max_tokens")
        ids = render_chat(state.tokenizer, _messages(req.messages))
        _check_ids(ids, state.vocab, "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        specs = _specs(state, req, [ids], k, False, "messages")
        gen = Generation(state, specs)
        shape = _ChatShape(state, req, [(ids, None)], gen_id=f"chatcmpl-{uuid.uuid4().hex}")
        return await _respond(raw, gen, shape, req)

    return app


def _messages(messages: list[protocol.Message]) -> list[dict]:
    """The conversation as chat templates take it: {"role", "content": text} (text parts joined)."""
    return [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]


def _text_ids(tokenizer, text: str, field: str) -> list[int]:
    if tokenizer is None:
        raise ApiError(
            400,
            f"{field}: this model has no text tokenizer: send the prompt as a list of token ids",
            param=field,
        )
    return tokenizer.encode(text)


def _check_ids(ids: list, vocab: int, field: str) -> None:
    if not ids:
        raise ApiError(400, f"{field}: the prompt is empty: give at least one token of context", param=field)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"{field}: token ids must lie in [0, {vocab}); got {bad[:5]}", param=field)


def _seed(base: int | None, i: int) -> int:
    """Choice i's seed: the request's seed + i (wrapped into int32), or a fresh one."""
    if base is None:
        return secrets.randbits(31)
    return (base + i - protocol.INT32_MIN) % 2**32 + protocol.INT32_MIN


def _specs(state: ServerState, req, prompts: list[list[int]], logprobs: int | None, prompt_logprobs: bool, field: str):
    """(choice index, SeqSpec) for every prompt x n choice, checked against the context (`field`:
    where the prompt came from); fork_of: a prompt's first choice's prefill serves its other choices."""
    if len(prompts) * req.n > protocol.MAX_CHOICES:
        raise ApiError(
            400,
            f"n: {len(prompts)} prompts x n={req.n} choices; a request takes at most {protocol.MAX_CHOICES}",
            param="n",
        )
    if req.logit_bias:
        _check_ids([token for token, _ in req.biases()], state.vocab, "logit_bias")
    stop = req.stops()
    if stop and state.tokenizer is None:
        raise ApiError(400, "stop: stop strings need a text tokenizer; this model has none", param="stop")
    eos = tuple(state.tokenizer.eos_ids) if state.tokenizer is not None else ()
    ctx = state.context
    out = []
    for p, ids in enumerate(prompts):
        room = ctx - len(ids)
        if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
            want = req.max_tokens if req.max_tokens is not None else 1
            raise ApiError(
                400,
                f"{field}: {len(ids)} prompt tokens and max_tokens={want} need {len(ids) + want} tokens of KV "
                f"cache, more than the pool holds for one sequence: this model's context is {ctx} tokens "
                f"(max_tokens <= {max(room, 0)} for this prompt)",
                param="max_tokens" if room >= 1 else field,
            )
        new = room if req.max_tokens is None else max(req.max_tokens, 1)
        first = None
        for j in range(req.n):
            sampling = Sampling(
                temperature=req.temperature,
                top_k=max(req.top_k, 0),
                top_p=req.top_p,
                seed=_seed(req.seed, j),
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                min_p=req.min_p,
                logit_bias=req.biases(),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                stop_ids=eos,
            )
            try:
                sampling.check()
            except ValueError as e:
                raise ApiError(400, str(e)) from None
            rid = f"{uuid.uuid4().hex}-{p}-{j}"
            out.append((p * req.n + j, SeqSpec(rid, ids, new, sampling, sink=_no_sink, stop=stop, fork_of=first)))
            first = first or rid
    return out


def _no_sink(pieces) -> None:
    pass


async def _respond(raw, gen: Generation, shape, req):
    await gen.start()
    if req.stream:
        # watch from now on: a client gone before the stream's first chunk is aborted too
        watcher = asyncio.ensure_future(_disconnected(raw))

        def gone(task: asyncio.Future) -> None:
            if not task.cancelled():
                gen.disconnected()

        watcher.add_done_callback(gone)

        async def sse():
            try:
                for chunk in shape.stream_start():
                    yield _event(chunk)
                async for index, pieces in gen.events():
                    for chunk in shape.stream_pieces(index, pieces):
                        yield _event(chunk)
                if gen.gone:  # the client went away (its requests were aborted)
                    return
                for chunk in shape.stream_end():
                    yield _event(chunk)
                yield "data: [DONE]\n\n"
            finally:
                watcher.cancel()
                gen.close()

        return StreamingResponse(sse(), headers={"content-type": "text/event-stream", "cache-control": "no-cache"})

    async def collect():
        try:
            async for index, pieces in gen.events():
                shape.add(index, pieces)
        finally:
            gen.close()
        return shape.whole()

    body = await _unless_disconnected(raw, collect())
    if body is None:  # the client went away: its requests were aborted
        return Response(status_code=499)
    if shape.error is not None:
        return JSONResponse(ApiError(500, shape.error).body(), status_code=500)
    return JSONResponse(body)


def _event(chunk: dict) -> str:
    import json

    return f"data: {json.dumps(chunk, ensure_ascii=False, allow_nan=False)}\n\n"


# ----------------------------------------------------------------------------- response shapes


class _Shape:
    """What a generation answers, in one endpoint's shape: `add` pieces then `whole()`, or the
    `stream_*` chunks. Choice i of prompt p is index p * n + i."""

    object = ""
    chunk_object = ""

    def __init__(self, state: ServerState, req, prompts: list[tuple[list[int], str | None]], gen_id: str):
        self.state, self.req, self.prompts, self.id = state, req, prompts, gen_id
        self.created = int(time.time())
        count = len(prompts) * req.n
        self.text = [""] * count
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.lps: list[list] = [[] for _ in range(count)]
        self.tops: list[list] = [[] for _ in range(count)]
        self.prompt_lps: list = [None] * count
        self.prompt_tops: list = [None] * count
        self.finish: list = [None] * count
        self.error: str | None = None
        self.scoring = getattr(req, "max_tokens", None) == 0  # echo with max_tokens 0: the prompt only
        self.echoed: set = set()

    def tname(self, token: int) -> str:
        return token_text(self.state.tokenizer, token)

    def add(self, index: int, pieces: list[Piece]) -> None:
        for p in pieces:
            if p.prompt_logprobs is not None:
                self.prompt_lps[index] = p.prompt_logprobs
                self.prompt_tops[index] = p.prompt_top
            if p.token is not None and not self.scoring:
                self.tokens[index].append(p.token)
                self.lps[index].append(_finite(p.logprob))
                self.tops[index].append([(t, _finite(lp)) for t, lp in (p.top or [])])
            if not self.scoring:
                self.text[index] += p.text
            if p.done:
                self.finish[index] = "length" if self.scoring else p.finish_reason
                if p.error is not None:
                    self.error = f"the engine failed on this request: {p.error}"

    def usage(self) -> dict:
        return protocol.usage(sum(len(ids) for ids, _ in self.prompts), sum(len(t) for t in self.tokens))

    def base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.model_name}

    def stream_start(self) -> list[dict]:
        return []

    def stream_end(self) -> list[dict]:
        opts = self.req.stream_options
        return (
            [{**self.base(self.chunk_object), "choices": [], "usage": self.usage()}]
            if opts and opts.include_usage
            else []
        )

    def stream_pieces(self, index: int, pieces: list[Piece]) -> list[dict]:
        raise NotImplementedError

    def whole(self) -> dict:
        raise NotImplementedError


class _CompletionShape(_Shape):
    object = chunk_object = "text_completion"

    def prompt_text(self, p: int) -> str:
        ids, text = self.prompts[p]
        if text is not None:
            return text
        return self.state.tokenizer.decode(ids) if self.state.tokenizer is not None else ""

    def echo_logprobs(self, index: int) -> tuple[list, list, list]:
        ids = self.prompts[index // self.req.n][0]
        lps = self.prompt_lps[index] or [None] * len(ids)
        alts = self.prompt_tops[index] or [None] * len(ids)
        names = [self.tname(t) for t in ids]
        # as for a generated token: the top alternatives, and the token itself
        tops = [None] + [
            {**{self.tname(t): _finite(a) for t, a in (alt or [])}, n: _finite(lp)}
            for n, lp, alt in zip(names[1:], lps[1:], alts[1:])
        ]
        return names, [None] + [_finite(lp) for lp in lps[1:]], tops

    def logprobs(self, index: int, tokens: list[int], lps: list, tops: list, echo: bool, offset: int = 0):
        if self.req.logprobs is None:
            return None
        names = [self.tname(t) for t in tokens]
        top = [{**{self.tname(t): lp for t, lp in alts}, n: lp} for n, lp, alts in zip(names, lps, tops)]
        if echo:
            pnames, plps, ptops = self.echo_logprobs(index)
            names, lps, top = pnames + names, plps + list(lps), ptops + top
        return protocol.completion_logprobs(names, list(lps), top, offset)

    def whole(self) -> dict:
        choices = []
        for i in range(len(self.text)):
            echo = self.prompt_text(i // self.req.n) if self.req.echo else ""
            choices.append(
                {
                    "index": i,
                    "text": echo + self.text[i],
                    "token_ids": self.tokens[i],
                    "logprobs": self.logprobs(i, self.tokens[i], self.lps[i], self.tops[i], self.req.echo),
                    "finish_reason": self.finish[i],
                }
            )
        return {**self.base(self.object), "choices": choices, "usage": self.usage()}

    def stream_pieces(self, index: int, pieces: list[Piece]) -> list[dict]:
        out = []
        for p in pieces:
            self.add(index, [p])
            tokens = [p.token] if p.token is not None and not self.scoring else []
            n = len(tokens)
            text = "" if self.scoring else p.text
            echo = self.req.echo and index not in self.echoed
            if echo:
                self.echoed.add(index)
                text = self.prompt_text(index // self.req.n) + text
            lp = self.logprobs(
                index, tokens, self.lps[index][-n:] if n else [], self.tops[index][-n:] if n else [], echo
            )
            if p.error is not None:
                out.append({"error": ApiError(500, f"the engine failed on this request: {p.error}").body()["error"]})
            choice = {
                "index": index,
                "text": text,
                "token_ids": tokens,
                "logprobs": lp,
                "finish_reason": self.finish[index] if p.done else None,
            }
            out.append({**self.base(self.chunk_object), "choices": [choice]})
        return out


class _ChatShape(_Shape):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def content_logprobs(self, lps: list, tokens: list[int], tops: list) -> dict | None:
        if not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0
        entries = [
            protocol.chat_logprob(self.tname(t), lp, [(self.tname(a), alp) for a, alp in alts[:k]])
            for t, lp, alts in zip(tokens, lps, tops)
        ]
        return {"content": entries}

    def whole(self) -> dict:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": self.text[i]},
                "logprobs": self.content_logprobs(self.lps[i], self.tokens[i], self.tops[i]),
                "finish_reason": self.finish[i],
            }
            for i in range(len(self.text))
        ]
        return {**self.base(self.object), "choices": choices, "usage": self.usage()}

    def stream_start(self) -> list[dict]:
        return [
            {
                **self.base(self.chunk_object),
                "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ],
            }
            for i in range(len(self.text))
        ]

    def stream_pieces(self, index: int, pieces: list[Piece]) -> list[dict]:
        out = []
        for p in pieces:
            self.add(index, [p])
            tokens = [p.token] if p.token is not None else []
            n = len(tokens)
            lp = self.content_logprobs(self.lps[index][-n:] if n else [], tokens, self.tops[index][-n:] if n else [])
            delta = {"content": p.text} if p.text or tokens else {}
            if p.error is not None:
                out.append({"error": ApiError(500, f"the engine failed on this request: {p.error}").body()["error"]})
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": p.finish_reason}
            out.append({**self.base(self.chunk_object), "choices": [choice]})
        return out


# ----------------------------------------------------------------------------- running it


class HTTPServer:
    """uvicorn serving an app on a socket bound now (port 0: any free port; `server_address` is
    known at once). `serve_forever()` blocks (in the main thread: Ctrl-C and SIGTERM stop it
    gracefully); `shutdown()` from another thread stops it."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"):
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(2048)  # connections queue from now on, before uvicorn's loop accepts them
        self.server_address = self.sock.getsockname()[:2]
        self.app = app  # app.state.server: the ServerState (its limits can be changed while serving)
        config = uvicorn.Config(
            app, log_config=None, log_level=log_level, access_log=False, lifespan="off", timeout_graceful_shutdown=5
        )
        self.uvicorn = uvicorn.Server(config)
        self.started = threading.Event()
        self.stopped = threading.Event()

    def serve_forever(self) -> None:
        self.started.set()
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self.stopped.set()

    def shutdown(self) -> None:
        self.uvicorn.should_exit = True
        if self.started.is_set():
            self.stopped.wait(15)
        self.sock.close()


def serve(
    engine: EngineAPI,
    tokenizer,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue: int = MAX_QUEUE,
    max_body: int = MAX_BODY,
    log_level: str = "warning",
) -> tuple[HTTPServer, EngineLoop]:
    """The server over `engine` (`tokenizer`: jaxsys.tokenizer's interface, or None for a model
    that takes token ids only). Returns (server, loop): `server.serve_forever()` blocks (or run it
    in a thread); `shutdown(server, loop)` stops both."""
    loop = EngineLoop(engine, tokenizer)
    state = ServerState(
        loop,
        tokenizer,
        model_name,
        context_length(engine),
        engine.program.config.model.vocab_size,
        api_key=api_key,
        max_queue=max_queue,
        max_body=max_body,
    )
    return HTTPServer(build_app(state), host, port, log_level), loop


def shutdown(server: HTTPServer, loop: EngineLoop) -> None:
    server.shutdown()
    loop.stop()
