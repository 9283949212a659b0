"""Tuned kernel launch configurations, stored in the repository per device kind and looked up at run time.

A kernel asks for the configuration of one *shape class* (a small canonical tuple of what the best
tiles depend on: head dim, dtype, causal and a power-of-two bucket of T for attention; the format,
an M bucket, K, N and the group size for the quantized matmuls) on the current device kind. The
winners of a sweep (`python -m jaxsys.kernels.tune`, a GPU) are stored in
kernels/tuning_cache/<device>.json, one file per device kind, e.g. "NVIDIA H100 80GB HBM3" ->
nvidia_h100_80gb_hbm3.json. docs/kernels_tuning.md describes the format and the sweep.

Lookup: an exact shape-class hit returns the stored configuration; a miss returns {} and the kernel
keeps its built-in defaults (never an error: a missing, unreadable or malformed file is a miss, with
a warning for the last two). A directory in the environment variable JAXSYS_TUNING_DIR holds user
files of the same names whose entries take precedence over the shipped ones. Files are read once
per (device, override directory) and kept in memory; `clear_cache()` forgets them.

`use_config` forces one configuration for a kernel inside a `with` block (traced calls only): the
sweep measures candidates through the same lookup path that real calls take.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import warnings

import jax
import jax.numpy as jnp

__all__ = [
    "CACHE_DIR",
    "ENV_DIR",
    "FORMAT_VERSION",
    "KERNELS",
    "clear_cache",
    "current_device_kind",
    "device_file_name",
    "flash_attention_class",
    "flash_attention_config",
    "flash_attention_mgpu_config",
    "lookup",
    "MGPU_BACKWARDS",
    "pow2_bucket",
    "quantized_matmul_class",
    "quantized_matmul_config",
    "QUANTIZED_KINDS",
    "read_file",
    "shape_key",
    "use_config",
    "validate_config",
]

CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning_cache")
ENV_DIR = "JAXSYS_TUNING_DIR"
FORMAT_VERSION = 1

# The keys each kernel accepts from a cache entry. Tiles must be powers of two (Triton block shapes).
# flash_attention_mgpu: the Hopper (Mosaic GPU) kernels' choice between their fused backward and
# the split one (kernels/flash_attention/kernel_mgpu.py), the one key that is not a number
_POW2_KEYS = {
    "flash_attention": ("block_q", "block_k", "block_q_bwd", "block_k_bwd", "num_warps"),
    "quantized_matmul": ("block_m", "block_n", "block_k", "num_warps"),
    "flash_attention_mgpu": (),
}
_INT_KEYS = {"flash_attention": ("num_stages",), "quantized_matmul": ("num_stages",), "flash_attention_mgpu": ()}
MGPU_BACKWARDS = ("fused", "split")
_CHOICE_KEYS = {"flash_attention_mgpu": {"backward": MGPU_BACKWARDS}}
KERNELS = tuple(_POW2_KEYS)
QUANTIZED_KINDS = ("w8a16", "w4a16", "w8a8", "w4ax")

_forced: dict[str, dict] = {}  # use_config's configurations, by kernel


# ----------------------------------------------------------------------------------------------
# Keys: device kinds and shape classes.


def device_file_name(device_kind: str) -> str:
    """A device kind as a file stem: lower case, runs of other characters as one '_'."""
    stem = re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")
    return stem or "unknown"


def current_device_kind() -> str:
    return jax.devices()[0].device_kind


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= n (and >= minimum)."""
    if n < 1:
        raise ValueError(f"pow2_bucket needs n >= 1; got {n}")
    return max(minimum, 1 << (int(n) - 1).bit_length())


def shape_key(shape_class) -> str:
    """The JSON key of a shape class ((name, value) pairs): "name=value,..." in the given order."""
    return ",".join(f"{name}={value}" for name, value in shape_class)


def flash_attention_class(*, head_dim: int, dtype, causal: bool, seq_len: int) -> tuple:
    """Attention's shape class: head dim, dtype, causal, T rounded up to a power of two (>= 16)."""
    return (
        ("head_dim", int(head_dim)),
        ("dtype", jnp.dtype(dtype).name),
        ("causal", bool(causal)),
        ("t_bucket", pow2_bucket(seq_len, 16)),
    )


def quantized_matmul_class(*, kind: str, m: int, k: int, n: int, group_size: int | None = None) -> tuple:
    """A quantized matmul's shape class: format, M rounded up to a power of two, K, N exactly (they
    are layer shapes), and the group size (the 4-bit kinds only; 0 otherwise)."""
    if kind not in QUANTIZED_KINDS:
        raise ValueError(f"kind must be one of {QUANTIZED_KINDS}; got {kind!r}")
    group = int(group_size) if kind in ("w4a16", "w4ax") and group_size else 0
    return (("kind", kind), ("m_bucket", pow2_bucket(m)), ("k", int(k)), ("n", int(n)), ("group", group))


# ----------------------------------------------------------------------------------------------
# Validation and loading.


