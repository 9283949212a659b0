"""Bring your own Flax NNX model: `config.model.kind = "flax"` (docs/flax.md).

    c.model.kind = "flax"
    c.model.flax_module = "examples.flax_gpt:GPT"       # package.module:ClassName
    c.model.flax_kwargs = ml_collections.ConfigDict(dict(vocab_size=256, d_model=128, ...))

The class is built as `ClassName(**flax_kwargs, rngs=nnx.Rngs(key))` and called as
`model(tokens[B, T]) -> logits[B, T, V]` (V = config.model.vocab_size). jaxsys holds the model's
`nnx.Param`s as a plain nested dict of arrays (nnx.split -> State -> pure dict, keys as strings),
so the training state, its shardings, the optimizer, checkpoints and the analysis are those of
any jaxsys model; the forward merges the graph definition with the parameters again
(`nnx.merge`).

Every parameter's logical axis names come from Flax's partitioning metadata
(`nnx.with_partitioning(init, ("embed", "mlp"))`, `nnx.Param(value, out_sharding=(...))`) and
map through jaxsys's rules table (config.sharding): a name the table does not know is a
ConfigError listing the known ones, raised before anything compiles. A parameter without
metadata is replicated. Inside the training shard_map the parameters are moved in from host
memory (config.offload.params), cast to config.model.compute_dtype and all-gathered over the
FSDP axes (`jaxsys.parallel.fsdp.gather`), all of them before the forward; the model then runs on
this shard's batch. So data parallelism, ZeRO 1-2 and FSDP need no change to the model. Tensor,
sequence, pipeline and expert parallelism would need the model to call jaxsys.parallel's ops on
local shards; `config.validate` refuses those mesh axes for Flax models.

Flax is imported here only, and this module only when a config asks for kind="flax".
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp

from jaxsys.config import ConfigError, axes_of
from jaxsys.models.params import ParamSpec, is_spec
from jaxsys.parallel import fsdp, offload, tensor
from jaxsys.sharding import Layout

FLAX_INIT = "flax"  # ParamSpec.init of a Flax parameter: the module's own initialiser makes it
# logical names that name activations only: a parameter may not use them
ACTIVATION_ONLY = ("batch", "seq")


def is_flax(m) -> bool:
    """Whether `config.model` is a Flax model (kind="flax")."""
    return m.get("kind", "jaxsys") == "flax"


# ----------------------------------------------------------------------------- loading the class


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not name.startswith(e.name):
            raise  # the module exists but one of its own imports is missing
    # not on sys.path: a file of that dotted path under the working directory or this checkout
    # (examples/ is not installed with the package)
    for root in dict.fromkeys((os.getcwd(), _REPO)):
        path = os.path.join(root, *name.split(".")) + ".py"
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            return module
    raise ConfigError(
        f"config.model.flax_module: module {name!r} cannot be imported (not on sys.path, "
        f"and no {name.replace('.', '/')}.py under {os.getcwd()} or {_REPO})"
    )


def load_class(path: str):
    """'package.module:ClassName' -> the class."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"config.model.flax_module={path!r}: give 'package.module:ClassName'")
    module = _import_module(module_name)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"config.model.flax_module={path!r}: {module_name} has no {attr!r}")
        obj = getattr(obj, part)
    from flax import nnx

    if not (isinstance(obj, type) and issubclass(obj, nnx.Module)):
        raise ConfigError(
            f"config.model.flax_module={path!r} is not an nnx.Module class (Flax NNX; a "
            "Linen module can be wrapped with flax.nnx.bridge.ToNNX in an NNX class)"
        )
    return obj


# ----------------------------------------------------------------------------- the abstract model


def _kwargs(m) -> dict:
    kwargs = m.flax_kwargs
    return kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs)


def _str_keys(tree):
    """A pure dict of a State (int keys for the entries of lists) with every key a string."""
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _own_keys(tree, template):
    """`_str_keys` undone, by the keys of `template` (the State's own pure dict)."""
    if isinstance(template, dict):
        return {k: _own_keys(tree[str(k)], v) for k, v in template.items()}
    return tree


