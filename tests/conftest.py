"""8 simulated CPU devices for every test, compiled fast (tests/xla_flags.py); set before JAX starts.
The tests are one process each (the multi-process ones set their own environments): a SLURM job
that runs the suite must not make `jaxsys.train` join its tasks (jaxsys/mesh.py detects srun).
The compile cache is off unless a test names its folder (below)."""

import os

from tests.xla_flags import xla_flags

for _key in [k for k in os.environ if k.startswith("SLURM_")]:
    del os.environ[_key]

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compile cache off for the suite ("auto" resolves to no folder): the tests' many
# configs would fill ~/.cache/jaxsys/xla, and with `pytest -n 2` two workers would write and read the
# same entries at once (JAX writes them without a lock or an atomic rename). A test of the cache
# gives its own folder (tests/test_goodput.py).
os.environ["JAXSYS_COMPILE_CACHE"] = ""

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
