"""Generation with a KV cache (the serving engine with a few requests: jaxsys/serve/engine.py's
`generate`, `python -m jaxsys.generate`).

The reference is the training forward: greedy decoding must pick, at every step, the argmax of the
last position of `transformer.logits` over the whole sequence so far, recomputed from scratch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import generate as generate_cli
from jaxsys import train
from jaxsys.models import transformer
from jaxsys.quantization.params import quantize_params
from jaxsys.serve import sampling as sampling_lib
from tests.helpers import generate_contiguous, program_for, small_config

PROMPTS = [[10, 20, 30, 40, 50], [7, 8, 9]]
NEW = 12


def _greedy_by_full_forwards(config, params, prompt, n):
    program = program_for(small_config(**{k: config.model[k] for k in ("n_kv_heads", "quant", "quant_group_size")}))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = jax.device_put(params, one)
    fn = jax.jit(lambda p, ids: transformer.logits(p, ids, program.config.model, program.layout, program.specs))
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(jnp.argmax(fn(params, jnp.asarray([seq], jnp.int32))[0, -1])))
    return seq[len(prompt) :]


@pytest.mark.parametrize("mesh", [None, {"tensor": 2, "data": 2}])
def test_greedy_generation_equals_argmax_of_full_forwards(mesh):
    config = small_config(mesh, n_kv_heads=4)
    program = program_for(config)
    params = program.init(3).params
    got = generate_contiguous(program, params, PROMPTS, NEW, max_len=32)
    host = jax.tree.map(np.asarray, params)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == _greedy_by_full_forwards(config, host, prompt, NEW)


def test_quantized_model_generates_its_own_greedy_tokens():
    config = small_config(n_kv_heads=4)
    params = jax.tree.map(np.asarray, program_for(config).init(3).params)
    qconfig = small_config({"tensor": 2}, n_kv_heads=4, quant="w4a16", quant_group_size=32)
    qparams = quantize_params(params, qconfig.model, "w4a16", 32)
    program = program_for(qconfig)
    got = generate_contiguous(program, jax.device_put(qparams, program.param_shardings), PROMPTS[:1], NEW, max_len=32)
    assert got[0] == _greedy_by_full_forwards(qconfig, qparams, PROMPTS[0], NEW)


def test_sampling_filters_and_seeds():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)), jnp.float32)
    greedy = np.asarray(jnp.argmax(logits, -1))
    s = lambda t, k, p, seed: np.asarray(
        sampling_lib.sample(logits, jax.random.key(seed), jnp.float32(t), jnp.int32(k), jnp.float32(p))
    )
    np.testing.assert_array_equal(s(0.0, 0, 1.0, 0), greedy)
    np.testing.assert_array_equal(s(1.0, 1, 1.0, 5), greedy)  # top-1 is greedy whatever the draw
    np.testing.assert_array_equal(s(1.0, 0, 1e-6, 5), greedy)  # so is the smallest nucleus
    np.testing.assert_array_equal(s(0.9, 10, 0.9, 7), s(0.9, 10, 0.9, 7))
    draws = np.stack([s(1.0, 3, 1.0, seed) for seed in range(200)])
    top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
    assert all(set(draws[:, b]) <= set(top3[b]) for b in range(4))  # only the top 3 are drawn
    assert all(len(set(draws[:, b])) > 1 for b in range(4))  # and not only the first


def test_frequencies_follow_the_softmax():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]], jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4000)
    draws = np.asarray(
        jax.vmap(lambda k: sampling_lib.sample(logits, k, jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0)))(keys)
    )[:, 0]
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, np.asarray(jax.nn.softmax(logits[0])), atol=0.03)  # 4000 draws: sd < 0.008


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen")
    c = small_config(dict(data=8))
    c.train.steps, c.train.eval_batches = 4, 1
    c.checkpoint.async_save = False
    train.main(c, str(path))
    return str(path)


def test_generate_command_prints_text(workdir, capsys):
    assert (
        generate_cli.main(["--workdir", workdir, "--prompt", "def f(", "--max-new-tokens", "8", "--config.mesh.data=1"])
        == 0
    )
    out, err = capsys.readouterr()
    assert len(out.rstrip("\n").encode("utf-8", "replace")) >= 1 and "8 tokens in" in err
    # a run trained before workdirs recorded their tokenizer: its byte corpus and 256 ids make it bytes
    from jaxsys import tokenizer

    assert tokenizer.record(workdir) is None and "bytes tokenizer (256 ids)" in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "x", "--max-new-tokens", "0"], "must be >= 1"),
        (["--prompt", "x", "--temperature", "-1"], "temperature >= 0"),
        (["--prompt", "x", "--top-p", "0"], "0 < top_p <= 1"),
        (["--prompt", "x" * 40, "--max-len", "32"], "exceeds the cache of 32 positions"),
        (["--prompt", "x", "--config.mesh.pipe=2", "--config.mesh.data=4"], "config.mesh.pipe=2"),
    ],
)
def test_generate_command_names_bad_input(workdir, capsys, args, message):
    assert generate_cli.main(["--workdir", workdir, "--config.mesh.data=1", *args]) == 2
    assert message in capsys.readouterr().err


def test_decode_analysis_by_hand():
    """tiny:test (L=2, K=4 kv heads of H=16, fp32) on tensor=2: KV per token 2 L K H 4 B / 2 =
    512 B; the weights' shards are fp32 at rest; at batch 1 the step reads every weight once."""
    from jaxsys.analysis import decode as decode_analysis
    from jaxsys.analysis import hardware

    config = small_config({"tensor": 2}, n_kv_heads=4)
    hw = hardware.PROFILES["h100"]
    r = decode_analysis.decode_report(config, hw, contexts=[1024], batches=[1, 4])
    assert r["kv_bytes_per_token"] == 2 * 2 * 4 * 16 * 4 // 2
    weights = program_for(config).abstract_state().params
    per_device = sum(int(np.prod(a.sharding.shard_shape(a.shape))) * 4 for a in jax.tree.leaves(weights))
    assert r["weight_bytes_per_device"] == per_device
    row = r["rows"][0]
    assert row["memory_s"] == pytest.approx((per_device + 1024 * 512) / hw.hbm_bytes_per_s)
    assert r["max_batch_per_device"][1024] == int((hw.hbm_bytes - per_device) // (1024 * 512))
    assert "sequences that fit" in decode_analysis.format_decode_report(r)


@pytest.mark.parametrize(
    "name,mesh",
    [
        ("untied", None),
        ("tied", {"data": 2}),
        ("mistral", None),
        ("phi3", None),
        ("gemma2", {"tensor": 2}),
        ("gemma3", {"tensor": 2}),
        ("mixtral", None),
        ("qwen2_moe", {"tensor": 2}),
        ("qwen3_moe", {"data": 2}),
        pytest.param("deepseek_v2", {"tensor": 2}, marks=pytest.mark.slow),  # v3 covers the latent caches
        ("deepseek_v3", {"data": 2, "tensor": 2}),
    ],
)
def test_generation_from_a_converted_hf_model_equals_transformers_greedy(tmp_path, name, mesh):
    """tests/golden/hf_llama/<name>/greedy_tokens.npy: 16 tokens `transformers` generated greedily
    (fp32, KV cache) from the first 8 tokens of each golden row (scripts/make_hf_greedy_golden.py).
    mistral, phi3, gemma2 and gemma3 have sliding windows (8, 10, 6, 6) shorter than the 24 tokens,
    gemma2 soft-capped attention scores (at 2) and logits, gemma3 Gemma 3's pieces, mixtral, qwen2_moe
    (with its gated shared expert, on tensor 2) and qwen3_moe experts, deepseek_v2 / v3 latent attention
    (its keys and values expanded, heads of 16 padded for the caches) and DeepSeek's routing: the
    contiguous cache, and for these the paged one too (its ragged prefill and per-row decode
    kernels), give transformers' tokens."""
    import os

    from jaxsys.checkpoint import hf
    from tests.helpers import ROOT

    golden = os.path.join(ROOT, "tests", "golden", "hf_llama", name)
    workdir = str(tmp_path / name)
    config = hf.from_hf(golden, workdir)
    for axis, size in (mesh or {}).items():
        config.mesh[axis] = size
    program = program_for(config)
    from jaxsys.checkpoint import restore_params

    params, _ = restore_params(workdir, program.abstract_state().params)
    prompts = np.load(os.path.join(golden, "greedy_prompts.npy")).tolist()
    want = np.load(os.path.join(golden, "greedy_tokens.npy")).tolist()
    assert generate_contiguous(program, params, prompts, len(want[0]), max_len=32) == want
    if name not in ("untied", "tied"):
        from jaxsys.serve import engine

        eng = engine.Engine(program, params, num_pages=32, page_size=4, token_budget=16, chunk_size=4, max_seqs=2)
        requests = [eng.submit(i, prompt, len(want[0])) for i, prompt in enumerate(prompts)]
        eng.run()
        assert [r.generated for r in requests] == want


# ----------------------------------------------------------------------------- converted models, text and ids


@pytest.fixture(scope="module")
def hf_workdirs(tmp_path_factory):
    """Each golden Llama (vocabulary 384) converted twice: from its own directory, which has no
    tokenizer (recorded as none), and from a copy beside the fixture tokenizer's files (copied)."""
    import os
    import shutil

    from jaxsys import convert
    from tests.helpers import ROOT

    golden = os.path.join(ROOT, "tests", "golden", "hf_llama")
    root = tmp_path_factory.mktemp("hfgen")
    out = {}
    for name in ("untied", "tied"):
        with_tok = root / f"{name}_hf"
        shutil.copytree(os.path.join(golden, name), with_tok)
        for f in os.listdir(os.path.join(golden, "tokenizer")):
            shutil.copy(os.path.join(golden, "tokenizer", f), with_tok)
        for kind, source in (("ids", os.path.join(golden, name)), ("text", str(with_tok))):
            workdir = str(root / f"{name}_{kind}")
            assert convert.main(["--from-hf", source, "--workdir", workdir]) == 0
            out[name, kind] = workdir
        out[name, "golden"] = os.path.join(golden, name)
    return out


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_converted_model_without_a_tokenizer_takes_and_prints_ids(hf_workdirs, capsys, name):
    """No byte decoding of ids >= 256 (issue 36): the ids of transformers' greedy continuation."""
    import os

    golden = hf_workdirs[name, "golden"]
    prompt = np.load(os.path.join(golden, "greedy_prompts.npy"))[0].tolist()
    want = np.load(os.path.join(golden, "greedy_tokens.npy"))[0].tolist()
    assert max(want + prompt) >= 256
    workdir = hf_workdirs[name, "ids"]
    args = ["--workdir", workdir, "--max-new-tokens", str(len(want))]
    assert generate_cli.main([*args, "--prompt", " ".join(map(str, prompt))]) == 0
    out, err = capsys.readouterr()
    assert out == " ".join(map(str, want)) + "\n" and "no tokenizer" in err
    assert generate_cli.main([*args, "--prompt", "The cat sat"]) == 2
    err = capsys.readouterr().err
    assert (
        "--prompt 'The cat sat' is text" in err
        and f"convert --tokenizer HF_DIR_OR_TOKENIZER_JSON --workdir {workdir}" in err
    )


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_converted_model_with_a_tokenizer_continues_text_as_transformers(hf_workdirs, capsys, name):
    """tests/golden/hf_llama/<name>/text_greedy.json: transformers' greedy continuation of a text
    prompt and of a chat, and its text (decode(prompt + new) after decode(prompt)); jaxsys streams
    the same text through the incremental detokenizer (untied's is mostly invalid byte runs)."""
    import json
    import os

    golden = json.load(open(os.path.join(hf_workdirs[name, "golden"], "text_greedy.json"), encoding="utf-8"))
    args = ["--workdir", hf_workdirs[name, "text"], "--max-new-tokens", "16"]
    assert generate_cli.main([*args, "--prompt", golden["prompt"]]) == 0
    out, err = capsys.readouterr()
    assert out == golden["text"]["new_text"] + "\n"
    assert f"prompt {len(golden['text']['prompt_ids'])} tokens" in err and "huggingface tokenizer" in err
    assert generate_cli.main([*args, "--chat", "--prompt", golden["chat"]["messages"][0]["content"]]) == 0
    out, err = capsys.readouterr()
    assert out == golden["chat"]["new_text"] + "\n"
    assert f"chat prompt {golden['chat']['prompt_text']!r}" in err
    assert f"prompt {len(golden['chat']['prompt_ids'])} tokens" in err
