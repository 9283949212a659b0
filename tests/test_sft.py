"""SFT data: chats rendered by the tokenizer's chat template, loss weights only on the assistant's
tokens (spans found by rendering prefixes), fine-tuning from a converted Hugging Face model
(checkpoint.init_from) with the loss equal to an independent mean over the assistant tokens, the
held-out chats' eval loss likewise; the weighted mean is the same on every layout."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import convert, data, train
from jaxsys import tokenizer as tokenizer_lib
from jaxsys.config import load_config
from jaxsys.data import documents, loader
from jaxsys.mesh import make_mesh
from jaxsys.models import transformer
from jaxsys.program import build
from tests.helpers import ROOT, program_for, small_config

GOLDEN = os.path.join(ROOT, "tests", "golden", "hf_llama")
HF_TOKENIZER = os.path.join(GOLDEN, "tokenizer")
BYTE_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3 + 3?"},
    {"role": "assistant", "content": "six"},
]


def test_the_assistant_mask_is_exactly_the_assistant_turns():
    tok = tokenizer_lib.ByteTokenizer()
    tok.chat_template = BYTE_TEMPLATE
    ids, mask = documents.assistant_mask(tok, CHAT)
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, add_generation_prompt=False)
    text = bytes(ids).decode()
    masked = "".join(ch for ch, m in zip(text, mask) if m)
    assert masked == "4</assistant>six</assistant>"
    assert mask[: text.index("<assistant>") + len("<assistant>")] == [0] * (text.index("<assistant>") + 11)

    hf = tokenizer_lib.HFTokenizer(HF_TOKENIZER)
    ids, mask = documents.assistant_mask(hf, CHAT)
    assert ids == hf.encode_chat(CHAT, add_generation_prompt=False)
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append(hf.decode(ids[start:i], skip_special_tokens=False))
            start = None
    assert len(spans) == 2
    assert spans[0].strip().startswith("4") and spans[1].strip().startswith("six")
    assert all("</s>" in s and "user" not in s and "2 + 2" not in s for s in spans)


def _chats(n: int, seed: int = 0) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    words = ["what", "is", "the", "colour", "of", "sky", "blue", "green", "yes", "no", "maybe", "red"]
    say = lambda k: " ".join(rng.choice(words, k))
    chats = []
    for i in range(n):
        chat = [{"role": "system", "content": say(3)}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            chat += [{"role": "user", "content": say(rng.integers(2, 9))}]
            chat += [{"role": "assistant", "content": say(rng.integers(1, 7))}]
        chats.append(chat)
    return chats


def _independent_mean(params, model, layout, rows_of_chats, tok, seq_len) -> float:
    """The mean next-token cross-entropy over the assistant's tokens of the chats (each cut to
    T + 1 tokens), from the model's logits on one device and numpy."""
    total, count = 0.0, 0
    for chat in rows_of_chats:
        ids, mask = documents.assistant_mask(tok, chat)
        ids, mask = np.array(ids[: seq_len + 1]), np.array(mask[: seq_len + 1])
        inputs = jnp.asarray(ids[None, :-1], jnp.int32)
        logits = np.asarray(transformer.logits(params, inputs, model, layout), np.float64)[0]
        logp = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True)
        )
        targets = ids[1:]
        take = mask[1:] == 1
        total += float(-logp[np.arange(len(targets)), targets][take].sum())
        count += int(take.sum())
    return total / count


