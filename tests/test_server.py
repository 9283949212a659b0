"""The HTTP server (jaxsys/serve/server.py) as its users meet it: a real HTTP client on localhost,
streamed and whole completions, bad requests answered 400 with a message, and the server still
serving afterwards."""

import json
import threading
import urllib.error
import urllib.request

import pytest

from jaxsys.serve import engine, server
from tests.helpers import generate_contiguous, program_for, small_config


@pytest.fixture(scope="module")
def running():
    program = program_for(small_config(n_kv_heads=4))
    params = program.init(3).params
    eng = engine.Engine(program, params, num_pages=32, page_size=8, token_budget=32, chunk_size=8, max_seqs=4)
    httpd, loop = server.serve(eng, byte_level=True, model_name="tiny-test", port=0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", program, params
    server.shutdown(httpd, loop)


def _post(url, payload, raw=None):
    data = raw if raw is not None else json.dumps(payload).encode()
    request = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=120)


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


@pytest.mark.parametrize(
    "payload,message",
    [
        ({"prompt": "", "max_tokens": 4}, "prompt is empty"),
        ({"prompt": "x" * 300, "max_tokens": 4}, "more than the pool"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens=0"),
        ({"prompt": "x", "temperature": -1}, "temperature >= 0"),
        ({"prompt": "x", "top_p": 2}, "0 < top_p <= 1"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens must be int"),
        ({"prompt": "x", "frequency_penalty": 1}, "unknown fields"),
        (None, "not JSON"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(running, payload, message):
    url, _, _ = running
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(url, payload, raw=b"{nope" if payload is None else None)
    assert info.value.code == 400
    assert message in json.loads(info.value.read())["error"]["message"]
    with _post(url, {"prompt": "ok", "max_tokens": 2}) as r:  # still serving
        assert len(json.loads(r.read())["choices"][0]["token_ids"]) == 2
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"


def test_serve_command_starts_and_answers(tmp_path):
    """`python -m jaxsys.serve --workdir W` in its own process, on a free port, as a user runs it."""
    import os
    import re
    import subprocess
    import sys
    import time

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
            "--config.mesh.data=1",
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
        with _post(f"http://127.0.0.1:{port}", {"prompt": "import ", "max_tokens": 3}) as r:
            assert len(json.loads(r.read())["choices"][0]["token_ids"]) == 3
    finally:
        proc.terminate()
        proc.wait(30)
