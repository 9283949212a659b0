"""Rematerialisation (activation checkpointing) policy of a layer: config.model.remat.

    none   save everything but the FSDP-gathered weights (always gathered again backward)
    dots   save matmul outputs only
    full   save nothing inside a layer

The activations named in config.offload.activations are saved to host memory instead
(parallel/offload.py's policy around these).
"""

from __future__ import annotations

import jax

from jaxsys.parallel import fsdp, offload


def remat_policy(name: str, offloaded: tuple[str, ...] = ()):
    policies = jax.checkpoint_policies
    if name == "full":
        base = policies.nothing_saveable
    elif name == "dots":
        base = policies.dots_saveable
    else:
        base = fsdp.remat_saveable
    return offload.remat_policy(base, offloaded)