@pytest.mark.slow
def test_sft_from_a_converted_model_weights_only_assistant_tokens(tmp_path):
    chats = _chats(16)
    with open(tmp_path / "chats.jsonl", "w") as f:
        for c in chats:
            f.write(json.dumps({"messages": c}) + "\n")
    base = tmp_path / "base"
    tiny = os.path.join(ROOT, "configs", "tiny.py:test")
    assert convert.main(["--from-hf", os.path.join(GOLDEN, "tied"), "--workdir", str(base), "--config", tiny]) == 0
    overrides = [
        "--config.data.source=jsonl",
        f"--config.data.path={tmp_path / 'chats.jsonl'}",
        "--config.data.format=chat",
        f"--config.data.tokenizer={HF_TOKENIZER}",
        f"--config.data.cache_dir={tmp_path / 'cache'}",
        "--config.data.tokenize_workers=1",
        "--config.data.eval_fraction=0.25",
        "--config.data.seq_len=64",
        f"--config.checkpoint.init_from={base}",
        "--config.train.steps=1",
        "--config.train.eval_batches=1",
        "--config.mesh.data=4",
        "--config.mesh.fsdp=2",
    ]
    config = load_config(str(base / "config.json"), overrides)
    sft = tmp_path / "sft"
    [record] = train.main(config, str(sft))
    tok = tokenizer_lib.HFTokenizer(HF_TOKENIZER)
    assert tokenizer_lib.record(str(sft))["kind"] == "huggingface"  # the workdir can generate text

    one = load_config(str(base / "config.json"), overrides + list(checkpoint_lib.ONE_DEVICE))
    program = build(one, make_mesh(one, jax.devices()[:1]))
    abstract = program.abstract_state().params
    converted, _ = checkpoint_lib.restore_params(str(base), abstract)
    corpus = loader.load_corpus(one.data)
    B, T = one.train.batch_size, one.data.seq_len
    batch = data.global_batch(corpus, program.batch_sharding, one.seed, 0, B, T)
    tokens, segments, weights = (np.asarray(a) for a in batch)

    # the batch: weights 0 on padding targets and on every target that is not the assistant's
    train_split = corpus.splits["train"]
    docs = [
        int(train_split.pieces.doc[train_split.plan.row(r)[0]])
        for r in corpus.row_ids(one.seed, 0, B, "train", range(B))
    ]
    for r, d in enumerate(docs):
        ids, mask = documents.assistant_mask(tok, chats[d])
        n = min(len(ids), T + 1)
        np.testing.assert_array_equal(tokens[r, :n], ids[:n])
        want = np.zeros(T, np.float32)
        want[: n - 1] = np.array(mask[1:n])
        np.testing.assert_array_equal(weights[r], want)
        assert (segments[r, n:] == 0).all() and (weights[r, n - 1 :] == 0).all()

    # step 1's loss: the converted model's mean over the assistant tokens of batch 0
    want = _independent_mean(converted, one.model, program.layout, [chats[d] for d in docs], tok, T)
    assert record["loss"] == pytest.approx(want, rel=1e-5)
    assert record["loss_tokens"] == int(weights.sum())
    # the held-out chats (the last 4), after the step, read back from the saved checkpoint
    trained, step = checkpoint_lib.restore_params(str(sft), abstract)
    assert step == 1
    eval_rows = corpus.row_ids(one.seed, 0, B, "eval", range(B))
    held_out = [chats[int(corpus.splits["eval"].pieces.doc[corpus.splits["eval"].plan.row(r)[0]])] for r in eval_rows]
    assert {id(c) for c in held_out} == {id(c) for c in chats[12:]}
    assert record["eval_loss"] == pytest.approx(
        _independent_mean(trained, one.model, program.layout, held_out, tok, T), rel=1e-5
    )


@pytest.mark.parametrize(
    "mesh", [dict(data=2, fsdp=2, tensor=2), dict(seq=2, data=4), dict(pipe=2, data=2, tensor=2)], ids=str
)
def test_the_weighted_mean_is_the_same_on_every_layout(tmp_path, mesh):
    """A batch of padded documents: loss and gradients on a layout equal one device's, including
    micro-batches under a pipeline (the weights travel with the targets) and context parallelism
    (each device weights its positions)."""
    rng = np.random.default_rng(0)
    with open(tmp_path / "d.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": "x" * int(rng.integers(2, 60))}) + "\n")

    layers = 4 if mesh.get("pipe") else 2

    def config(m):
        c = small_config(m, n_kv_heads=2, n_layers=layers)
        c.data.source, c.data.path, c.data.cache_dir = "jsonl", str(tmp_path / "d.jsonl"), str(tmp_path / "cache")
        c.data.tokenize_workers = 1
        c.train.microbatches = 4 if m.get("pipe") else 1
        return c

    def run(c):
        program = program_for(c)
        batch = data.global_batch(loader.load_corpus(c.data), program.batch_sharding, c.seed, 0, 8, c.data.seq_len)
        params = program.init().params
        loss, grads = program.loss_and_grads_fn()(params, batch)
        return float(loss), float(program.eval_loss_fn()(params, batch)), jax.tree.map(np.asarray, grads)

    loss, eval_loss, grads = run(config(mesh))
    ref_loss, ref_eval, ref_grads = run(config({}))
    assert loss == pytest.approx(ref_loss, rel=1e-5) and eval_loss == pytest.approx(ref_eval, rel=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
    c = config({})
    batch = data.global_batch(loader.load_corpus(c.data), program_for(c).batch_sharding, c.seed, 0, 8, c.data.seq_len)
    assert 0 < float(np.asarray(batch.weights).sum()) < 8 * c.data.seq_len  # padding is weighted out