@dataclasses.dataclass(frozen=True)
class FlaxModel:
    """What jaxsys needs of a Flax class: how to build and call it, and its parameters' shapes
    and logical axes (from an abstract instance; nothing is allocated)."""

    cls: Any
    kwargs: dict
    graphdef: Any  # nnx.GraphDef of the module
    template: dict  # the parameters' pure dict (Flax's own keys) of ShapeDtypeStructs
    specs: dict  # jaxsys's parameter tree (string keys) of ParamSpecs

    @property
    def abstract_params(self) -> dict:
        """The parameters as jaxsys holds them (string keys), as ShapeDtypeStructs."""
        return _str_keys(self.template)

    def build(self, key):
        return self.cls(**self.kwargs, rngs=_nnx().Rngs(key))

    def params_of(self, module) -> dict:
        """A module's nnx.Params as jaxsys holds them: a nested dict of arrays, string keys."""
        nnx = _nnx()
        _, params, _ = nnx.split(module, nnx.Param, ...)
        return _str_keys(nnx.to_pure_dict(params))

    def merge(self, params):
        """The module with `params` (jaxsys's dict) as its nnx.Params."""
        return _nnx().merge(self.graphdef, _own_keys(params, self.template))


def _nnx():
    from flax import nnx

    return nnx


_MODELS: dict = {}


def _leaf_axes(path: str, variable, shape) -> tuple[str | None, ...]:
    names = variable.get_metadata().get("out_sharding")
    if not names:
        return (None,) * len(shape)
    names = tuple(names)
    if len(names) != len(shape):
        raise ConfigError(
            f"Flax parameter {path} has shape {tuple(shape)} but {len(names)} logical axis "
            f"names {names}: give one name (or None) per dimension"
        )
    for name in names:
        if name is not None and not isinstance(name, str):
            raise ConfigError(
                f"Flax parameter {path}: logical axis names {names} must be strings or None, "
                "one per dimension (jaxsys maps each name to mesh axes by config.sharding)"
            )
    return names


def describe(m) -> FlaxModel:
    """The FlaxModel of `config.model` (cached per class path and kwargs)."""
    if not m.flax_module:
        raise ConfigError("config.model.kind='flax' needs config.model.flax_module='package.module:ClassName'")
    kwargs = _kwargs(m)
    key = (m.flax_module, json.dumps(kwargs, sort_keys=True, default=repr))
    if key in _MODELS:
        return _MODELS[key]
    nnx = _nnx()
    cls = load_class(m.flax_module)
    with nnx.use_eager_sharding(False):  # logical names are not mesh axes: jaxsys places the arrays
        try:
            abstract = nnx.eval_shape(lambda: cls(**kwargs, rngs=nnx.Rngs(0)))
        except TypeError as e:
            raise ConfigError(
                f"config.model.flax_module={m.flax_module!r} could not be built as "
                f"{cls.__name__}(**config.model.flax_kwargs, rngs=nnx.Rngs(key)): {e}"
            ) from e
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    others = [".".join(map(str, p)) + f" ({type(v).__name__})" for p, v in nnx.to_flat_state(rest)]
    if others:
        raise ConfigError(
            f"{cls.__name__} holds state that is not an nnx.Param: {', '.join(others[:8])}. "
            "jaxsys trains parameters only (no dropout RNG streams, batch statistics or "
            "caches held by the module)"
        )
    specs = {}
    for path, variable in nnx.to_flat_state(params):
        name = "/".join(map(str, path))
        value = variable.get_value() if hasattr(variable, "get_value") else variable.value
        axes = _leaf_axes(name, variable, value.shape)
        node = specs
        for part in path[:-1]:
            node = node.setdefault(str(part), {})
        # AdamW's decay on matrices, not on vectors (norm scales, biases), as jaxsys's own model
        node[str(path[-1])] = ParamSpec(
            tuple(value.shape),
            axes,
            init=FLAX_INIT,
            decay=value.ndim >= 2,
            dtype=None if jnp.issubdtype(value.dtype, jnp.floating) else str(value.dtype),
        )
    template = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(params))
    model = FlaxModel(cls, kwargs, graphdef, template, specs)
    _MODELS[key] = model
    return model


def _names(specs) -> list[str]:
    paths = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    return ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in paths]


