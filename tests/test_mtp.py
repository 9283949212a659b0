"""Multi-token prediction (config.model.mtp, models/mtp.py; DeepSeek-V3 section 2.2).

The reference restates the objective in plain jnp from the model's pieces: the main model's last
hidden state (transformer.layer_stack), the embedding rows looked up by hand, RMSNorm and the
[2D -> D] projection written out, the module's layer run as a one-layer model, the output head
and a log-softmax cross-entropy by hand, the targets shifted in NumPy. Tolerances: fp32, the same
sums in other orders (rtol 1e-5); sharded runs as tests/test_mla.py's.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import data, train
from jaxsys.config import ConfigError, validate
from jaxsys.models import mtp, transformer
from tests.helpers import assert_trees_close_leafwise, loss_and_grads, program_for, small_config

MODEL = dict(n_kv_heads=4)


def _config(mesh=None, depth=2, weight=0.3, **model):
    c = small_config(mesh, **dict(MODEL, **model))
    c.model.mtp.depth, c.model.mtp.loss_weight = depth, weight
    return c


def _rms(x, g, eps):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * g


def _ce(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]


def _reference_objective(config, params, tokens):
    """Main mean CE + lambda / D_m sum_k (sum over positions with a target of CE_k) / (B T)."""
    m, program = config.model, program_for(config)
    layout, specs = program.layout, program.specs
    B, T = tokens.shape[0], tokens.shape[1] - 1
    positions = jnp.arange(T)
    h = transformer.layer_stack(params["layers"], params["embed"][tokens[:, :-1]], positions, m, layout, specs)[0]
    unembed = params["unembed"]
    head = lambda x, g: _rms(x, g, m.norm_eps) @ unembed
    main = jnp.mean(_ce(head(h, params["final_norm"]), tokens[:, 1:]))
    w, mk, total = params["mtp"], mtp.layer_config(m, 1), 0.0
    for k in range(1, m.mtp.depth + 1):
        ids = np.zeros((B, T), np.int32)
        ids[:, : T + 1 - k] = np.asarray(tokens)[:, k:]
        e = params["embed"][ids]
        x = _rms(e, w["enorm"][k - 1], m.norm_eps) @ w["proj"][k - 1, 0]
        x = x + _rms(h, w["hnorm"][k - 1], m.norm_eps) @ w["proj"][k - 1, 1]
        one = jax.tree.map(lambda a: a[k - 1 : k], w["layers"])
        h = transformer.layer_stack(one, x, positions, mk, layout, {"layers": specs["mtp"]["layers"]})[0]
        valid = T - k  # positions 0 .. T-k-1 have targets t_{i+k+1}
        targets = jnp.asarray(np.asarray(tokens)[:, k + 1 :])
        ce = _ce(head(h[:, :valid], w["norm"][k - 1]), targets)
        total = total + jnp.sum(ce) / (B * T)
    return float(main + m.mtp.loss_weight * total / m.mtp.depth)


@pytest.fixture(scope="module")
def one_device():
    c = _config()
    return c, loss_and_grads(c)


def test_objective_equals_the_restated_reference(one_device):
    c, (loss, grads) = one_device
    program = program_for(c)
    params = jax.tree.map(np.asarray, program.init().params)
    corpus = data.load_corpus(c.data)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tokens = np.asarray(data.global_batch(corpus, sharding, c.seed, 0, c.train.batch_size, c.data.seq_len))
    want = _reference_objective(c, params, jnp.asarray(tokens))
    assert loss == pytest.approx(want, rel=1e-5)
    # transformer.mtp_logits (what experiments/mtp measures acceptance with) gives the same objective
    main, modules = transformer.mtp_logits(params, jnp.asarray(tokens), c.model, program.layout, program.specs)
    B, T = tokens.shape[0], tokens.shape[1] - 1
    total = float(jnp.mean(_ce(main, jnp.asarray(tokens[:, 1:]))))
    for k in range(c.model.mtp.depth):
        total += 0.3 / c.model.mtp.depth * float(jnp.sum(_ce(modules[k, :, : T - k - 1], tokens[:, k + 2 :]))) / (B * T)
    assert total == pytest.approx(want, rel=1e-5)
    # every module's leaf learns, and its loss is a real term: lambda = 0 leaves only the main one
    assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads["mtp"]))
    plain = _reference_objective(_config(weight=0.0), params, jnp.asarray(tokens))
    assert loss - plain > 0.3 * 0.9 * np.log(c.model.vocab_size)  # lambda x ~ln V at init


def test_sharded_equals_one_device(one_device):
    """fsdp x tensor x data with sequence parallelism: the modules' embedding lookups and layers run
    on the sequence shards, the projection is replicated over tensor."""
    _, want = one_device
    c = _config({"fsdp": 2, "tensor": 2, "data": 2})
    c.parallel.sequence_parallel = True
    got = loss_and_grads(c)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert_trees_close_leafwise(got[1], want[1], rtol=1e-4, atol=lambda w: 1e-5 * np.abs(w).max())


def test_chain_weights_need_every_target_on_the_way():
    w = jnp.asarray([[1, 1, 1, 0, 1, 1, 1, 1]], jnp.float32)  # position 3's target is padding / a new document
    np.testing.assert_array_equal(mtp.chain_weights(w, 1), [[1, 1, 0, 0, 1, 1, 1, 0]])
    np.testing.assert_array_equal(mtp.chain_weights(w, 2), [[1, 0, 0, 0, 1, 1, 0, 0]])
    np.testing.assert_array_equal(mtp.shifted(jnp.arange(6)[None], 2, 5), [[2, 3, 4, 5, 0]])


def test_moe_model_runs_its_module_as_a_moe_layer():
    """DeepSeek-V3's modules are MoE layers when the main model's last layer is: the module holds
    experts and its balance losses join the main ones."""
    c = _config(depth=1, mlp_pattern="dense,moe")
    c.model.moe.experts, c.model.moe.top_k = 4, 2
    validate(c)
    program = program_for(c)
    shapes = jax.tree.map(lambda a: a.shape, program.abstract_state().params["mtp"]["layers"])
    assert "moe" in shapes and "w_gate" not in shapes
    loss, grads = loss_and_grads(c)
    assert np.isfinite(loss) and np.abs(grads["mtp"]["layers"]["moe"]["router"]).max() > 0


def test_training_logs_the_modules_loss_and_lowers_it(tmp_path):
    c = _config({"data": 8}, depth=1)
    c.train.steps, c.train.eval_every, c.train.log_every = 30, 0, 1
    c.checkpoint.async_save = False
    train.main(c, str(tmp_path))
    records = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    losses = [r["mtp_loss"] for r in records if "mtp_loss" in r]
    assert len(losses) >= 20 and losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize(
    "setting, match",
    [
        (dict(depth=-1), "mtp.depth=-1 must be an integer >= 0"),
        (dict(weight=-0.1), "loss_weight=-0.1 must be a number >= 0"),
        (dict(mesh={"pipe": 2}), "config.mesh.pipe=2"),
        (dict(mesh={"seq": 2}), "context parallelism splits the sequence"),
        (dict(optimizer="zo"), "optimizer='zo'"),
    ],
)
def test_bad_settings_are_refused_by_name(setting, match):
    setting = dict(setting)
    optimizer = setting.pop("optimizer", None)
    c = _config(**setting)
    if optimizer:
        c.train.optimizer = optimizer
    with pytest.raises(ConfigError, match=match):
        validate(c)


def test_deepseek_v3_checkpoints_carry_the_modules_both_ways(tmp_path, capsys):
    """The golden DeepSeek-V3 (transformers' random model: config.json says one MTP layer, the
    safetensors, saved by transformers, hold none) converts without modules, and says so. The same
    model with a module written out in V3's layout (layer n: enorm, hnorm, eh_proj [D, 2D],
    shared_head, copies of the embedding and head, an MLA + MoE layer) converts back to the same
    parameters, and config.json names it."""
    import shutil

    from safetensors.numpy import save_file

    from jaxsys.checkpoint import hf as hf_lib

    golden = os.path.join(os.path.dirname(__file__), "golden", "hf_llama", "deepseek_v3")
    config = hf_lib.from_hf(golden, str(tmp_path / "plain"))
    assert config.model.mtp.depth == 0 and "converted without" in capsys.readouterr().err
    config.model.mtp.depth = 1
    m = config.model
    program = program_for(config)
    params = jax.tree.map(np.asarray, program.init(7).params)
    tensors = hf_lib.hf_tensors_from_params(params, m, np.float32)
    n, D = m.n_layers, m.d_model
    assert tensors[f"model.layers.{n}.eh_proj.weight"].shape == (D, 2 * D)
    np.testing.assert_array_equal(tensors[f"model.layers.{n}.eh_proj.weight"][:, :D], params["mtp"]["proj"][0, 0].T)
    np.testing.assert_array_equal(tensors[f"model.layers.{n}.shared_head.head.weight"], tensors["lm_head.weight"])
    assert f"model.layers.{n}.mlp.experts.0.gate_proj.weight" in tensors  # the last kind: a MoE layer
    assert f"model.layers.{n}.self_attn.kv_a_proj_with_mqa.weight" in tensors
    hf_dir = tmp_path / "with_mtp"
    shutil.copytree(golden, hf_dir)
    os.remove(hf_dir / "model.safetensors")
    save_file(tensors, str(hf_dir / "model.safetensors"))
    hf = hf_lib.hf_config_from_model(m, "float32")
    assert hf["num_nextn_predict_layers"] == 1
    back = hf_lib.from_hf(str(hf_dir), str(tmp_path / "back"))
    assert back.model.mtp.depth == 1
    _, restored, _ = __import__("jaxsys.checkpoint", fromlist=["load"]).load(
        str(tmp_path / "back"), ("--config.mesh.data=1",), None, jax.devices()[:1]
    )
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(jax.tree.map(np.asarray, restored["mtp"]))[0],
        jax.tree.leaves(params["mtp"]),
    ):
        np.testing.assert_allclose(got, want, rtol=0, atol=0, err_msg=jax.tree_util.keystr(path))
