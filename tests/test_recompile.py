"""A freshly built step compiles once: its second call hits the jit cache. In a fresh process the
first trace must not change JAX's trace context, which is part of the jit cache key. Importing the
Pallas kernels inside a step's trace did that (jax.experimental.pallas.tpu defines the config state
pallas_fuser_disable_nested_fuse, one more entry in the key; models/attention.py imported the
flash-attention module in its functions): the second call compiled again. That needs a process
where nothing has imported the kernels yet, so the check runs in a subprocess (about 8 s)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT, subprocess_env

_SCRIPT = """
import jax
import numpy as np
from jax._src import config as jax_config

from tests.helpers import program_for, small_config

# context parallelism on 2 devices (its blocks call the flash-attention module's reference), small;
# the forward (eval loss) is the cheapest step that traces it
c = small_config({"seq": 2}, context_parallel="ring", n_layers=1)
c.train.batch_size = 2
program = program_for(c)
put = lambda s: jax.device_put(np.ones(s.shape, s.dtype), s.sharding)
params, batch = jax.tree.map(put, program.abstract_state().params), jax.tree.map(put, program.abstract_batch())
loss = program.eval_loss_fn()
before = jax_config.trace_context()
for _ in range(2):
    jax.block_until_ready(loss(params, batch))
after = jax_config.trace_context()
print("trace context entries", len(before), len(after), "compiled", loss._cache_size())
assert len(after) == len(before), "the first trace changed JAX's trace context"
assert loss._cache_size() == 1, "the second call compiled again"
"""


def test_the_second_call_of_a_fresh_step_compiles_nothing():
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, env=subprocess_env(2), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
