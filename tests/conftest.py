"""8 simulated CPU devices for every test, compiled fast (tests/xla_flags.py); set before JAX starts.
The tests are one process each (the multi-process ones set their own environments): a SLURM job
that runs the suite must not make `jaxsys.train` join its tasks (jaxsys/mesh.py detects srun)."""

import os

from tests.xla_flags import xla_flags

for _key in [k for k in os.environ if k.startswith("SLURM_")]:
    del os.environ[_key]

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
