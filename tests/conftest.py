"""8 simulated CPU devices for every test, compiled fast (tests/xla_flags.py); set before JAX starts."""

import os

from tests.xla_flags import xla_flags

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
