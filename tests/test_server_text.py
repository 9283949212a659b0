"""The HTTP server's text handling over a scripted engine (fast, no model): incremental
detokenization that never splits a UTF-8 character, stop strings matched across token boundaries
(and the engine told to finish at once), EOS ids, several tokens per step, chat templates, models
without a tokenizer, a full queue, a failing step, and clients that go away."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from jaxsys.serve import server
from jaxsys.serve.engine import EngineAPI
from jaxsys.serve.scheduler import PagePool, Request
from jaxsys.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()
TEXT = "héllo wörld €😀 ok"
SCRIPT = list(TEXT.encode())


class ScriptedEngine(EngineAPI):
    """Every request generates SCRIPT (cycled), `per_step` tokens a step, under the engine
    contract: Request.finish_reason / logprobs / top_logprobs, Sampling.stop_ids, finish(), abort()
    and a failed step's requests finished with finish_reason "error"."""

    def __init__(self, script=SCRIPT, per_step: int = 1, delay: float = 0.0):
        self.program = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(vocab_size=256)))
        self.pools, self.max_len = [PagePool(16, 16)], 256
        self.script, self.per_step, self.delay = script, per_step, delay
        self.live: dict = {}
        self.done: list = []
        self.calls: list = []  # ("finish" | "abort", id)
        self.prompts: dict = {}
        self.fail_next = False
        self.gate = threading.Event()
        self.gate.set()

    def submit(self, request_id, prompt, max_new_tokens, sampling=None, k=None, fork_of=None):
        sampling.check()
        r = Request(request_id, list(prompt), max_new_tokens)
        self.live[request_id] = (r, sampling)
        self.prompts[request_id] = list(prompt)
        return r

    def step(self):
        self.gate.wait()
        time.sleep(self.delay)
        if self.fail_next:
            self.fail_next = False
            for rid, (r, _) in list(self.live.items()):
                r.finish_reason, r.error = "error", "RuntimeError: injected"
                self._end(rid)
            return [], {}
        for rid, (r, s) in list(self.live.items()):
            for _ in range(self.per_step):
                token = self.script[len(r.generated) % len(self.script)]
                r.generated.append(token)
                r.logprobs.append(-0.5)
                r.top_logprobs.append([(token, -0.5)])
                if token in s.stop_ids:
                    r.finish_reason = "stop"
                elif r.done:
                    r.finish_reason = "length"
                if r.finish_reason:
                    self._end(rid)
                    break
        return [], {}

    def _end(self, rid):
        self.done.append(self.live.pop(rid)[0])

    def finish(self, request_id, reason):
        self.calls.append(("finish", request_id))
        if request_id not in self.live:
            return False
        self.live[request_id][0].finish_reason = reason
        self._end(request_id)
        return True

    def abort(self, request_id):
        self.calls.append(("abort", request_id))
        if request_id not in self.live:
            return False
        self.live[request_id][0].finish_reason = "abort"
        self._end(request_id)
        return True

    def warmup(self):
        pass

    @property
    def idle(self):
        return not self.live

    @property
    def finished(self):
        return self.done

    def forget_finished(self):
        pass  # the tests read what finished (`done`) after the server is through with it


class EosBytes(ByteTokenizer):
    eos_ids = (ord("!"),)


class ChatBytes(ByteTokenizer):
    chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )


@pytest.fixture
def scripted():
    """make(script, per_step, delay, tokenizer=...) -> (url, engine, the server's state)."""
    running = []

    def make(*args, tokenizer=BYTES, **kw):
        eng = ScriptedEngine(*args, **kw)
        httpd, loop = server.serve(eng, tokenizer, "scripted", port=0)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        running.append((httpd, loop))
        return f"http://127.0.0.1:{httpd.server_address[1]}", eng, httpd.app.state.server

    yield make
    for httpd, loop in running:
        server.shutdown(httpd, loop)


def post(url, payload, path="/v1/completions", raw=None):
    data = raw if raw is not None else json.dumps(payload).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def whole(url, payload, path="/v1/completions"):
    status, body = post(url, payload, path)
    assert status == 200, body
    return json.loads(body)


