"""Execution policies: how the model's layers run, applied around the layer, not inside it (the
way torchtitan keeps `parallelize_*` apart from the model). The model (jaxsys/models/transformer.py)
says what a layer computes; `stack.run_layers` runs a stack of them and applies, in one place:

    weights as used     offload.fetch (config.offload.params) -> zeroth-order hook -> compute dtype
                        -> FSDP all-gather                              stack.weights_as_used
    remat               jax.checkpoint with config.model.remat's policy  remat.py
    activation offload  layer inputs and named residuals to host memory  parallel/offload.py
    FSDP prefetch       layer i+1 gathered during layer i, the delayed
                        gradient reduce-scatter                          parallel/fsdp_prefetch.py
    ladder residual     the stream the scan carries                      models/ladder.py
    KV caches           the per-layer arrays scanned beside the weights  jaxsys/cache/
"""

from jaxsys.execution.remat import remat_policy
from jaxsys.execution.stack import run_layers, weights_as_used

__all__ = ["remat_policy", "run_layers", "weights_as_used"]
