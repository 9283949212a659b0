"""JAX's persistent compilation cache for jaxsys runs (`config.compile_cache`; docs/goodput.md).

XLA writes every program it compiles to a folder, keyed by the program, the compile options and the
backend; a later process (a restart after a crash, a resumed run, a second run of the same config)
loads the executable from there instead of compiling it again. jax 0.11.2 does this on CPU, GPU
and TPU (`jax._src.compilation_cache.is_cache_used`); tests/test_goodput.py checks it on CPU.

    config.compile_cache.dir = "auto"   # $JAXSYS_COMPILE_CACHE, else $JAXSYS_CACHE/xla (~/.cache/jaxsys/xla)
    config.compile_cache.dir = "/fast/disk/xla"   # a folder of your own
    config.compile_cache.dir = ""       # off

`use(config.compile_cache)` points JAX at the folder (the setting is process-wide: the last run in a
process decides) and `Counter` counts, from JAX's monitoring events, how many programs a run
compiled and how many it loaded from the cache. The cache is trusted code: share its folder only
with people you trust (JAX's warning).
"""

from __future__ import annotations

import dataclasses
import os

import jax
from jax import monitoring

ENV = "JAXSYS_COMPILE_CACHE"  # where "auto" puts the cache; empty: off (tests/conftest.py sets it so)
_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"  # a compile that consulted the cache
_HITS = "/jax/compilation_cache/cache_hits"  # ... and found its executable there

_counts = {_REQUESTS: 0, _HITS: 0}
_listening = False


def _on_event(event: str, **_) -> None:
    if event in _counts:
        _counts[event] += 1


def directory(cc) -> str | None:
    """The folder `config.compile_cache` names, or None when the cache is off."""
    d = cc.dir
    if d == "auto":
        if ENV in os.environ:
            d = os.environ[ENV]
        else:
            base = os.environ.get("JAXSYS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxsys")
            d = os.path.join(base, "xla")
    return os.path.abspath(os.path.expanduser(d)) if d else None


def use(cc) -> str | None:
    """Make JAX read and write the compiled programs of this process in `directory(cc)` (or in no
    cache when that is None), from the next compile on; returns the folder. Programs that compiled
    in under `cc.min_compile_secs` seconds are not written (JAX's
    jax_persistent_cache_min_compile_time_secs; jaxsys's default 0 writes all, so that a second run
    compiles nothing)."""
    global _listening
    from jax.experimental.compilation_cache import compilation_cache

    path = directory(cc)
    if path is not None:
        os.makedirs(path, exist_ok=True)
    changed = jax.config.jax_compilation_cache_dir != path
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(cc.min_compile_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if changed:  # JAX opens its cache once per process: make it open this folder at the next compile
        compilation_cache.reset_cache()
    if not _listening:
        monitoring.register_event_listener(_on_event)
        _listening = True
    return path


@dataclasses.dataclass
class Counter:
    """Programs compiled and loaded from the cache since it was made (this process's events)."""

    requests: int = dataclasses.field(default_factory=lambda: _counts[_REQUESTS])
    hits: int = dataclasses.field(default_factory=lambda: _counts[_HITS])

    def loaded(self) -> int:
        return _counts[_HITS] - self.hits

    def compiled(self) -> int:
        """Programs compiled (cache misses): every compile consults the cache when it is on."""
        return (_counts[_REQUESTS] - self.requests) - self.loaded()

    def line(self, path: str | None) -> str:
        if path is None:
            return f"compile cache off (config.compile_cache.dir=''): {self.compiled()} programs compiled"
        return f"compile cache {path}: {self.loaded()} programs loaded from it, {self.compiled()} compiled"
