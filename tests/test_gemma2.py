"""Gemma 2's soft-capping (config.model.attn_logit_softcap, final_logit_softcap) through the
training step: sharded, context-parallel and pipelined runs equal one device's, the caps matter,
and bad settings are refused by name. Conversion and decoding against transformers are in
tests/test_convert.py and tests/test_generate.py (golden `gemma2`); the kernels' caps in
tests/test_softcap_flash.py and tests/test_softcap_paged.py."""

from __future__ import annotations

import numpy as np
import pytest

from jaxsys.config import ConfigError, validate
from tests.helpers import GEMMA2_PIECES, assert_trees_close_leafwise, loss_and_grads, small_config

# fp32 everywhere; sharded runs sum in other orders (the parity tests' tolerances, tests/test_layers.py)
RTOL = 1e-5


def _close(got, want):
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    assert_trees_close_leafwise(got_grads, want_grads, rtol=1e-4, atol=lambda w: 1e-5 * np.abs(w).max())


@pytest.fixture(scope="module")
def one_device():
    """The one-device reference (attention_impl='reference': layers.attention's cap) of the model
    with Gemma 2's pieces and local layers, and of the same model without the caps."""
    kw = dict(GEMMA2_PIECES, n_kv_heads=4, layer_pattern="local,softmax", sliding_window=8)
    uncapped = dict(kw, attn_logit_softcap=0.0, final_logit_softcap=0.0)
    return kw, loss_and_grads(small_config(**kw)), loss_and_grads(small_config(**uncapped))


def test_caps_change_the_loss(one_device):
    """The caps are not a no-op at the test model's scale (else the parity below proves nothing)."""
    _, (capped, _), (uncapped, _) = one_device
    assert abs(capped - uncapped) > 100 * RTOL * abs(capped)


def test_sharded_with_the_pallas_kernel_matches_one_device(one_device):
    """data 2 x fsdp 2 x tensor 2 with sequence parallelism and the flash kernel (its in-kernel cap
    and the cap's derivative in its backward; the logits capped per vocabulary shard)."""
    kw, want, _ = one_device
    sharded = small_config({"data": 2, "fsdp": 2, "tensor": 2}, attention_impl="pallas", **kw)
    sharded.parallel.sequence_parallel = True
    sharded.parallel.vocab_parallel = True
    _close(loss_and_grads(sharded), want)


def test_pipeline_matches_one_device(one_device):
    """pipe 2 x data 2, two micro-batches: the last stage's head caps the logits."""
    kw, _, _ = one_device
    kw = dict(kw, n_layers=4)
    piped = small_config({"pipe": 2, "data": 2}, **kw)
    piped.train.microbatches = 2
    _close(loss_and_grads(piped), loss_and_grads(small_config(**kw)))


@pytest.mark.parametrize(
    "variant,impl", [("ring", "pallas"), pytest.param("allgather", "reference", marks=pytest.mark.slow)]
)
def test_context_parallelism_matches_one_device(variant, impl):
    """Ring attention (flash blocks merged by their lse, the backward per block with the final
    lse) and all-gather CP cap every block's scores: seq 2 x tensor 2 x data 2 equals one device.
    Global layers only: context parallelism refuses sliding windows."""
    kw = dict(GEMMA2_PIECES, n_kv_heads=4)
    cp = small_config({"seq": 2, "tensor": 2, "data": 2}, context_parallel=variant, attention_impl=impl, **kw)
    _close(loss_and_grads(cp), loss_and_grads(small_config(**kw)))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(attn_logit_softcap=-1.0), "attn_logit_softcap=-1.0 must be a number >= 0"),
        (dict(final_logit_softcap=-30.0), "final_logit_softcap=-30.0 must be a number >= 0"),
        (dict(attn_logit_softcap=50.0, attention_impl="cudnn"), "cuDNN's attention has no score soft-capping"),
    ],
)
def test_bad_caps_are_refused_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(small_config(**overrides))


def test_flax_models_refuse_the_caps():
    c = small_config(final_logit_softcap=30.0)
    c.model.kind, c.model.flax_module = "flax", "examples.flax_gpt:GPT"
    with pytest.raises(ConfigError, match="final_logit_softcap=30.0 with config.model.kind='flax'"):
        validate(c)


def test_the_config_file_is_the_released_model():
    """configs/gemma2_2b.py is the model Gemma 2 2B's config.json converts to (tests/test_convert.py
    REAL_CONFIGS), with its published 2,614,341,888 parameters; its :cpu variant validates."""
    from jaxsys.checkpoint import hf
    from jaxsys.config import load_config
    from jaxsys.models import params, transformer
    from tests.helpers import ROOT
    from tests.test_convert import REAL_CONFIGS

    ours = load_config(f"{ROOT}/configs/gemma2_2b.py")
    converted = load_config(f"{ROOT}/configs/gemma2_2b.py")
    hf.model_config_from_hf(REAL_CONFIGS["gemma-2-2b"][0], converted.model)
    mine = ours.model.to_dict()
    differ = {k for k, v in converted.model.to_dict().items() if mine[k] != v}
    assert differ <= {"compute_dtype", "remat", "attention_impl"}, differ  # training choices, not the model
    assert params.count(transformer.param_specs(ours.model)) == 2_614_341_888
    validate(ours)
    validate(load_config(f"{ROOT}/configs/gemma2_2b.py:cpu"))