def validate_config(kernel: str, config) -> dict:
    """config as a dict of the kernel's known keys with valid values; ValueError otherwise."""
    if kernel not in _POW2_KEYS:
        raise ValueError(f"unknown kernel {kernel!r}; known: {KERNELS}")
    if not isinstance(config, dict) or not config:
        raise ValueError(f"a {kernel} config must be a non-empty dict; got {config!r}")
    choices = _CHOICE_KEYS.get(kernel, {})
    known = _POW2_KEYS[kernel] + _INT_KEYS[kernel] + tuple(choices)
    for name, value in config.items():
        if name not in known:
            raise ValueError(f"{kernel} config: unknown key {name!r} (known: {known})")
        if name in choices:
            if value not in choices[name]:
                raise ValueError(f"{kernel} config: {name} must be one of {choices[name]}; got {value!r}")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{kernel} config: {name} must be a positive int; got {value!r}")
        if name in _POW2_KEYS[kernel] and value & (value - 1):
            raise ValueError(f"{kernel} config: {name} must be a power of two; got {value}")
        if kernel == "flash_attention" and name.startswith("block") and value < 16:
            raise ValueError(f"{kernel} config: {name} must be >= 16 (Triton tiles); got {value}")
    return dict(config)


def read_file(path: str) -> dict:
    """A cache file's contents ({"format", "device_kind", "header", "kernels"}); ValueError if malformed."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION or not isinstance(data.get("kernels"), dict):
        raise ValueError(f"{path}: not a format-{FORMAT_VERSION} tuning cache (needs 'format' and 'kernels')")
    for kernel, entries in data["kernels"].items():
        if not isinstance(entries, dict):
            raise ValueError(f"{path}: kernels.{kernel} must map shape keys to entries")
        for key, entry in entries.items():
            if not isinstance(entry, dict) or "config" not in entry:
                raise ValueError(f"{path}: kernels.{kernel}[{key!r}] has no 'config'")
    return data


def _entries(path: str) -> dict:
    """{kernel: {shape key: config}} of one file; {} if absent. Invalid entries are skipped with a
    warning, a malformed file as a whole too: a bad cache must not stop a kernel from running."""
    if not os.path.exists(path):
        return {}
    try:
        data = read_file(path)
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring the tuning cache {path}: {e}", stacklevel=3)
        return {}
    out: dict = {}
    for kernel, entries in data["kernels"].items():
        if kernel not in _POW2_KEYS:
            continue  # a kernel this version does not know
        for key, entry in entries.items():
            try:
                out.setdefault(kernel, {})[key] = validate_config(kernel, entry["config"])
            except ValueError as e:
                warnings.warn(f"ignoring {path} entry {kernel}[{key!r}]: {e}", stacklevel=3)
    return out


@functools.cache
def _load(stem: str, override_dir: str | None) -> dict:
    merged = _entries(os.path.join(CACHE_DIR, stem + ".json"))
    if override_dir:
        for kernel, entries in _entries(os.path.join(override_dir, stem + ".json")).items():
            merged.setdefault(kernel, {}).update(entries)
    return merged


def clear_cache() -> None:
    """Forget the files read so far (the next lookup reads them again)."""
    _load.cache_clear()


# ----------------------------------------------------------------------------------------------
# Lookup.


def lookup(kernel: str, shape_class, device_kind: str | None = None) -> dict:
    """The stored configuration of (kernel, shape class, device kind) as a new dict, or {} on a miss.
    device_kind None: the first local device's. A configuration forced by `use_config` wins."""
    if kernel in _forced:
        return dict(_forced[kernel])
    kind = current_device_kind() if device_kind is None else device_kind
    entries = _load(device_file_name(kind), os.environ.get(ENV_DIR) or None).get(kernel, {})
    return dict(entries.get(shape_key(shape_class), {}))


def flash_attention_config(*, head_dim: int, dtype, causal: bool, seq_len: int, device_kind=None) -> dict:
    """Tuned {block_q, block_k, block_q_bwd, block_k_bwd, num_warps, num_stages} (any subset) of
    the generic flash-attention kernel for this shape on this device, or {}."""
    shape_class = flash_attention_class(head_dim=head_dim, dtype=dtype, causal=causal, seq_len=seq_len)
    return lookup("flash_attention", shape_class, device_kind)


def flash_attention_mgpu_config(*, head_dim: int, dtype, causal: bool, seq_len: int, device_kind=None) -> dict:
    """Tuned {backward: "fused" | "split"} of the Hopper flash-attention kernels, or {}."""
    shape_class = flash_attention_class(head_dim=head_dim, dtype=dtype, causal=causal, seq_len=seq_len)
    return lookup("flash_attention_mgpu", shape_class, device_kind)


def quantized_matmul_config(*, kind: str, m: int, k: int, n: int, group_size=None, device_kind=None) -> dict:
    """Tuned {block_m, block_n, block_k, num_warps, num_stages} (any subset) of a quantized matmul
    (kernels/quantized_matmul: pass them as its keyword arguments), or {}."""
    return lookup(
        "quantized_matmul", quantized_matmul_class(kind=kind, m=m, k=k, n=n, group_size=group_size), device_kind
    )


@contextlib.contextmanager
def use_config(kernel: str, config: dict):
    """Within the block, every lookup for `kernel` returns `config` (the sweep's candidates). Not
    thread-safe; applies to calls traced inside the block."""
    config = validate_config(kernel, config)
    previous = _forced.get(kernel)
    _forced[kernel] = config
    try:
        yield
    finally:
        if previous is None:
            _forced.pop(kernel, None)
        else:
            _forced[kernel] = previous