def chunks(url, payload, path="/v1/completions"):
    status, body = post(url, {**payload, "stream": True}, path)
    assert status == 200, body
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_streaming_never_splits_a_character_and_equals_the_whole_answer(scripted):
    url, _, _ = scripted()
    n = len(SCRIPT)
    got = chunks(url, {"prompt": "x", "max_tokens": n})
    texts = [c["choices"][0]["text"] for c in got]
    assert len(got) == n  # one chunk per token; a token inside a character releases ""
    assert "".join(texts) == TEXT and all("\ufffd" not in t for t in texts)
    assert texts[1] == "" and texts[2] == "é"  # é is two bytes: the first releases nothing
    assert [c["choices"][0]["finish_reason"] for c in got] == [None] * (n - 1) + ["length"]
    assert whole(url, {"prompt": "x", "max_tokens": n})["choices"][0]["text"] == TEXT


@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize(
    "stop,text,matched",
    [
        ("wö", "héllo ", "wö"),  # 1 + 2 bytes: the match ends inside the bytes of a character
        (["zz", "ld €"], "héllo wör", "ld €"),
        ("😀", "héllo wörld €", "😀"),  # four bytes, one character
        (["o w", "llo"], "hé", "llo"),  # the earliest match wins
    ],
)
def test_stop_strings_across_token_boundaries(scripted, stop, text, matched, per_step):
    url, eng, _ = scripted(per_step=per_step)
    choice = whole(url, {"prompt": "x", "max_tokens": 40, "stop": stop})["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "stop"
    # tokens up to the one that completes the stop string (several a step: the rest are dropped)
    assert choice["token_ids"] == list((text + matched).encode())
    rid = next(rid for kind, rid in eng.calls if kind == "finish")  # the engine was told at once
    assert not eng.live and eng.done[-1].id == rid
    streamed = chunks(url, {"prompt": "x", "max_tokens": 40, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in streamed) == text
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"


def test_held_back_text_is_released_when_no_stop_string_follows(scripted):
    url, _, _ = scripted()
    got = chunks(url, {"prompt": "x", "max_tokens": 8, "stop": ["lo!", "wx"]})
    # "l", then "lo" could begin "lo!" and "w" could begin "wx": held until ruled out or the end
    assert [c["choices"][0]["text"] for c in got] == ["h", "", "é", "", "l", "", "lo ", "w"]
    assert got[-1]["choices"][0]["finish_reason"] == "length"


def test_eos_ids_end_a_request_with_finish_reason_stop(scripted):
    url, _, _ = scripted(list(b"abc!def"), tokenizer=EosBytes())
    choice = whole(url, {"prompt": "x", "max_tokens": 20})["choices"][0]
    assert choice == {**choice, "text": "abc", "finish_reason": "stop", "token_ids": list(b"abc!")}


def test_max_tokens_defaults_to_what_the_context_allows(scripted):
    url, _, _ = scripted(list(b"abc"))
    choice = whole(url, {"prompt": "xyz"})["choices"][0]  # the scripted engine's context: 256 tokens
    assert len(choice["token_ids"]) == 256 - 3 and choice["finish_reason"] == "length"
    status, body = post(url, {"prompt": "x" * 256})
    assert status == 400 and "context is 256 tokens" in json.loads(body)["error"]["message"]
    status, body = post(url, {"prompt": ["a"] * 3, "n": 100})
    assert status == 400 and json.loads(body)["error"]["param"] == "n"


def test_chat_needs_a_template_and_renders_one(scripted):
    url, _, _ = scripted()
    status, body = post(url, {"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")
    assert status == 400 and "no chat template" in json.loads(body)["error"]["message"]
    url, eng, _ = scripted(tokenizer=ChatBytes())
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    body = whole(url, {"messages": messages, "max_tokens": 5}, "/v1/chat/completions")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "héll"}
    assert list(eng.prompts.values())[-1] == list(b"<system>be brief\n<user>hi\n<assistant>")
    streamed = chunks(url, {"messages": messages, "max_tokens": 5}, "/v1/chat/completions")
    assert streamed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed) == "héll"
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"


def test_a_model_without_tokenizer_takes_token_ids_only(scripted):
    url, _, _ = scripted(tokenizer=None)
    status, body = post(url, {"prompt": "text", "max_tokens": 2})
    assert status == 400 and "no text tokenizer" in json.loads(body)["error"]["message"]
    status, body = post(url, {"prompt": [1, 2], "max_tokens": 2, "stop": "x"})
    assert status == 400 and json.loads(body)["error"]["param"] == "stop"
    choice = whole(url, {"prompt": [1, 2], "max_tokens": 2, "logprobs": 1})["choices"][0]
    assert choice["text"] == "" and choice["token_ids"] == SCRIPT[:2]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in SCRIPT[:2]]


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(scripted):
    url, eng, _ = scripted()
    eng.fail_next = True
    status, body = post(url, {"prompt": "x", "max_tokens": 3})
    assert status == 500 and "injected" in json.loads(body)["error"]["message"]
    eng.fail_next = True
    status, body = post(url, {"prompt": "x", "max_tokens": 3, "stream": True})
    events = [e for e in body.split("\n\n") if e]
    assert status == 200 and "injected" in json.loads(events[0].removeprefix("data: "))["error"]["message"]
    assert events[-1] == "data: [DONE]"
    assert whole(url, {"prompt": "x", "max_tokens": 3})["choices"][0]["text"] == "hé"


