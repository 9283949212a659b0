"""The HTTP server (jaxsys/serve/server.py) as its users meet it: the official `openai` client and
raw HTTP on localhost against a tiny model, whole and streamed completions and chat, stop strings,
n, logprobs, echo scored against the training forward (as lm-evaluation-harness scores a
multiple-choice question), every kind of bad request answered 4xx with a message and no page
leaked, a full queue, a failing step, clients that go away, and the server still serving
afterwards. One server per module (an API key, as deployed); tests/test_server_text.py covers the
text handling over a scripted engine."""

import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from jaxsys.serve import engine, server
from jaxsys.tokenizer import ByteTokenizer
from tests.helpers import generate_contiguous, program_for, reference_logprob_rows, small_config

KEY = "test-key"
MODEL = "tiny-test"


class ChatBytes(ByteTokenizer):
    """The byte tokenizer with a chat template (the HF tokenizers carry theirs)."""

    chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )


@pytest.fixture(scope="module")
def served():
    program = program_for(small_config(n_kv_heads=4))
    params = program.init(3).params
    eng = engine.Engine(program, params, num_pages=32, page_size=8, token_budget=32, chunk_size=8, max_seqs=4)
    httpd, loop = server.serve(eng, ChatBytes(), MODEL, port=0, api_key=KEY, max_body=64 << 10)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", program, params, eng, httpd.app.state.server
    server.shutdown(httpd, loop)


@pytest.fixture(scope="module")
def running(served):
    """(url, program, params)."""
    return served[:3]


@pytest.fixture(scope="module")
def parts(served):
    """(url, the engine, the server's state)."""
    return served[0], served[3], served[4]


