"""A small BPE tokenizer, the tiny model trained on it, served with a chat template (issue 30).

    python experiments/bpe_chat/run.py     # ~20-25 min on 2 CPU cores; writes results.json
    python experiments/bpe_chat/run.py --quick     # 20 steps, no sweep or control (~1 min)

1. The tokenizer: experiments/bpe_chat/tokenizer/ (committed; `train_tokenizer.py` made it from
   the train text of the stdlib corpus: byte-level BPE, 2048 ids, <s> </s> <unk>, a chat
   template). run.py trains it again and says whether the files come out identical, and trains
   BPE tokenizers of other sizes to measure their compression (bytes per token of held-out text).
2. The token file: the corpus through the tokenizer, train text then held-out text, cut where
   jaxsys.data cuts a text corpus read through a tokenizer; --config.data.eval_fraction makes the
   file's held-out split exactly the held-out text.
3. Training: configs/tiny_bpe.py (configs/tiny.py with the 2048-id vocabulary on the token file)
   and configs/tiny.py (bytes) for the same 300 steps of 16 x 128 tokens, and a byte control with
   seq_len 384 (about the bytes of text and of context per step the BPE model has); the tokenizer
   attached to the BPE workdir with `jaxsys.convert --tokenizer`. A workdir that already holds a
   finished run is reused (--fresh trains again).
4. Scoring: each model's total cross-entropy over the whole held-out text (every token but the
   first predicted once, in consecutive windows of the model's seq_len), divided by the text's
   bytes: bits per byte, the measure that compares tokenizers fairly.
5. Serving: `python -m jaxsys.serve --workdir W` on the BPE model, asked through the official
   `openai` client for a completion of text and a chat completion through the template, whole and
   streamed (greedy: the streamed text must equal the whole one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import train_tokenizer as tt  # noqa: E402  (experiments/bpe_chat/train_tokenizer.py)

TOKENIZER = os.path.join(HERE, "tokenizer")
SWEEP = (512, 1024, 2048, 4096, 8192)
SERVED_NAME = "tiny-bpe"


def log(msg: str) -> None:
    print(f"[bpe_chat] {msg}", flush=True)


# ----------------------------------------------------------------------------- tokenizer


def compression_sweep(train: bytes, held_out: bytes) -> list[dict]:
    """Bytes per token of the held-out text for BPE vocabularies of SWEEP sizes learnt from the train
    text (256: bytes); the 2048 one is compared with the committed tokenizer.json."""
    from tokenizers import Tokenizer

    parts = list(tt.pieces(held_out.decode("utf-8")))  # as jaxsys.tokenizer.encode_text encodes a corpus
    rows = [{"vocab": 256, "tokens": len(held_out), "bytes_per_token": 1.0}]
    committed = Tokenizer.from_file(os.path.join(TOKENIZER, "tokenizer.json"))
    for vocab in SWEEP:
        start = time.perf_counter()
        tok = tt.train_tokenizer(train, vocab)
        n = sum(len(e.ids) for e in tok.encode_batch(parts, add_special_tokens=False))
        row = {"vocab": vocab, "tokens": n, "bytes_per_token": len(held_out) / n}
        row["train_seconds"] = time.perf_counter() - start
        if vocab == tt.DEFAULT_VOCAB:
            row["identical_to_committed"] = tok.to_str() == committed.to_str()
        rows.append(row)
        log(f"BPE {vocab:>5} ids: {row['bytes_per_token']:.3f} bytes/token on the held-out text")
    return rows


def write_token_file(tok, path: str) -> dict:
    """The stdlib corpus through `tok` as data.py splits it (train text, then held-out text) into
    `path` (uint16); the eval_fraction whose held-out split is exactly the held-out tokens."""
    import numpy as np

    from jaxsys import data as data_lib
    from jaxsys import tokenizer as tokenizer_lib
    from jaxsys.config import base_config

    c = base_config()
    c.data.source = "stdlib"
    corpus = data_lib.load_corpus(c.data, encode=lambda raw: tokenizer_lib.encode_text(tok, raw))
    ids = np.concatenate([np.asarray(corpus.train), np.asarray(corpus.eval)]).astype(np.uint16)
    n, n_eval = int(ids.shape[0]), int(corpus.eval.shape[0])
    fraction = (n_eval + 0.5) / n
    assert int(n * fraction) == n_eval, (n, n_eval, fraction)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.save(path, ids)
    return {"path": path, "tokens": n, "train_tokens": n - n_eval, "eval_tokens": n_eval, "eval_fraction": fraction}


# ----------------------------------------------------------------------------- training


def finished(workdir: str, steps: int) -> bool:
    """A finished run: metrics.jsonl reaches `steps` and there is a checkpoint."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return any(r.get("step") == steps for r in records) and os.path.isdir(os.path.join(workdir, "checkpoints"))


