"""Fine-tuning (issue 32 parts 5-7, docs/finetune.md): LoRA adapters start as the base model, give
one device's loss and gradients under FSDP and data x tensor, are the only trained (and
optimizer-state-holding) leaves, merge into exported weights with the adapted model's logits, and
train over a frozen w4a16 base (QLoRA); DPO's loss and logged terms against a NumPy statement of
the formula; preference pairs on rows 2i / 2i + 1 with weights on the completions; a profiler
trace from train.profile_steps; bad configs refused before any work."""

from __future__ import annotations

import copy
import glob
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import data, train
from jaxsys import tokenizer as tokenizer_lib
from jaxsys.checkpoint import hf as hf_lib
from jaxsys.config import ConfigError, validate
from jaxsys.data import documents, loader
from jaxsys.models import adapters, lora, transformer
from jaxsys.models import params as params_lib
from jaxsys.quantization import workdir as quant_workdir
from tests.helpers import crash_then_resume, program_for, small_config

RANK = 4


def lora_config(mesh=None, **lora_keys):
    c = small_config(mesh)
    c.lora.rank = RANK
    for k, v in lora_keys.items():
        c.lora[k] = v
    return c


def _with_random_b(params, seed: int = 0):
    """`params` with every adapter's B drawn at random (at init B = 0 and A gets no gradient)."""
    new = adapters.trainable(params)
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    layers = {
        name: {**node, "lora_b": 0.05 * jax.random.normal(next(keys), node["lora_b"].shape, node["lora_b"].dtype)}
        for name, node in new["layers"].items()
    }
    return adapters.with_trainable(params, {"layers": layers})


def _batch(config, program, step: int = 0):
    corpus = data.load_corpus(config.data)
    return data.global_batch(corpus, program.batch_sharding, config.seed, step, config.train.batch_size, 32)


@pytest.fixture(scope="module")
def one_device():
    """The LoRA program on one device, its initial parameters and ones with B drawn at random."""
    c = lora_config()
    program = program_for(c)
    params = program.init().params
    return c, program, params, _with_random_b(params)


def test_lora_with_b_zero_is_the_base_model(one_device):
    c, program, params, randomized = one_device
    base = program_for(small_config())
    base_params = base.init().params
    # the same seed gives the same base weights, with or without adapters
    jax.tree.map(np.testing.assert_array_equal, adapters.strip(params), base_params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 32)), jnp.int32)
    want = np.asarray(transformer.logits(base_params, tokens, c.model, base.layout))
    got = np.asarray(transformer.logits(params, tokens, c.model, program.layout, program.specs))
    np.testing.assert_array_equal(got, want)
    moved = np.asarray(transformer.logits(randomized, tokens, c.model, program.layout, program.specs))
    assert np.abs(moved - want).max() > 1e-3  # the adapters are on the model's path


def test_only_adapters_are_trained_and_hold_optimizer_state(one_device):
    c, program, params, _ = one_device
    state = program.fresh_state(jax.tree.map(jnp.copy, params))  # fresh_state donates its argument
    trainable = adapters.trainable(params)
    n_adapters = params_lib.count(adapters.trainable(program.specs))
    assert n_adapters == sum(x.size for x in jax.tree.leaves(trainable))
    expected = 2 * c.model.n_layers * RANK  # r (K' + N') per projection and layer
    m = c.model
    k_n = [
        (m.d_model, m.n_heads * m.head_dim),
        (m.d_model, m.n_kv_heads * m.head_dim),
        (m.d_model, m.n_kv_heads * m.head_dim),
        (m.n_heads * m.head_dim, m.d_model),
        (m.d_model, m.d_ff),
        (m.d_model, m.d_ff),
        (m.d_ff, m.d_model),
    ]
    assert n_adapters == expected // 2 * sum(k + n for k, n in k_n)
    # AdamW: two moments per adapter parameter, nothing for the frozen base
    opt_elements = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
    assert opt_elements == 2 * n_adapters
    before = jax.tree.map(np.asarray, adapters.strip(state.params))
    new_state, metrics = program.train_step_fn()(state, _batch(c, program))
    jax.tree.map(np.testing.assert_array_equal, adapters.strip(new_state.params), before)
    moved = [np.abs(np.asarray(b)).max() for b in jax.tree.leaves(adapters.trainable(new_state.params))]
    assert max(moved) > 0 and np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("mesh", [dict(fsdp=8), dict(data=2, tensor=2)], ids=["fsdp8", "data2xtensor2"])