@pytest.fixture(scope="module")
def client(running):
    return openai.OpenAI(base_url=running[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(url, payload, raw=None, path="/v1/completions", key=KEY):
    data = raw if raw is not None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url + path, data=data, headers=headers)
    return urllib.request.urlopen(request, timeout=120)


def _all_pages_free(eng, wait: float = 10.0) -> bool:
    deadline = time.time() + wait
    while time.time() < deadline:
        if eng.idle and all(p.free_pages == p.num_pages for p in eng.pools):
            return True
        time.sleep(0.05)
    return False


def _reference_logprobs(program, params, ids):
    """log p(ids[i] | ids[:i]) for i >= 1 from the training forward on one device."""
    return reference_logprob_rows(program, params, ids)[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def test_completion_equals_generating_alone(running):
    url, program, params = running
    with _post(url, {"prompt": "def f(", "max_tokens": 6}) as r:
        body = json.loads(r.read())
    ids = list(b"def f(")
    want = generate_contiguous(program, params, [ids], 6, max_len=32)[0]
    choice = body["choices"][0]
    assert choice["token_ids"] == want and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}


def test_streamed_completion_and_concurrent_requests(running):
    url, _, _ = running
    results = {}

    def stream(name, prompt):
        with _post(url, {"prompt": prompt, "max_tokens": 5, "stream": True}) as r:
            assert r.headers["Content-Type"] == "text/event-stream"
            events = [line for line in r.read().decode().split("\n\n") if line]
        results[name] = events

    threads = [threading.Thread(target=stream, args=(i, [1 + i, 2, 3])) for i in range(3)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    for events in results.values():
        assert events[-1] == "data: [DONE]" and len(events) == 6
        chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]


def test_openai_client_completions(client, running):
    url, program, params = running
    ask = dict(model=MODEL, prompt="def main(", max_tokens=8, temperature=0)
    first, again = client.completions.create(**ask), client.completions.create(**ask)
    assert first.choices[0].text == again.choices[0].text and first.choices[0].finish_reason == "length"
    assert first.choices[0].token_ids == generate_contiguous(program, params, [list(b"def main(")], 8, max_len=32)[0]
    assert first.usage.completion_tokens == 8 and first.usage.prompt_tokens == 9
    streamed = list(client.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == first.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    # n choices, each with its own seed: reproducible, and not all the same
    sampled = dict(model=MODEL, prompt="import ", max_tokens=6, temperature=1.0, n=3, seed=7)
    a, b = client.completions.create(**sampled), client.completions.create(**sampled)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({tuple(c.token_ids) for c in a.choices}) > 1 and a.usage.completion_tokens == 18
    # stop: a string the greedy continuation contains (its characters are tokens: it straddles them)
    text = first.choices[0].text
    stop = text[2:4]
    cut = client.completions.create(**ask, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    cut_streamed = list(client.completions.create(**ask, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in cut_streamed) == cut.choices[0].text


def test_openai_client_logprobs(client, running):
    _, program, params = running
    r = client.completions.create(model=MODEL, prompt="for i in", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    ids = list(b"for i in") + r.choices[0].token_ids
    want = _reference_logprobs(program, params, ids)[-4:]
    np.testing.assert_allclose(lp.token_logprobs, want, rtol=1e-5, atol=1e-5)
    for token, top, logprob in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
        assert len(top) >= 3 and top[token] == logprob == max(top.values())  # greedy: the top token
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == c.logprob for c in content)


def test_openai_client_chat(client, running):
    _, program, params = running
    messages = [{"role": "system", "content": "terse"}, {"role": "user", "content": "def f"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    prompt = list(b"<system>terse\n<user>def f\n<assistant>")
    want = generate_contiguous(program, params, [prompt], 6, max_len=64)[0]
    assert whole.choices[0].message.content == ByteTokenizer().decode(want)
    assert whole.usage.prompt_tokens == len(prompt) and whole.choices[0].finish_reason == "length"
    streamed = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True)
    )
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == "length"


def test_echo_logprobs_equal_the_training_forward(client, running):
    _, program, params = running
    prompt = list(b"def add(a, b):\n    return")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("def add(a, b):\n    return")
    assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = _reference_logprobs(program, params, prompt + r.choices[0].token_ids)
    np.testing.assert_allclose(lp.token_logprobs[1:], want, rtol=1e-5, atol=1e-5)
    # each prompt position's top_logprobs: its most likely token and the token itself
    rows = reference_logprob_rows(program, params, prompt + r.choices[0].token_ids)
    for p in range(1, len(prompt)):
        best = int(np.argmax(rows[p - 1]))
        top = lp.top_logprobs[p]
        name = lambda t: server.token_text(ByteTokenizer(), t)
        assert set(top) == {name(best), name(prompt[p])}
        np.testing.assert_allclose(top[name(best)], rows[p - 1, best], rtol=1e-5, atol=1e-5)


def test_a_multiple_choice_question_scored_as_lm_evaluation_harness_does(running):
    """local-completions' loglikelihood: one request with the prompts as lists of token ids,
    max_tokens 1, echo, logprobs 1, temperature 0; each choice's score is the sum of
    token_logprobs[ctxlen:-1], and is_greedy compares each token with max(top_logprobs): both
    against the training forward (is_greedy: every continuation token is the argmax there)."""
    url, program, params = running
    context = list(b"Question: 2 + 2 =\nAnswer:")
    choices = [list(b" 4"), list(b" five"), list(b" 22")]
    greedy_choice = []  # the model's own two greedy tokens: is_greedy must read True for it
    for _ in range(2):
        greedy_choice.append(int(np.argmax(reference_logprob_rows(program, params, context + greedy_choice + [0])[-1])))
    choices.append(greedy_choice)
    payload = {
        "model": MODEL,
        "prompt": [context + c for c in choices],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    with _post(url, payload) as r:
        out = json.loads(r.read())
    scores, greedy = [], []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), [len(context)] * len(choices)):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy.append(all(tok == max(top.values()) for tok, top in zip(token_logprobs, tops)))
        scores.append(sum(token_logprobs))
    want = [float(_reference_logprobs(program, params, context + c)[len(context) - 1 :].sum()) for c in choices]
    np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-4)
    assert int(np.argmax(scores)) == int(np.argmax(want)) and len(greedy) == len(choices)
    want_greedy = []
    for c in choices:
        rows = reference_logprob_rows(program, params, context + c)[len(context) - 1 :]
        want_greedy.append(bool(np.all(np.argmax(rows, axis=-1) == np.asarray(c))))
    assert greedy == want_greedy and want_greedy[-1]


def test_logit_bias_and_min_p(running, client):
    """OpenAI's logit_bias over HTTP: +100 on a token makes greedy decoding emit it every time, -100
    on the unbiased greedy token bans it; vLLM's min_p: at 1 only the most likely token survives, so
    sampling at temperature 1 gives the greedy tokens, while at 0 the same seed draws others."""
    url, program, params = running
    ids = list(b"def f(")
    greedy = generate_contiguous(program, params, [ids], 6, max_len=32)[0]
    forced = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, logit_bias={"7": 100})
    assert forced.choices[0].model_extra["token_ids"] == [7] * 6
    with _post(url, {"prompt": ids, "max_tokens": 1, "logit_bias": {str(greedy[0]): -100}}) as r:
        assert json.loads(r.read())["choices"][0]["token_ids"][0] != greedy[0]
    sampled = {}
    for min_p in (1.0, 0.0):
        body = {"prompt": ids, "max_tokens": 6, "temperature": 1.0, "seed": 5, "min_p": min_p}
        with _post(url, body) as r:
            sampled[min_p] = json.loads(r.read())["choices"][0]["token_ids"]
    assert sampled[1.0] == greedy and sampled[0.0] != greedy


BIG = 2**31
BAD = [
    ({"prompt": "", "max_tokens": 4}, None, 400, "prompt is empty"),
    ({"prompt": [], "max_tokens": 4}, None, 400, "prompt is empty"),
    ({"prompt": "x" * 300, "max_tokens": 4}, None, 400, "more than the pool"),
    ({"prompt": "x", "max_tokens": 10**6}, None, 400, "more than the pool"),
    ({"prompt": "x", "max_tokens": 0}, None, 400, "max_tokens=0"),
    ({"prompt": "x", "max_tokens": -1}, None, 400, "max_tokens=-1 is out of range"),
    ({"prompt": "x", "max_tokens": BIG}, None, 400, "max_tokens=2147483648 is out of range"),
    ({"prompt": "x", "seed": BIG}, None, 400, "seed=2147483648 is out of range"),
    ({"prompt": "x", "seed": -BIG - 1}, None, 400, "seed=-2147483649 is out of range"),
    ({"prompt": "x", "top_k": BIG}, None, 400, "top_k=2147483648 is out of range"),
    ({"prompt": "x", "n": BIG}, None, 400, "n=2147483648 is out of range"),
    ({"prompt": "x", "logprobs": 21}, None, 400, "logprobs=21 is out of range"),
    ({"prompt": [1, BIG]}, None, 400, "token ids must lie in [0, 256)"),
    ({"prompt": "x", "temperature": -1}, None, 400, "temperature >= 0"),
    ({"prompt": "x", "top_p": 2}, None, 400, "0 < top_p <= 1"),
    ({"prompt": "x", "presence_penalty": 3}, None, 400, "-2 <= presence_penalty <= 2"),
    ({"prompt": "x", "repetition_penalty": 0}, None, 400, "0 < repetition_penalty"),
    ({"prompt": "x", "min_p": 2}, None, 400, "0 <= min_p <= 1"),
    ({"prompt": "x", "logit_bias": {"x": 1}}, None, 400, "keys must be token ids"),
    ({"prompt": "x", "logit_bias": {"300": 1}}, None, 400, "logit_bias: token ids must lie in [0, 256)"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, None, 400, "-100 <= bias <= 100"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, None, 400, "at most 300 token ids"),
    ({"prompt": "x", "max_tokens": "many"}, None, 400, "max_tokens must be int"),
    ({"prompt": "x", "n": 1.5}, None, 400, "n must be int"),
    ({"prompt": "x", "stream": "yes"}, None, 400, "stream must be a boolean"),
    ({"prompt": 5}, None, 400, "prompt: must be a string"),
    ({"prompt": "x", "stop": [""]}, None, 400, "non-empty stop strings"),
    ({"prompt": "x", "frobnicate": 1}, None, 400, "frobnicate: unknown field"),
    ({"prompt": "x", "model": "gpt-4"}, None, 404, "The model `gpt-4` does not exist"),
    (None, b"{nope", 400, "not JSON"),
    (None, b"[1, 2]", 400, "must be a JSON object"),
    (None, b'{"prompt": "x", "temperature": NaN}', 400, "temperature must be a finite number"),
    (None, b'{"prompt": "x", "top_p": Infinity}', 400, "top_p must be a finite number"),
    (None, b'{"prompt": "x", "frequency_penalty": -Infinity}', 400, "frequency_penalty must be a finite number"),
    (None, b'{"prompt": "caf\xe9"}', 400, "not UTF-8"),
    (None, b'{"prompt": "' + b"x" * (80 << 10) + b'"}', 413, "at most 65536"),
    ({"messages": []}, "chat", 400, "messages: List should have at least 1 item"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "chat", 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "chat", 400, "needs logprobs"),
    ({"messages": [{"role": "user", "content": "x" * 300}]}, "chat", 400, "more than the pool"),
]


@pytest.mark.parametrize("payload,raw,status,message", BAD, ids=[b[3][:40] for b in BAD])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(running, parts, payload, raw, status, message):
    url, _, _ = running
    _, eng, _ = parts
    path = "/v1/chat/completions" if raw == "chat" else "/v1/completions"
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(url, payload, raw=raw if isinstance(raw, bytes) else None, path=path)
    assert info.value.code == status
    assert message in json.loads(info.value.read())["error"]["message"]
    assert _all_pages_free(eng)
    with _post(url, {"prompt": "ok", "max_tokens": 2}) as r:  # still serving
        assert len(json.loads(r.read())["choices"][0]["token_ids"]) == 2
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"


def test_api_key_models_and_unknown_model(running, client):
    url, _, _ = running
    for key in (None, "wrong"):
        with pytest.raises(urllib.error.HTTPError) as info:
            _post(url, {"prompt": "x", "max_tokens": 1}, key=key)
        assert info.value.code == 401 and "API key" in json.loads(info.value.read())["error"]["message"]
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_a_failed_step_fails_only_its_request(running, parts, monkeypatch):
    url, _, _ = running
    _, eng, _ = parts
    runner = eng.runner

    class FailOnce:
        failed = False

        def __call__(self, *args):
            if not FailOnce.failed:
                FailOnce.failed = True
                raise RuntimeError("injected device failure")
            return runner(*args)

    monkeypatch.setattr(eng, "runner", FailOnce())
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(url, {"prompt": "boom", "max_tokens": 3})
    assert info.value.code == 500 and "injected device failure" in json.loads(info.value.read())["error"]["message"]
    assert _all_pages_free(eng)
    with _post(url, {"prompt": "ok", "max_tokens": 3}) as r:
        assert len(json.loads(r.read())["choices"][0]["token_ids"]) == 3


def test_a_full_queue_answers_429(running, parts, monkeypatch):
    url, _, _ = running
    _, eng, state = parts
    gate = threading.Event()
    step = eng.step
    monkeypatch.setattr(eng, "step", lambda: (gate.wait(30), step())[1])
    monkeypatch.setattr(state, "max_queue", 2)
    done: list = []
    ask = lambda: done.append(json.loads(_post(url, {"prompt": "x", "max_tokens": 2}).read()))
    threads = [threading.Thread(target=ask) for _ in range(2)]
    [t.start() for t in threads]
    deadline = time.time() + 10
    while state.waiting < 2 and time.time() < deadline:
        time.sleep(0.02)
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(url, {"prompt": "x", "max_tokens": 2})
    assert info.value.code == 429 and "--max-queue 2" in json.loads(info.value.read())["error"]["message"]
    gate.set()
    [t.join(60) for t in threads]
    assert [len(d["choices"][0]["token_ids"]) for d in done] == [2, 2]
    assert _all_pages_free(eng) and state.waiting == 0


def test_a_client_that_goes_away_is_aborted_and_its_pages_freed(running, parts, monkeypatch, caplog):
    import socket

    url, _, _ = running
    _, eng, _ = parts
    aborted: list = []
    abort, step = eng.abort, eng.step
    monkeypatch.setattr(eng, "abort", lambda rid: (aborted.append(rid), abort(rid))[1])
    monkeypatch.setattr(eng, "step", lambda: (time.sleep(0.01), step())[1])  # ~100 tokens a second
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "x", "max_tokens": 200, "stream": True}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    seen = b""
    while seen.count(b"data: ") < 3:
        seen += s.recv(65536)
    s.close()  # mid-stream
    assert _all_pages_free(eng) and len(aborted) == 1
    with pytest.raises(OSError):  # not streamed: the client stops waiting
        request = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps({"prompt": "y", "max_tokens": 200}).encode(),
            headers={"Authorization": f"Bearer {KEY}"},
        )
        urllib.request.urlopen(request, timeout=0.3)
    assert _all_pages_free(eng) and len(aborted) == 2
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    with _post(url, {"prompt": "ok", "max_tokens": 2}) as r:
        assert len(json.loads(r.read())["choices"][0]["token_ids"]) == 2