def train(name: str, config: str, workdir: str, overrides: list[str], steps: int, fresh: bool, owned: bool) -> dict:
    """Train `config` into `workdir` (a subprocess), or reuse the finished run there. A workdir run.py
    does not own (--bytes-workdir) is never removed: not finished (or --fresh), it is an error."""
    cmd = [sys.executable, "-m", "jaxsys.train", "--config", config, "--workdir", workdir, *overrides]
    shown = " ".join(["python", *cmd[1:]])
    timing = os.path.join(workdir, "bpe_chat_seconds.json")  # the training's wall time, for a rerun
    if finished(workdir, steps) and not fresh:
        log(f"{name}: reusing the finished run in {workdir} ({shown})")
        seconds = None
        if os.path.isfile(timing):
            with open(timing) as f:
                seconds = json.load(f)["seconds"]
        return {"command": shown, "seconds": seconds}
    if os.path.exists(workdir):
        if not owned:
            raise SystemExit(f"{workdir} holds no finished {steps}-step run; run.py removes only its own workdirs")
        shutil.rmtree(workdir)
    log(f"{name}: {shown}")
    start = time.perf_counter()
    subprocess.run(cmd + ["--config.train.progress=False"], cwd=ROOT, check=True)
    seconds = time.perf_counter() - start
    with open(timing, "w") as f:
        json.dump({"seconds": seconds}, f)
    return {"command": shown, "seconds": seconds}


def last_eval(workdir: str) -> dict:
    """The run's last logged eval loss (train.eval_batches random held-out batches), its throughput
    after step 20, and its model FLOPs per step (jaxsys.analysis.flops, as training logs MFU)."""
    from jaxsys.analysis import flops as flops_lib
    from jaxsys.checkpoint import saved_config

    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    final = [r for r in records if "eval_loss" in r][-1]
    throughput = [r["tokens_per_s"] for r in records if r.get("step", 0) > 20]
    c, _ = saved_config(workdir)
    tokens = c.train.batch_size * c.data.seq_len
    return {
        "seq_len": c.data.seq_len,
        "tokens_per_step": tokens,
        "gflops_per_step": flops_lib.step_flops_per_token(c) * tokens / 1e9,
        "step": final["step"],
        "train_loss": final["loss"],
        "eval_loss": final["eval_loss"],
        "tokens_per_s": sum(throughput) / len(throughput) if throughput else None,
    }


# ----------------------------------------------------------------------------- scoring


