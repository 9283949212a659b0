"""Checkpoints on Orbax: asynchronous saves, atomic commits, restore onto any mesh.

A checkpoint is `{workdir}/checkpoints/<step>/` with the items `state` (the TrainState: step,
parameters, optimizer state), `meta` (the resolved config as JSON) and `data` (the loader's state
as JSON, `loader.Loader.state()`: Grain's iterator position, the steps consumed, and the sampler's
seed and shape; checkpoints written before it have no `data` item and resume from their step,
which is the same position because batches are a pure function of (seed, step)). Orbax writes a
step to a temporary directory and renames it when complete, so a step is either whole or ignored.

Restore builds the abstract state of the *current* config and mesh (`Program.abstract_state()`)
and reads the arrays straight into those shardings: resuming on another layout is the ordinary
path, not a conversion.

Here: `Checkpointer` (save, resume, the saved config of a step), `CheckpointError`, `directory`,
`require_new_workdir`, `check_shapes`; `saved_config(workdir)`; `restore_params` (the parameters
alone, for config.checkpoint.init_from); `load(workdir)`, the one loader of a workdir's checkpoint
for the commands that read one (the saved config with overrides, its program on the mesh it names,
the parameters restored into that program's shardings; `ONE_DEVICE` reads onto one device);
`inspect`. In the package: `hf` (Hugging Face Llama safetensors to and from a workdir, for
`python -m jaxsys.convert`) and `__main__` (`python -m jaxsys.checkpoint inspect WORKDIR`).
"""

from __future__ import annotations

import json
import os
import time

import jax
import orbax.checkpoint as ocp