def check_layout(specs, config) -> None:
    """Every logical name is in the rules table, and every sharded dimension divides."""
    params_rules = config.sharding.params
    known = sorted(params_rules.keys())
    sizes = {a: config.mesh[a] for a in config.mesh}
    for name, spec in zip(_names(specs), jax.tree.leaves(specs, is_leaf=is_spec)):
        for dim, (size, logical) in enumerate(zip(spec.shape, spec.axes)):
            if logical is None:
                continue
            if logical not in params_rules:
                what = (
                    "names activations, not parameters" if logical in ACTIVATION_ONLY else "is not in the rules table"
                )
                raise ConfigError(
                    f"Flax parameter {name} {spec.shape} names logical axis {logical!r} (dimension {dim}), "
                    f"which {what}: the known parameter axes are {', '.join(known)} (config.sharding.params, "
                    "docs/flax.md). Rename the axis in the model (or None to replicate the dimension)"
                )
            rule = axes_of(params_rules[logical])
            shards = math.prod(max(sizes[a], 1) for a in rule)
            if size % shards:
                raise ConfigError(
                    f"Flax parameter {name} {spec.shape}: dimension {dim} ({logical!r}, size {size}) is not "
                    f"divisible by the {shards} shards of mesh axes {rule} (config.sharding.params.{logical}); "
                    "change the model's size or the mesh"
                )


def check_output(model: FlaxModel, config) -> None:
    """The module maps tokens[B, T] to logits[B, T, config.model.vocab_size] (traced, not run)."""
    B, T, V = 2, config.data.seq_len, config.model.vocab_size
    try:
        out = jax.eval_shape(
            lambda p, x: _forward(model, p, x), model.abstract_params, jax.ShapeDtypeStruct((B, T), jnp.int32)
        )
    except ConfigError:
        raise
    except Exception as e:  # the model's own error, named with what was asked of it
        raise ConfigError(
            f"{model.cls.__name__}(tokens[{B}, {T}]) failed while tracing its forward: {type(e).__name__}: {e}"
        ) from e
    shape = getattr(out, "shape", None)
    if shape != (B, T, V):
        raise ConfigError(
            f"{model.cls.__name__}(tokens[{B}, {T}]) returned {shape}, not logits [{B}, {T}, {V}]: "
            "the model's vocabulary must equal config.model.vocab_size, and it must return "
            "one array of logits"
        )


def specs_for(config) -> dict:
    """The checked ParamSpec tree of a Flax `config` (program.build and the cost model use it)."""
    model = describe(config.model)
    check_layout(model.specs, config)
    return model.specs


def validate_model(config) -> dict:
    """`specs_for` plus a traced forward that checks the logits' shape. Returns the specs."""
    specs = specs_for(config)
    check_output(describe(config.model), config)
    return specs


# ----------------------------------------------------------------------------- values and forward


def init_params(m, key, dtype) -> dict:
    """The module's own initial parameters from `key` (jit with out_shardings to create them in
    place), floating leaves cast to `dtype` (config.model.param_dtype)."""
    nnx = _nnx()
    model = describe(m)
    with nnx.use_eager_sharding(False):
        params = model.params_of(model.build(key))
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def _forward(model: FlaxModel, params, inputs):
    with _nnx().use_eager_sharding(False):
        return model.merge(params)(inputs)


def logits(params, inputs, m, layout: Layout, specs):
    """logits[B, T, V] of this shard's inputs[B, T]: the parameters fetched from host memory,
    cast to the compute dtype and all-gathered over their FSDP axes, merged into the module, called."""
    model = describe(m)
    params = offload.fetch(params, layout.params_on_host)
    compute = jnp.dtype(m.compute_dtype)
    params = jax.tree.map(lambda p: p.astype(compute) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
    axes = jax.tree.map(lambda s: s.axes, specs, is_leaf=is_spec)
    return _forward(model, fsdp.gather(params, axes, layout), inputs)


def token_losses(params, tokens, m, layout: Layout, specs):
    """Per-token cross-entropy [B, T] of next-token prediction on this shard's tokens[B, T+1], and
    {} (no MoE statistics), as `transformer.token_losses` returns them."""
    out = logits(params, tokens[:, :-1], m, layout, specs)
    return tensor.cross_entropy(out, tokens[:, 1:], ()), {}