def test_an_engine_that_raises_fails_what_is_in_flight_and_the_server_goes_on(scripted):
    url, eng, _ = scripted()
    step = eng.step
    eng.step = lambda: (setattr(eng, "step", step), 1 / 0)  # raises once, outside the contract
    status, body = post(url, {"prompt": "x", "max_tokens": 3})
    assert status == 500 and "ZeroDivisionError" in json.loads(body)["error"]["message"]
    assert ("abort", next(iter(eng.prompts))) in eng.calls
    assert whole(url, {"prompt": "x", "max_tokens": 3})["choices"][0]["text"] == "hé"


def test_a_full_queue_answers_429(scripted):
    url, eng, state = scripted()
    state.max_queue = 1
    eng.gate.clear()  # the engine's thread blocks in its next step: the request waits for a token
    first: list = []
    waiting = threading.Thread(target=lambda: first.append(post(url, {"prompt": "x", "max_tokens": 2})))
    waiting.start()
    deadline = time.time() + 10
    while state.waiting < 1 and time.time() < deadline:
        time.sleep(0.02)
    status, body = post(url, {"prompt": "x", "max_tokens": 2})
    assert status == 429 and "--max-queue 1" in json.loads(body)["error"]["message"]
    eng.gate.set()
    waiting.join(30)
    assert first[0][0] == 200 and state.waiting == 0
    assert whole(url, {"prompt": "x", "max_tokens": 3})["choices"][0]["text"] == "hé"


def _stream_then_close(url, payload, after: int):
    """Open a streamed completion, read `after` events, and close the connection."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({**payload, "stream": True}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    seen = b""
    while seen.count(b"data: ") < after:
        seen += s.recv(65536)
    s.close()


def test_a_client_that_goes_away_has_its_request_aborted(scripted, caplog):
    url, eng, _ = scripted(delay=0.02)
    _stream_then_close(url, {"prompt": "x", "max_tokens": 200}, after=2)
    deadline = time.time() + 10
    while eng.live and time.time() < deadline:
        time.sleep(0.05)
    assert not eng.live and eng.calls and eng.calls[-1][0] == "abort"
    # not streamed: the client gives up waiting
    with pytest.raises(OSError):
        urllib.request.urlopen(
            urllib.request.Request(
                url + "/v1/completions", data=json.dumps({"prompt": "x", "max_tokens": 200}).encode()
            ),
            timeout=0.3,
        )
    deadline = time.time() + 10
    while (eng.live or eng.calls[-1][0] != "abort") and time.time() < deadline:
        time.sleep(0.05)
    assert not eng.live and len([c for c in eng.calls if c[0] == "abort"]) == 2
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert whole(url, {"prompt": "x", "max_tokens": 3})["choices"][0]["text"] == "hé"
