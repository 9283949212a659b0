"""Data races in Mosaic GPU Pallas kernels, found on a CPU: Pallas' GPU interpreter with its race
detector (`plgpu.InterpretGPUParams(detect_races=True)`), plus the one access kind it leaves out.

The interpreter runs each warpgroup as a thread and the TMA engine's copies as tasks, keeps a vector
clock per thread (two, in fact: the generic proxy's, for `ref[...]` loads and stores, and the async
proxy's, for TMA and tensor-core accesses, joined only by `plgpu.commit_smem`, i.e. a
`fence.proxy.async`) and passes clocks along barrier arrivals and waits. Every shared-memory access
whose clock is unordered with an earlier conflicting one is a race. In jax 0.11.2 it records loads,
stores and TMA copies, but not the shared-memory operands a wgmma reads ("TODO: vector clocks" in
its `wgmma` callback), and those are exactly the reads that the rings' `free` barriers, the
exchange barrier of the H = 256 flash backward and the proxy fences before a wgmma protect.

`detecting_races()` adds them while it is active: a wgmma's A and B operands (both in shared memory
under the interpreter) count as reads through the async proxy by the issuing warpgroup, at a tick
of its clock, as the interpreter's own Blackwell MMA callback counts its operands. So a generic
store that a wgmma reads without a `commit_smem` in between races, as does a TMA refill of a ring
slot that a wgmma of another warpgroup may still be reading, or one warpgroup overwriting an
exchange buffer that the other's wgmma has not read yet. It also records the race state of every
kernel interpreted under it (the interpreter keeps only the latest kernel's).

Only what the interpreter models is checked: barriers, TMA copies and the two proxies. A wgmma is
synchronous there (the compiled kernel waits for it before its accumulator is read, which the
program order stands for), and nothing checks registers, bank conflicts or timing.

    with mgpu_races.detecting_races() as report:
        ...  # run kernels with interpret=plgpu.InterpretGPUParams(detect_races=True)
    assert report.kernels and not report.found

kernel_mgpu.check_races runs the flash-attention kernels this way; tests/test_mgpu_races.py shows
the check failing where a barrier or fence is removed.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax

# the interpreter's internals (jax 0.11.2, the pinned version): there is no public hook for this
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret.shared_memory import HostAllocationKey


@dataclasses.dataclass
class RaceReport:
    """The race states of the kernels interpreted with race detection, in the order they ran."""

    states: list = dataclasses.field(default_factory=list)

    @property
    def kernels(self) -> int:
        return len(self.states)

    @property
    def found(self) -> list[int]:
        """Indices of the kernels in which a race was found."""
        return [i for i, s in enumerate(self.states) if s.races_found]


def _wgmma_reading_operands(original):
    def wgmma(**kwargs):
        memory = gpu_callbacks._get_shared_memory()
        if memory.detect_races:
            for operand in ("a", "b"):
                key = HostAllocationKey.from_array(kwargs[f"{operand}_allocation_key_as_array"])
                transforms = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(kwargs[f"{operand}_transforms"]))
                access = memory.access(key, transforms)
                thread = kwargs["thread"]
                with memory.lock:  # a tick of both of the thread's clocks, as a TMA issue takes
                    clocks = memory.clocks[thread]
                    clocks.inc(memory.thread_to_vc_position(thread))
                    clock = clocks.copy()
                gpu_callbacks.get_races().check_read(
                    thread, clock.async_smem_clock, key, access, source_info=kwargs.get("source_info")
                )
        return original(**kwargs)

    return wgmma


@contextlib.contextmanager
def detecting_races():
    """Within the block, kernels interpreted with `detect_races=True` also check their wgmma
    operand reads, and each one's race state lands in the yielded RaceReport. Functions traced
    before the block keep the interpreter's own wgmma: trace (or jit) inside it. After a kernel
    fails under the interpreter its global state is reset, as the interpreter requires."""
    report = RaceReport()
    original_wgmma = gpu_callbacks.wgmma
    original_state = gpu_callbacks.GPURaceDetectionState

    class Recorded(original_state):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            report.states.append(self)

    gpu_callbacks.wgmma = _wgmma_reading_operands(original_wgmma)
    gpu_callbacks.GPURaceDetectionState = Recorded
    try:
        yield report
    except BaseException:
        gpu_callbacks.reset_gpu_interpret_mode_state()
        raise
    finally:
        gpu_callbacks.wgmma = original_wgmma
        gpu_callbacks.GPURaceDetectionState = original_state
