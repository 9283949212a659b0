"""The one table of hardware facts (jaxsys/analysis/hardware.py): a JAX device finds its profile by
device_kind; training's MFU and the roofline divide by the same peak for the same device and dtype;
a TPU target and the named profile of its chip hold the same figures."""

import dataclasses

import pytest

from jaxsys.analysis import cost_model, flops, hardware, targets
from tests.helpers import small_config


@dataclasses.dataclass
class FakeDevice:
    platform: str
    device_kind: str


@pytest.mark.parametrize(
    "platform, kind, name",
    [
        ("gpu", "NVIDIA H100 80GB HBM3", "h100"),
        ("gpu", "NVIDIA H200", "h200"),
        ("tpu", "TPU v4", "tpu_v4"),
        ("tpu", "TPU v5 lite", "tpu_v5e"),
        ("tpu", "TPU v5", "tpu_v5p"),
        ("tpu", "TPU v5p", "tpu_v5p"),
        ("tpu", "TPU v6 lite", "tpu_v6e"),
        ("cpu", "cpu", "cpu"),
        ("gpu", "NVIDIA A10", None),
    ],
)
def test_a_device_finds_its_profile_by_device_kind(platform, kind, name):
    assert hardware.profile_name(FakeDevice(platform, kind)) == name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_training_mfu_and_the_roofline_divide_by_the_same_peak(dtype):
    """8 H100s: the training loop's job peak equals the roofline's (Hardware.job_peak); float32 is
    the TF32 tensor-core rate, what JAX's default precision runs a float32 dot at."""
    devices = [FakeDevice("gpu", "NVIDIA H100 80GB HBM3")] * 8
    hw = hardware.profile("h100")
    assert hardware.job_peak_flops(dtype, devices) == hw.job_peak(dtype, 8)
    assert hw.peak("float32") == 495e12 and hw.peak("bfloat16") == 989e12
    c = small_config(dict(data=8))
    c.model.compute_dtype = dtype
    roof = cost_model.roofline(c, hw, 1e12, 0.0, {})
    model_flops = flops.train_flops_per_token(c.model, c.data.seq_len) * c.train.batch_size * c.data.seq_len
    training_mfu = model_flops / roof["step_s_serial"] / hardware.job_peak_flops(dtype, devices)
    assert roof["mfu_serial"] == pytest.approx(training_mfu, rel=1e-12)


def test_a_tpu_target_and_its_chips_profile_hold_the_same_figures():
    chip = hardware.TPU_CHIPS["v5p"]
    for hw in (hardware.profile("tpu_v5p"), targets.hardware(targets.parse("v5p-256"))):
        assert hw.peak_flops == chip.peak_flops and hw.hbm_bytes == chip.hbm_bytes
        assert hw.hbm_bytes_per_s == chip.hbm_bytes_per_s
        assert (hw.intra_node_bytes_per_s, hw.inter_node_bytes_per_s) == (2 * chip.ici_link_bytes_per_s, 6.25e9)
        assert hw.async_collectives == ("collective_permute",)
    assert targets.hardware(targets.parse("v5p-256")).devices_per_node == 128  # one slice of 128 chips
    assert targets.hardware(targets.parse("v5e-8")).async_collectives == ("all_gather", "collective_permute")
    assert targets.hardware(targets.parse("h100-16")) == hardware.profile("h100")