from jaxsys import compile_cache
from jaxsys.config import MESH_AXES, apply_overrides, base_config, from_dict


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored: the message names the tensor or file and the fix."""


def directory(workdir: str) -> str:
    return os.path.abspath(os.path.join(workdir, "checkpoints"))


def require_new_workdir(workdir: str, error=None) -> None:
    """Refuse a workdir that already holds a run (checkpoints or metrics), so that a command that
    writes a new one (conversion, quantization) never overwrites anything."""
    for name in ("checkpoints", "metrics.jsonl"):
        if os.path.exists(os.path.join(workdir, name)):
            raise (error or CheckpointError)(
                f"{workdir} already holds a run ({name}): pass a new output workdir; nothing was overwritten"
            )


class Checkpointer:
    """Saves every `config.checkpoint.every_steps` steps and/or `every_minutes` minutes (and at the
    end), keeps the last `keep` plus every `keep_period`-th step."""

    def __init__(self, workdir: str, ckpt_cfg, read_only: bool = False):
        self.cfg = ckpt_cfg
        if read_only and not os.path.isdir(directory(workdir)):
            raise CheckpointError(f"{workdir} has no checkpoints/ directory: pass the workdir of a run")
        options = (
            ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
            if read_only
            else ocp.CheckpointManagerOptions(
                max_to_keep=ckpt_cfg.keep or None,
                keep_period=ckpt_cfg.keep_period or None,
                enable_async_checkpointing=ckpt_cfg.async_save,
                create=True,
            )
        )
        self.manager = ocp.CheckpointManager(
            directory(workdir),
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler(),
            },
        )
        self._last_save_time = time.monotonic()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def due(self, step: int, final: bool) -> bool:
        c = self.cfg
        by_steps = c.every_steps > 0 and step % c.every_steps == 0
        by_time = c.every_minutes > 0 and time.monotonic() - self._last_save_time >= 60 * c.every_minutes
        return final or by_steps or by_time

    def save(self, step: int, state, config, data: dict | None = None) -> None:
        """Start saving (returns once the arrays are copied off the training buffers); `data`: the
        loader's state (`loader.Loader.state()`), saved as the `data` item."""
        items = {
            "state": ocp.args.StandardSave(state),
            "meta": ocp.args.JsonSave({"config": json.loads(config.to_json_best_effort())}),
        }
        if data is not None:
            items["data"] = ocp.args.JsonSave(data)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._last_save_time = time.monotonic()

    def restore(self, abstract_state, step: int | None = None):
        """The state at `step` (default: latest complete) in the shardings of `abstract_state`."""
        step = self.latest_step() if step is None else step
        try:
            check_shapes(self.manager.item_metadata(step)["state"], abstract_state, step)
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )
        except CheckpointError:
            raise
        except (ValueError, OSError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"checkpoint step {step} in {self.manager.directory} could not be "
                f"read ({type(e).__name__}: {e}); nothing was deleted. Restore an "
                "earlier step or move the damaged step directory aside."
            ) from e
        return restored["state"]

    def data_state(self, step: int) -> dict | None:
        """The loader state saved with `step`, or None for a checkpoint without a `data` item."""
        if not os.path.isdir(os.path.join(str(self.manager.directory), str(step), "data")):
            return None
        return self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]

    def saved_config(self, step: int | None = None):
        """The resolved config the checkpoint at `step` (default: latest) was saved with."""
        step = self.latest_step() if step is None else step
        if step is None or step not in self.manager.all_steps():
            raise CheckpointError(
                f"{self.manager.directory} has no complete step "
                f"{'' if step is None else step} (steps: {list(self.manager.all_steps())})"
            )
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        return from_dict(meta["config"], source=f"checkpoint step {step}")

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _name(path) -> str:
    """'opt_state/0/mu/embed': the same for a NamedTuple field and the dict Orbax stores it as."""
    parts = (getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return "/".join(str(p) for p in parts)


def check_shapes(saved_metadata, abstract_state, step: int) -> None:
    """Every saved tensor must have the shape the config expects; name the first that does not."""
    saved_by_path = {_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(saved_metadata)[0]}
    for path, want in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        name = _name(path)
        got = saved_by_path.get(name)
        parent = name.rsplit("/", 1)[0]
        if got is None and parent in saved_by_path:
            raise CheckpointError(
                f"checkpoint step {step} is not quantized ({parent} is a float tensor) but "
                f"the config expects {name} (config.model.quant): make a quantized "
                "workdir with `python -m jaxsys.quantize --workdir W --out W_q --format "
                "...` or set config.model.quant='none'"
            )
        if got is None and any(k.startswith(name + "/") for k in saved_by_path):
            raise CheckpointError(
                f"checkpoint step {step} holds {name} quantized (codes and scales) but the "
                "config expects a float tensor: set config.model.quant* as in the "
                "workdir's config.json (or load that config)"
            )
        if got is None:
            raise CheckpointError(
                f"checkpoint step {step} has no tensor {name}: it was saved from a "
                "different model; use a new --workdir or the matching config"
            )
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(
                f"checkpoint step {step}: tensor {name} has shape {tuple(got.shape)} "
                f"but the config expects {tuple(want.shape)}; restore with the config "
                "it was saved with (saved in the checkpoint's meta item)"
            )


def saved_config(workdir: str, overrides=(), step: int | None = None):
    """(config, step): the config `workdir`'s checkpoint at `step` (default: latest) was saved
    with, with `--config.k=v` overrides applied (how to run it: the mesh, kernels)."""
    if not os.path.isdir(workdir):
        problem = "is a file, not a directory" if os.path.exists(workdir) else "does not exist"
        raise CheckpointError(
            f"{workdir} {problem}: pass the workdir of a run (or one written by `python -m jaxsys.convert --from-hf`)"
        )
    reader = Checkpointer(workdir, base_config().checkpoint, read_only=True)
    try:
        step = reader.latest_step() if step is None else step
        config = reader.saved_config(step)
    finally:
        reader.close()
    apply_overrides(config, overrides)
    return config, step


# ----------------------------------------------------------------------------- init_from


def workdir_of(path: str) -> str:
    """The workdir of `path`: a workdir (holding checkpoints/) or its checkpoints/ directory."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.basename(path) == "checkpoints" and not os.path.isdir(os.path.join(path, "checkpoints")):
        return os.path.dirname(path)
    return path


def restore_params(path: str, abstract_params, what: str | None = None, step: int | None = None):
    """The parameters of the complete step `step` (default: the latest) under `path`
    (config.checkpoint.init_from: a workdir or its checkpoints/ directory), read straight into the
    shardings and memory kinds of `abstract_params` (`Program.abstract_state().params`); `what`
    names `path` in errors. Only the `params` subtree is read (Orbax's partial restore): the saved
    step counter and optimizer state, whatever optimizer made them, are not. Returns
    (params, step). Raises CheckpointError naming `path` and the problem."""
    what = what or f"config.checkpoint.init_from={path!r}"
    workdir = workdir_of(path)
    if not os.path.isdir(workdir):
        problem = "is a file, not a directory" if os.path.exists(workdir) else "does not exist"
        raise CheckpointError(
            f"{what}: {workdir} {problem}; pass the workdir of a run (or its checkpoints/ "
            "directory), e.g. one written by `python -m jaxsys.convert --from-hf`"
        )
    if not os.path.isdir(directory(workdir)):
        raise CheckpointError(f"{what}: {workdir} has no checkpoints/ directory; pass the workdir of a run")
    manager = ocp.CheckpointManager(
        directory(workdir),
        options=ocp.CheckpointManagerOptions(read_only=True, create=False),
        # "data" (the loader's position) registered though not read: Orbax warns of unknown items
        item_handlers={
            "state": ocp.PyTreeCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
            "data": ocp.JsonCheckpointHandler(),
        },
    )
    try:
        if step is None:
            step = manager.latest_step()
            if step is None:
                raise CheckpointError(f"{what}: {directory(workdir)} holds no complete checkpoint step")
        elif step not in manager.all_steps():
            raise CheckpointError(
                f"{what}: {directory(workdir)} has no complete step {step} (steps: {list(manager.all_steps())})"
            )
        try:
            metadata = manager.item_metadata(step)["state"]
            check_shapes({"params": metadata["params"]}, {"params": abstract_params}, step)
            restored = manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item={"params": abstract_params},
                        partial_restore=True,
                        restore_args={"params": ocp.checkpoint_utils.construct_restore_args(abstract_params)},
                    )
                ),
            )
        except CheckpointError as e:
            raise CheckpointError(f"{what}: {e}") from e
        except (ValueError, OSError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{what}: checkpoint step {step} in {directory(workdir)} could not be read ({type(e).__name__}: {e})"
            ) from e
    finally:
        manager.close()
    return restored["state"]["params"], step


# ----------------------------------------------------------------------------- load


# overrides that put a saved config on one device: `load(workdir, ONE_DEVICE, devices=jax.devices()[:1])`
ONE_DEVICE = (
    *(f"--config.mesh.{axis}=1" for axis in MESH_AXES),
    *(f"--config.dcn.{axis}=1" for axis in MESH_AXES),
    "--config.train.virtual_stages=1",
    "--config.parallel.vocab_parallel=false",
)


ADAPTER_MODES = ("auto", "merge", "apply")


def load(workdir: str, overrides=(), step: int | None = None, devices=None, check=None, adapters: str = "auto"):
    """(program, params, config) of `workdir`'s checkpoint at `step` (default: latest): the config
    it was saved with, `--config.k=v` overrides applied (how to run it: the mesh, kernels), the
    program built on the mesh that config names (over `devices`, default the first devices it
    needs), and the parameters read into the program's shardings (the optimizer state is not read).
    A missing or bad workdir, step or override raises CheckpointError or ConfigError before any
    program is built or array read, and so does `check(config)` (the caller's own requirements,
    e.g. serving's `runner.check_servable`).

    A LoRA workdir (config.lora.rank > 0; docs/finetune.md): `adapters="merge"` returns the model
    with the adapters merged into its weights (W + scale A B, in config.model.param_dtype; a
    quantized base dequantized first), as a program and config without adapters (lora.rank 0,
    model.quant none); "apply" keeps them (the forward adds them at every projection); "auto"
    merges over a float base (the same model, one matmul per projection) and applies them over a
    quantized one (QLoRA: the base keeps its 4- or 8-bit weights)."""
    import copy

    from jaxsys import program as program_lib
    from jaxsys.mesh import cpu_unless_accelerator, make_mesh, mesh_for
    from jaxsys.models import adapters as adapters_lib

    if adapters not in ADAPTER_MODES:
        raise ValueError(f"load(adapters={adapters!r}): choose one of {ADAPTER_MODES}")
    cpu_unless_accelerator()
    config, step = saved_config(workdir, overrides, step)
    compile_cache.use(config.compile_cache)  # generate / serve / evaluate load compiled programs too
    if check is not None:
        check(config)
    mesh = mesh_for(config) if devices is None else make_mesh(config, devices)
    program = program_lib.build(config, mesh)
    params, _ = restore_params(workdir, program.abstract_state().params, f"--workdir {workdir}", step)
    merge = adapters == "merge" or (adapters == "auto" and config.model.quant == "none")
    if not (adapters_lib.enabled(config) and merge):
        return program, params, config
    merged_config = copy.deepcopy(config)
    merged_config.lora.rank = 0
    merged_config.model.quant = "none"
    merged = program_lib.build(merged_config, mesh)
    dtype = jax.numpy.dtype(config.model.param_dtype)
    merge_fn = jax.jit(lambda p: adapters_lib.merged(p, config.model, dtype), out_shardings=merged.param_shardings)
    return merged, merge_fn(params), merged_config


# ----------------------------------------------------------------------------- inspect


def inspect(workdir_or_dir: str) -> dict:
    """Steps present and, for the latest, every tensor's shape, dtype and saved sharding."""
    path = workdir_or_dir
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    if not os.path.isdir(path):
        raise CheckpointError(f"{workdir_or_dir} is not a checkpoint directory (no {path})")
    manager = ocp.CheckpointManager(
        os.path.abspath(path),
        options=ocp.CheckpointManagerOptions(read_only=True, create=False),
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
            "data": ocp.JsonCheckpointHandler(),
        },
    )
    steps = list(manager.all_steps())
    if not steps:
        raise CheckpointError(f"{path} holds no complete checkpoint step")
    latest = max(steps)
    tensors = []
    for p, leaf in jax.tree_util.tree_flatten_with_path(manager.item_metadata(latest)["state"])[0]:
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "partition_spec", None)
        mesh = dict(zip(getattr(sharding, "axis_names", ()), getattr(sharding, "shape", ())))
        tensors.append(
            {
                "name": _name(p),
                "shape": list(leaf.shape),
                "dtype": str(leaf.dtype),
                "partition_spec": list(spec) if spec is not None else None,
                "mesh": {k: int(v) for k, v in mesh.items()},
            }
        )
    return {"directory": os.path.abspath(path), "steps": steps, "latest": latest, "tensors": tensors}