def score(workdir: str, ids, lengths, batch: int = 16) -> dict:
    """Total nats of the held-out ids under `workdir`'s model: every id but the first predicted
    once, in consecutive windows of seq_len (the last window overlaps its neighbour and counts only
    its new targets); bytes: the text those predicted ids stand for."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxsys import checkpoint as checkpoint_lib
    from jaxsys.models import transformer

    program, params, config = checkpoint_lib.load(workdir)
    m, T = config.model, config.data.seq_len
    ids = np.asarray(ids, np.int32)
    n = ids.shape[0]
    starts = list(range(0, n - 1 - T + 1, T))
    covered = starts[-1] + T + 1 if starts else 1
    windows = [(s, 0) for s in starts]
    if covered < n:
        windows.append((n - 1 - T, T - (n - covered)))  # count targets from `skip` on
    lengths = np.asarray(lengths, np.int64)

    @jax.jit
    def nats(params, inputs, targets):
        logits = transformer.logits(params, inputs, m, program.layout)
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]

    total_nats, total_bytes, total_tokens = 0.0, 0, 0
    for i in range(0, len(windows), batch):
        group = windows[i : i + batch]
        rows = np.stack([ids[s : s + T + 1] for s, _ in group] + [ids[: T + 1]] * (batch - len(group)))
        mask = np.zeros((batch, T), bool)
        for r, (_, skip) in enumerate(group):
            mask[r, skip:] = True
        out = np.asarray(nats(params, jnp.asarray(rows[:, :-1]), jnp.asarray(rows[:, 1:])), np.float64)
        total_nats += float(out[mask].sum())
        total_bytes += int(lengths[rows[:, 1:]][mask].sum())
        total_tokens += int(mask.sum())
    assert total_tokens == n - 1, (total_tokens, n)
    params_count = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    return {
        "scored_tokens": total_tokens,
        "scored_bytes": total_bytes,
        "nats_per_token": total_nats / total_tokens,
        "bits_per_byte": total_nats / math.log(2) / total_bytes,
        "params": params_count,
    }


# ----------------------------------------------------------------------------- serving


def serve_and_ask(workdir: str) -> dict:
    """Start `python -m jaxsys.serve --workdir W --port 0`, ask it through the openai client, stop it."""
    import openai

    cmd = [sys.executable, "-m", "jaxsys.serve", "--workdir", workdir, "--port", "0"]
    cmd += ["--served-model-name", SERVED_NAME]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    url: list[str] = []
    ready, lines = threading.Event(), []

    def watch():
        for line in proc.stderr:
            lines.append(line)
            found = re.search(r"on (http://\S+/v1)", line)
            if found and not url:
                url.append(found.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        if not ready.wait(600) or not url:
            raise SystemExit("the server did not start:\n" + "".join(lines[-40:]))
        log(f"server: {lines[-1].strip()}")
        client = openai.OpenAI(base_url=url[0], api_key="unused", max_retries=0, timeout=300)
        out: dict = {"command": " ".join(["python", *cmd[1:]])}
        prompt = "def fibonacci(n):\n"
        c = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=48, temperature=0)
        out["completion"] = {
            "prompt": prompt,
            "text": c.choices[0].text,
            "finish_reason": c.choices[0].finish_reason,
            "usage": c.usage.model_dump(),
        }
        messages = [
            {"role": "system", "content": "You are a Python programmer."},
            {"role": "user", "content": "Write a function that reverses a list."},
        ]
        ask = dict(model=SERVED_NAME, messages=messages, max_tokens=48, temperature=0)
        whole = client.chat.completions.create(**ask)
        streamed = list(client.chat.completions.create(**ask, stream=True))
        deltas = [ch.choices[0].delta.content or "" for ch in streamed if ch.choices]
        reasons = [ch.choices[0].finish_reason for ch in streamed if ch.choices and ch.choices[0].finish_reason]
        out["chat"] = {
            "messages": messages,
            "text": whole.choices[0].message.content,
            "finish_reason": whole.choices[0].finish_reason,
            "usage": whole.usage.model_dump(),
            "streamed_chunks": len(streamed),
            "streamed_text_equal": "".join(deltas) == whole.choices[0].message.content,
            "streamed_finish_reason": reasons[-1] if reasons else None,
        }
        # an assistant turn in the history, sampled: the template renders all three roles
        sampled = client.chat.completions.create(
            model=SERVED_NAME,
            messages=messages
            + [
                {"role": "assistant", "content": "def reverse(xs):\n    return xs[::-1]"},
                {"role": "user", "content": "Now without slicing."},
            ],
            max_tokens=48,
            temperature=0.8,
            seed=0,
        )
        out["chat_sampled"] = {"text": sampled.choices[0].message.content, "usage": sampled.usage.model_dump()}
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/jaxsys_bpe_chat", help="token file and workdirs")
    parser.add_argument("--bytes-workdir", help="a finished configs/tiny.py run to reuse (default: OUT/tiny_bytes)")
    parser.add_argument("--fresh", action="store_true", help="train again even where a finished run exists")
    parser.add_argument("--no-control", action="store_true", help="skip the seq_len-384 byte control")
    parser.add_argument("--no-sweep", action="store_true", help="skip the compression sweep")
    parser.add_argument("--quick", action="store_true", help="20 steps, no sweep or control, into OUT_quick")
    args = parser.parse_args(argv)
    steps = 300
    if args.quick:
        args.out, args.no_sweep, args.no_control, steps = args.out.rstrip("/") + "_quick", True, True, 20

    import jax

    from jaxsys import tokenizer as tokenizer_lib
    from jaxsys.mesh import cpu_unless_accelerator

    cpu_unless_accelerator()
    results: dict = {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
    }
    train_text, held_out = tt.split_corpus()
    results["corpus"] = {"train_bytes": len(train_text), "held_out_bytes": len(held_out)}
    tok = tokenizer_lib.HFTokenizer(TOKENIZER)
    results["tokenizer"] = {"path": os.path.relpath(TOKENIZER, ROOT), "vocab": tok.vocab_size, "sha": tok.fingerprint}
    if not args.no_sweep:
        results["compression"] = compression_sweep(train_text, held_out)

    token_file = os.path.join(args.out, f"stdlib_bpe{tok.vocab_size}.npy")
    data = write_token_file(tok, token_file)
    results["token_file"] = data
    log(
        f"token file {token_file}: {data['train_tokens']:,} train + {data['eval_tokens']:,} held-out tokens "
        f"(eval_fraction {data['eval_fraction']!r})"
    )
    bpe_dir = os.path.join(args.out, "tiny_bpe")
    bytes_dir = args.bytes_workdir or os.path.join(args.out, "tiny_bytes")
    control_dir = os.path.join(args.out, "tiny_bytes_384")
    runs = [
        (
            "bpe",
            "configs/tiny_bpe.py",
            bpe_dir,
            [f"--config.data.path={token_file}", f"--config.data.eval_fraction={data['eval_fraction']!r}"],
        ),
        ("bytes", "configs/tiny.py", bytes_dir, []),
    ]
    if not args.no_control:
        runs.append(("bytes_384", "configs/tiny.py", control_dir, ["--config.data.seq_len=384"]))
    if args.quick:
        runs = [(name, c, w, o + [f"--config.train.steps={steps}"]) for name, c, w, o in runs]

    held_ids = {"bytes": list(held_out), "bpe": tokenizer_lib.encode_text(tok, held_out)}
    lengths = {"bytes": [1] * 256, "bpe": tt.token_bytes(TOKENIZER)}
    assert sum(lengths["bpe"][i] for i in held_ids["bpe"]) == len(held_out)
    results["runs"] = []
    for name, config, workdir, overrides in runs:
        row: dict = {
            "name": name,
            "workdir": workdir,
            **train(name, config, workdir, overrides, steps, args.fresh, workdir != args.bytes_workdir),
        }
        if name == "bpe":
            attach = ["python", "-m", "jaxsys.convert", "--tokenizer", os.path.relpath(TOKENIZER, ROOT)]
            attach += ["--workdir", workdir]
            subprocess.run([sys.executable, *attach[1:]], cwd=ROOT, check=True)
            row["attach"] = " ".join(attach)
        row.update(last_eval(workdir))
        kind = "bpe" if name == "bpe" else "bytes"
        row.update(score(workdir, held_ids[kind], lengths[kind]))
        row["bytes_per_token"] = row["scored_bytes"] / row["scored_tokens"]
        log(
            f"{name}: eval loss {row['eval_loss']:.4f} nats/token (training's, step {row['step']}); held-out "
            f"text {row['nats_per_token']:.4f} nats/token, {row['bits_per_byte']:.4f} bits/byte, "
            f"{row['bytes_per_token']:.3f} bytes/token, {row['params'] / 1e6:.2f}M params"
        )
        results["runs"].append(row)

    results["serve"] = serve_and_ask(bpe_dir)
    results["chat_prompt"] = tok.apply_chat_template(results["serve"]["chat"]["messages"])
    log(f"completion of {results['serve']['completion']['prompt']!r}: {results['serve']['completion']['text']!r}")
    log(
        f"chat: {results['serve']['chat']['text']!r} (streamed equal: {results['serve']['chat']['streamed_text_equal']})"
    )
    with open(os.path.join(args.out if args.quick else HERE, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
