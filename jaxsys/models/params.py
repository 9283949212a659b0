"""Parameter descriptions: shape, logical axes, initialiser. A model is a pytree of `ParamSpec`s;
shardings, abstract shapes and initial values are all derived from it."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # one logical name per dimension
    init: str = "normal"  # "normal" (std), "ones", "zeros"; "flax": the Flax module's own (flax_model.py)
    std: float = 0.02
    decay: bool = True  # AdamW weight decay applies
    dtype: str | None = None  # None: the model's param_dtype; quantized codes and scales set their own
    # logical axes its use contracts away that are not its own (a LoRA factor's: models/lora.py): where
    # they are split (tensor parallelism), each rank's gradient is a partial sum, added by zero.plan
    partial: tuple[str, ...] = ()

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def init_params(specs, key, dtype):
    """Initial values of every leaf; leaf i draws from fold_in(key, i), so values do not depend on
    how the arrays are sharded (jit this with out_shardings to create them in place)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    values = []
    for i, spec in enumerate(leaves):
        leaf_dtype = spec.dtype or dtype
        if spec.init == "flax":
            raise ValueError(
                "a Flax model's parameters are initialised by the module itself: jaxsys.models.flax_model.init_params"
            )
        if spec.init == "ones":
            values.append(jnp.ones(spec.shape, leaf_dtype))
        elif spec.init == "zeros":
            values.append(jnp.zeros(spec.shape, leaf_dtype))
        else:
            draw = jax.random.normal(jax.random.fold_in(key, i), spec.shape, jnp.float32)
            values.append((draw * spec.std).astype(leaf_dtype))
    return jax.tree.unflatten(treedef, values)


def abstract_params(specs, dtype):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype or dtype), specs, is_leaf=is_spec)


def count(specs) -> int:
    # Python ints: a leaf of a large MoE ([L, E, D, F]) has more than 2^31 elements
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))
