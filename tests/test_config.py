"""Bad configs fail before anything compiles, with a message that names the key and the fix."""

import os
import subprocess
import sys

import pytest

from jaxsys import data, train
from jaxsys.config import ConfigError, apply_overrides, load_config, validate
from jaxsys.mesh import make_mesh
from tests.helpers import ROOT, small_config


@pytest.fixture
def no_compile(monkeypatch):
    """Fail the test if main() gets as far as building the step."""

    def refuse(*_):
        raise AssertionError("the error should have been raised before building the program")

    monkeypatch.setattr(train, "build", refuse)


def test_mesh_product_must_equal_device_count():
    c = small_config(dict(data=2, tensor=2))
    with pytest.raises(ConfigError, match=r"config.mesh \(data=2 x tensor=2\) has 4 devices but 8 are available"):
        make_mesh(c)


def test_heads_not_divisible_by_tensor():
    c = small_config(dict(tensor=8), n_heads=12, n_kv_heads=4)
    with pytest.raises(ConfigError, match=r"config.model.n_heads=12 is not divisible by the 8 shards"):
        validate(c)


def test_batch_not_divisible_by_batch_shards():
    c = small_config(dict(data=8))
    c.train.batch_size = 12
    with pytest.raises(ConfigError, match=r"config.train.batch_size=12 is not divisible by the 8"):
        validate(c)


def test_unknown_override_key_suggests_the_right_one():
    c = small_config()
    with pytest.raises(ConfigError, match=r"unknown config key 'config.train.stepz'.*train.steps"):
        apply_overrides(c, ["--config.train.stepz=3"])
    # a name other frameworks (and issue 35) use for fp8 training points at jaxsys's key
    with pytest.raises(ConfigError, match=r"'config.model.matmul_dtype'\. Did you mean model.quant_train \('fp8'"):
        apply_overrides(c, ["--config.model.matmul_dtype=fp8"])


def test_override_type_is_checked():
    with pytest.raises(ConfigError, match=r"config.train.steps expects a int"):
        apply_overrides(small_config(), ["--config.train.steps=ten"])


def test_overrides_apply():
    c = small_config()
    apply_overrides(
        c,
        [
            "--config.train.steps=7",
            "--config.model.tie_embeddings=true",
            "--config.train.lr=1",
            "--config.data.source=text",
        ],
    )
    assert (c.train.steps, c.model.tie_embeddings, c.train.lr, c.data.source) == (7, True, 1.0, "text")


def test_unknown_key_in_config_file(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(
        "from jaxsys.config import base_config\n"
        "def get_config(arg=None):\n    c = base_config()\n    c.model.n_layer = 3\n    return c\n"
    )
    with pytest.raises(ConfigError, match=r"'config.model.n_layer'.*model.n_layers"):
        load_config(str(path))


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.py")


def test_missing_data_file(tmp_path, no_compile):
    c = small_config()
    c.data.source, c.data.path = "tokens", str(tmp_path / "missing.npy")
    with pytest.raises(data.DataError, match=r"missing.npy.*config.data.path|config.data.path.*missing.npy"):
        train.main(c, str(tmp_path / "run"))


def test_empty_corpus(tmp_path, no_compile):
    (tmp_path / "empty.txt").write_text("")
    c = small_config()
    c.data.source, c.data.path = "text", str(tmp_path / "empty.txt")
    with pytest.raises(data.DataError, match="empty"):
        train.main(c, str(tmp_path / "run"))


def test_wrong_mesh_fails_in_main_before_compiling(tmp_path, no_compile):
    with pytest.raises(ConfigError, match="8 are available"):
        train.main(small_config(dict(data=4)), str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_cli_reports_config_errors_without_traceback(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxsys.train",
            "--config",
            "configs/tiny.py:test",
            "--workdir",
            str(tmp_path),
            "--config.mesh.tensr=2",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "config.mesh.tensr" in result.stderr and "mesh.tensor" in result.stderr
    assert "Traceback" not in result.stderr


def test_batch_axis_must_split_the_batch():
    c = small_config(dict(fsdp=8))
    c.sharding.compute.batch = "data"
    with pytest.raises(ConfigError, match=r"config.mesh.fsdp=8 but 'fsdp' is not in config.sharding.compute.batch"):
        validate(c)


def test_rule_naming_an_unsupported_axis():
    c = small_config()
    c.sharding.params.mlp = "fsdp"
    with pytest.raises(ConfigError, match=r"config.sharding.params.mlp='fsdp'.*allowed"):
        validate(c)