def test_serve_command_starts_and_answers(tmp_path):
    """`python -m jaxsys.serve --workdir W` in its own process, on a free port, as a user runs it."""
    import os
    import re
    import subprocess
    import sys

    from jaxsys import train
    from tests.helpers import ROOT

    c = small_config(dict(data=8))
    c.train.steps, c.train.eval_batches = 2, 1
    c.checkpoint.async_save = False
    train.main(c, str(tmp_path / "run"))
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxsys.serve",
            "--workdir",
            str(tmp_path / "run"),
            "--port",
            "0",
            "--pages",
            "16",
            "--page-size",
            "8",
            "--token-budget",
            "16",
            "--config.mesh.data=1",
            "--served-model-name",
            "tiny",
            "--api-key",
            KEY,
        ],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline, port = time.time() + 120, None
        while port is None and time.time() < deadline:
            line = proc.stderr.readline()
            found = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
            port = found and int(found.group(1))
            assert line or proc.poll() is None, "the server exited"
        with _post(f"http://127.0.0.1:{port}", {"prompt": "import ", "max_tokens": 3, "model": "tiny"}) as r:
            assert len(json.loads(r.read())["choices"][0]["token_ids"]) == 3
    finally:
        proc.terminate()
        proc.wait(30)
    assert "Traceback" not in proc.stderr.read()
