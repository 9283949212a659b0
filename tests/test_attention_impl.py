"""The model with its attention from the Pallas kernels (interpret mode on CPU) equals the model
with the pure-JAX reference attention, inside the training shard_map with heads over `tensor`.

Tolerance: the kernels sum the softmax / linear-attention terms in blocks and chunks, the reference
all at once, so fp32 results differ by rounding (seen: ~1e-6 relative on the losses, ~2e-7 absolute
on the gradients); a wrong mask, decay or head mapping moves them by >1e-3.
"""

import chex
import numpy as np
import pytest

from jaxsys.config import ConfigError
from tests.helpers import program_for, run, small_config


def _config(mesh, impl):
    # one linear-attention layer and one softmax layer; blocks/chunks smaller than T=32
    return small_config(
        mesh, layer_pattern="linear,softmax", n_kv_heads=4, attention_impl=impl, attention_block=16, linear_chunk=16
    )


@pytest.mark.slow
def test_pallas_model_matches_reference_on_data2_tensor4():
    ref_loss0, ref_grads, ref_losses, _ = run(_config({}, "reference"), steps=2)
    loss0, grads, losses, _ = run(_config(dict(data=2, tensor=4), "pallas"), steps=2)
    np.testing.assert_allclose(loss0, ref_loss0, rtol=1e-5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-6)


def test_linear_layers_change_the_model():
    """The pattern really switches the layer type (the parity above would hold for any pattern)."""
    softmax, _, _, _ = run(small_config({}, layer_pattern="softmax"), steps=0)
    hybrid, _, _, _ = run(small_config({}, layer_pattern="linear,softmax", linear_chunk=16), steps=0)
    assert abs(softmax - hybrid) > 1e-4


def test_bad_attention_settings_are_named():
    with pytest.raises(ConfigError, match="attention_impl='cudnn' needs NVIDIA GPUs"):
        program_for(small_config({}, attention_impl="cudnn"))
    with pytest.raises(ConfigError, match="n_layers=2 is not a multiple of the 3 layers"):
        program_for(small_config({}, layer_pattern="linear,linear,softmax"))
    with pytest.raises(ConfigError, match="layer_pattern='mamba'"):
        program_for(small_config({}, layer_pattern="mamba"))
    with pytest.raises(ValueError, match="head dim H=320 is not supported"):  # beyond the largest it pads to
        c = small_config({}, attention_impl="pallas", head_dim=320)
        run(c, steps=0)


def test_attention_kernel_is_handed_to_the_flash_kernel():
    ref_loss, _, _, _ = run(small_config({}, n_kv_heads=4), steps=0)
    loss, _, _, _ = run(small_config({}, n_kv_heads=4, attention_impl="pallas", attention_kernel="generic"), steps=0)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    with pytest.raises(ValueError, match="mosaic_gpu"):  # the kernel's own refusal: H = 16 is not a Hopper tile
        run(small_config({}, attention_impl="pallas", attention_kernel="mosaic_gpu"), steps=0)
    with pytest.raises(ConfigError, match="attention_kernel='triton'"):
        program_for(small_config({}, attention_impl="pallas", attention_kernel="triton"))
    with pytest.raises(ConfigError, match="needs config.model.attention_impl='pallas'"):
        program_for(small_config({}, attention_kernel="generic"))


def test_default_attention_block_takes_the_kernels_own_tiles():
    """config.model.attention_block = 0 (the default) hands the kernel None: the tuning cache's tile,
    else 128 clamped to T; the loss is the reference's."""
    ref_loss, _, _, _ = run(small_config({}, n_kv_heads=4), steps=0)
    loss, _, _, _ = run(small_config({}, n_kv_heads=4, attention_impl="pallas"), steps=0)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