def test_lora_on_a_layout_equals_one_device(one_device, mesh):
    c, program, _, params = one_device
    want_loss, want_grads = program.loss_and_grads_fn()(params, _batch(c, program))
    other = program_for(lora_config(mesh))
    placed = jax.device_put(jax.tree.map(np.asarray, params), other.param_shardings)
    loss, grads = other.loss_and_grads_fn()(placed, _batch(c, other))
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-5 * np.abs(w).max())


# ----------------------------------------------------------------------------- a run: export, QLoRA, trace


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A float base (tiny:test, 2 steps on data=8), a LoRA run on it (fsdp=8, 3 steps, a profiler
    trace of 2..3), the base quantized w4a16 and a QLoRA run on that (data=4 x tensor=2, 8 steps)."""
    root = tmp_path_factory.mktemp("finetune")
    base = str(root / "base")
    c = small_config(dict(data=8))
    c.train.steps, c.train.lr = 2, 1e-2
    train.main(c, base)
    tuned = str(root / "lora")
    c = lora_config(dict(fsdp=8))
    c.train.steps, c.train.lr, c.train.profile_steps = 3, 1e-2, "2:3"
    c.checkpoint.init_from = base
    lora_records = train.main(c, tuned)
    quantized = str(root / "base_w4")
    quant_workdir.quantize_workdir(base, quantized, "w4a16", group_size=32, log=lambda *_: None)
    qlora = str(root / "qlora")
    c = lora_config(dict(data=4, tensor=2))
    c.model.quant, c.model.quant_group_size = "w4a16", 32
    c.train.steps, c.train.lr, c.train.warmup_steps = 8, 3e-2, 1
    c.checkpoint.init_from = quantized
    qlora_records = train.main(c, qlora)
    return dict(
        root=root,
        base=base,
        lora=tuned,
        lora_records=lora_records,
        quantized=quantized,
        qlora=qlora,
        qlora_records=qlora_records,
    )


def test_merged_export_equals_the_adapted_model(runs):
    program, params, config = checkpoint_lib.load(runs["lora"], checkpoint_lib.ONE_DEVICE, adapters="apply")
    b_values = [np.abs(np.asarray(n["lora_b"])).max() for n in adapters.trainable(params)["layers"].values()]
    assert adapters.has_adapters(params) and max(b_values) > 0  # B moved off zero
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 32)), jnp.int32)
    want = np.asarray(transformer.logits(params, tokens, config.model, program.layout, program.specs))
    out = str(runs["root"] / "hf")
    hf_lib.to_hf(runs["lora"], out)
    back = str(runs["root"] / "from_hf")
    hf_lib.from_hf(out, back, config=copy.deepcopy(small_config()))
    merged_program, merged, merged_config = checkpoint_lib.load(back, checkpoint_lib.ONE_DEVICE)
    assert not adapters.has_adapters(merged) and merged_config.lora.rank == 0
    got = np.asarray(transformer.logits(merged, tokens, merged_config.model, merged_program.layout))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)  # fp32 weights, W + scale A B rounded once


def test_profile_steps_write_a_trace_and_tflops(runs):
    traces = glob.glob(os.path.join(runs["lora"], "tb", "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
    assert all(r["tflop_per_s"] > 0 for r in runs["lora_records"])


def test_qlora_over_w4a16_trains_and_leaves_the_codes(runs):
    losses = [r["loss"] for r in runs["qlora_records"]]
    assert np.mean(losses[-3:]) < losses[0] - 0.05, losses
    _, trained, config = checkpoint_lib.load(runs["qlora"], checkpoint_lib.ONE_DEVICE)  # auto: applied
    _, quantized, _ = checkpoint_lib.load(runs["quantized"], checkpoint_lib.ONE_DEVICE)
    assert config.model.quant == "w4a16" and adapters.has_adapters(trained)
    jax.tree.map(np.testing.assert_array_equal, adapters.strip(trained), quantized)


# ----------------------------------------------------------------------------- DPO


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_dpo_loss_against_numpy():
    c = small_config()
    c.train.objective, c.data.format, c.data.source, c.train.dpo.beta = "dpo", "preference", "jsonl", 0.5
    program = program_for(c)
    policy = program.init().params
    reference = program.init(seed=7).params
    rng = np.random.default_rng(0)
    B, T = c.train.batch_size, c.data.seq_len
    tokens = rng.integers(0, 256, (B, T + 1)).astype(np.int32)
    weights = np.zeros((B, T), np.float32)
    for r in range(B):  # a prompt, then a completion of a few tokens, then padding
        start, stop = rng.integers(3, 12), rng.integers(14, T)
        weights[r, start:stop] = 1.0
    segments = np.ones((B, T + 1), np.int32)
    batch = data.Batch(*(jax.device_put(a, program.batch_sharding) for a in (tokens, segments, weights)))
    got = program.eval_metrics_fn()(policy, batch, reference)

    def logps(params):
        logits = np.asarray(transformer.logits(params, jnp.asarray(tokens[:, :-1]), c.model, program.layout))
        lp = _log_softmax(logits.astype(np.float64))
        return (np.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0] * weights).sum(-1)

    pi, ref = logps(policy), logps(reference)
    beta = 0.5
    chosen, rejected = beta * (pi[0::2] - ref[0::2]), beta * (pi[1::2] - ref[1::2])
    margin = chosen - rejected
    assert float(got["loss"]) == pytest.approx(np.mean(np.log1p(np.exp(-margin))), rel=1e-4)
    assert float(got["dpo_margin"]) == pytest.approx(np.mean(margin), rel=1e-4, abs=1e-5)
    assert float(got["dpo_reward_chosen"]) == pytest.approx(np.mean(chosen), rel=1e-4, abs=1e-5)
    assert float(got["dpo_accuracy"]) == np.mean(margin > 0)


def _write_pairs(path, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    letters = list("abcdefgh")
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(rng.choice(letters, rng.integers(3, 6)))
            wrong = word[::-1] + "x"
            f.write(json.dumps({"prompt": f"copy {word}: ", "chosen": word + "\n", "rejected": wrong + "\n"}) + "\n")


def test_preference_pairs_sit_on_rows_2i_and_2i_plus_1(tmp_path):
    _write_pairs(tmp_path / "p.jsonl", 24)
    records = [json.loads(line) for line in open(tmp_path / "p.jsonl")]
    c = small_config()
    c.train.objective, c.data.format, c.data.source = "dpo", "preference", "jsonl"
    c.data.path, c.data.cache_dir, c.data.tokenize_workers = str(tmp_path / "p.jsonl"), str(tmp_path / "cache"), 1
    c.data.eval_fraction = 0.25
    validate(c)
    corpus = loader.load_corpus(c.data)
    assert corpus.splits["train"].num_rows == 2 * 18 and corpus.splits["eval"].num_rows == 2 * 6
    program = program_for(c)
    for step, split in ((0, "train"), (3, "train"), (0, "eval")):
        batch = data.global_batch(corpus, program.batch_sharding, c.seed, step, 8, 32, split)
        tokens, _, weights = (np.asarray(a) for a in batch)
        rows = corpus.row_ids(c.seed, step, 8, split, range(8))
        for r in range(0, 8, 2):
            assert rows[r] % 2 == 0 and rows[r + 1] == rows[r] + 1  # a pair, chosen first
            rows_split = corpus.splits[split]
            doc = int(rows_split.pieces.doc[rows_split.plan.row(rows[r])[0]])
            assert doc % 2 == 0
            pair = records[doc // 2]
            for k, name in ((r, "chosen"), (r + 1, "rejected")):
                text = pair["prompt"] + pair[name]
                n = len(text)
                assert bytes(tokens[k, :n].astype(np.uint8)).decode() == text
                # the weights select exactly the completion's targets
                want = np.zeros(32, np.float32)
                want[len(pair["prompt"]) - 1 : n - 1] = 1
                np.testing.assert_array_equal(weights[k], want)

    # a chat template: the prompt a user turn, the completion the assistant's
    tok = tokenizer_lib.ByteTokenizer()
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (ids, mask), _ = documents.encode_preference(tok, {"prompt": "hi", "chosen": "yo", "rejected": "no"}, "r")
    text = bytes(ids.tolist()).decode()
    assert text == "<user>hi</user><assistant>yo</assistant>"
    assert "".join(ch for ch, m in zip(text, mask) if m) == "yo</assistant>"


@pytest.mark.slow
def test_dpo_with_lora_trains_on_pairs(tmp_path):
    """End to end: DPO over LoRA (the reference is the base, adapters left out): step 1's loss is
    log 2 (policy = reference), the logged margin moves and the held-out terms are logged."""
    _write_pairs(tmp_path / "p.jsonl", 64)
    c = lora_config(dict(data=2, fsdp=2, tensor=2))  # a pair per batch shard
    c.train.objective, c.data.format, c.data.source = "dpo", "preference", "jsonl"
    c.data.path, c.data.cache_dir, c.data.tokenize_workers = str(tmp_path / "p.jsonl"), str(tmp_path / "cache"), 1
    c.data.eval_fraction, c.train.steps, c.train.lr, c.train.warmup_steps = 0.25, 6, 3e-2, 1
    records = train.main(c, str(tmp_path / "dpo"))
    assert records[0]["loss"] == pytest.approx(np.log(2), abs=1e-6) and records[0]["dpo_margin"] == 0.0
    assert records[-1]["dpo_margin"] > 0 and records[-1]["loss"] < np.log(2)
    assert {"eval_dpo_margin", "eval_dpo_accuracy"} <= set(records[-1])


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(lora=dict(rank=4), mesh=dict(pipe=2)), "config.mesh.pipe"),
        (dict(lora=dict(rank=4, targets="wq,w_foo")), "w_foo"),
        (dict(lora=dict(rank=4), train=dict(optimizer="zo")), "config.train.optimizer"),
        (dict(lora=dict(rank=-1)), "config.lora.rank"),
        (dict(train=dict(objective="dpo")), "format='preference'"),
        (
            dict(
                train=dict(objective="dpo", batch_size=6),
                data=dict(format="preference", source="jsonl"),
                mesh=dict(data=2),
            ),
            "multiple",
        ),
        (dict(train=dict(profile_steps="3-4")), "profile_steps"),
        (dict(train=dict(profile_steps="3:99")), "profile_steps"),
    ],
)
def test_bad_configs_are_refused(change, words):
    c = small_config()
    for group, keys in change.items():
        for k, v in keys.items():
            c[group][k] = v
    with pytest.raises(ConfigError, match=re.escape(words)):
        validate(c)


def test_qlora_without_a_quantized_base_is_refused_before_work(tmp_path):
    c = lora_config()
    c.model.quant, c.model.quant_group_size = "w4a16", 32
    with pytest.raises(ConfigError, match="jaxsys.quantize"):
        train.main(c, str(tmp_path / "w"))
    assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_lora_node_is_a_pytree_with_static_scale():
    node = lora.LoRA(jnp.ones((2, 3)), jnp.ones((2, 1)), jnp.zeros((1, 3)), 2.0, 0.0)
    leaves, tree = jax.tree.flatten(node)
    assert len(leaves) == 3 and jax.tree.unflatten(tree, leaves).scale == 2.0


@pytest.mark.parametrize(
    "name, arg", [("tiny_lora", None), ("tiny_lora", "qlora"), ("tiny_dpo", None), ("tiny_dpo", "full")]
)
def test_the_finetune_configs_validate(name, arg):
    from tests.helpers import config_file

    validate(config_file(name, arg))


@pytest.mark.slow
def test_lora_on_packed_chats_resumes_exactly(tmp_path, monkeypatch):
    """LoRA with dropout on packed chat rows (data=2 x fsdp=2 x tensor=2): a run killed after its
    step-3 checkpoint and started again has, step for step, the losses of an uninterrupted one."""
    from experiments.sft_lora import generate  # a byte-identity HF tokenizer with a chat template

    generate.main([str(tmp_path), "--chats", "120"])

    def config():
        c = lora_config(dict(data=2, fsdp=2, tensor=2), dropout=0.1)
        c.data.source, c.data.path, c.data.format = "jsonl", str(tmp_path / "chats.jsonl"), "chat"
        c.data.tokenizer, c.data.packing = str(tmp_path / "tokenizer"), True
        c.data.cache_dir, c.data.tokenize_workers, c.data.eval_fraction = str(tmp_path / "cache"), 1, 0.1
        c.train.steps, c.checkpoint.every_steps, c.train.log_every = 6, 3, 1
        return c

    train.main(config(), str(tmp_path / "full"))
    records = crash_then_resume(monkeypatch, config, str(tmp_path / "resumed"))
    assert [r["step"] for r in records] == [4, 5, 6]
    losses = lambda w: {r["step"]: r["loss"] for r in map(json.loads, open(w / "metrics.jsonl"))}
    full, resumed = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(1, 7))
    for step in range(1, 7):
        assert resumed[step] == full[step], step  # bitwise on CPU
