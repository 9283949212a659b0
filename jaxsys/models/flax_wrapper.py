"""jaxsys's transformer as a Flax NNX module, to compose inside Flax code (docs/flax.md).

    from flax import nnx
    from jaxsys.config import base_config
    from jaxsys.models.flax_wrapper import JaxsysTransformer

    lm = JaxsysTransformer(base_config().model, rngs=nnx.Rngs(0))
    logits = lm(tokens)                       # tokens[B, T] -> logits[B, T, V]

The module holds the parameters of `transformer.param_specs(config.model)` as `nnx.Param`s (in
`lm.params`, the same nested names as jaxsys's parameter tree: `embed`, `layers/wq`, ...), each
with its logical axis names as Flax partitioning metadata (`out_sharding`), so Flax's own
sharding tools (`nnx.get_partition_spec`, logical axis rules) see jaxsys's names. The forward is
`transformer.logits` on the one-device layout (no collectives): the same function, and so the
same logits, as the functional model on one device. Under `jax.jit` with sharded inputs XLA's
partitioner (GSPMD) distributes it like any Flax module; jaxsys's own layouts (the explicit
collectives of jaxsys.parallel) are for the functional model in `jaxsys.train`.

`to_params()` gives the functional parameter tree (for `jaxsys.checkpoint` or the train step), and
`from_params(config.model, params)` wraps a trained one.
"""

from __future__ import annotations

import copy

import jax.numpy as jnp
import ml_collections
from flax import nnx

from jaxsys.config import MESH_AXES
from jaxsys.models import params as params_lib
from jaxsys.models import transformer
from jaxsys.sharding import Layout


def one_device_layout() -> Layout:
    """Every mesh axis of size 1: no rule splits anything, no collective runs."""
    return Layout({a: 1 for a in MESH_AXES}, {}, {})


def _to_variables(values, specs):
    if isinstance(specs, dict):
        return nnx.Dict({k: _to_variables(values[k], specs[k]) for k in specs})
    # eager_sharding off: jaxsys's logical names are not mesh axes (Flax would place the array now)
    return nnx.Param(values, out_sharding=specs.axes, eager_sharding=False)


def _to_values(node):
    if isinstance(node, (dict, nnx.Dict)):
        return {k: _to_values(node[k]) for k in node.keys()}
    return node[...]


class JaxsysTransformer(nnx.Module):
    """jaxsys's decoder-only transformer (models/transformer.py) of `model_config`
    (a config.model ConfigDict, e.g. `base_config().model` or `load_config(...).model`)."""

    def __init__(self, model_config, *, rngs: nnx.Rngs | None = None, params=None):
        m = copy.deepcopy(model_config)
        if m.get("kind", "jaxsys") != "jaxsys":
            raise ValueError(f"JaxsysTransformer wraps jaxsys's own transformer, not config.model.kind={m.kind!r}")
        if m.quant != "none":
            raise ValueError(
                f"config.model.quant={m.quant!r}: wrap a float model (the quantized leaves are "
                "inference codes, not parameters)"
            )
        self.model_config = (
            nnx.static(ml_collections.FrozenConfigDict(m))
            if hasattr(nnx, "static")
            else ml_collections.FrozenConfigDict(m)
        )
        specs = transformer.param_specs(m)
        if params is None:
            if rngs is None:
                raise ValueError("JaxsysTransformer needs rngs=nnx.Rngs(seed) (or params=)")
            params = params_lib.init_params(specs, rngs.params(), jnp.dtype(m.param_dtype))
        self.params = _to_variables(params, specs)

    @classmethod
    def from_params(cls, model_config, params) -> "JaxsysTransformer":
        """Wrap a functional parameter tree (e.g. restored from a jaxsys checkpoint)."""
        return cls(model_config, params=params)

    def to_params(self) -> dict:
        """The functional parameter tree of `transformer` (arrays, jaxsys's names)."""
        return _to_values(self.params)

    def __call__(self, tokens, positions=None):
        """tokens[B, T] -> logits[B, T, V] (float32 of the compute dtype's matmuls)."""
        m = self.model_config
        return transformer.logits(self.to_params(), tokens, m, one_device_layout(), positions=positions)
