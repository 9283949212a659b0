"""kernels/flash_attention/mgpu_ptx.py: the Mosaic GPU flash-attention kernels compiled to PTX and
SASS on this GPU-less host (the CUDA plugin's MosaicGpuCompile with a stand-in libcuda.so.1).

The compile tests need jax-cuda13-plugin, ptxas and cc (skipped otherwise). They pin what ptxas
reports for sm_90a: wgmma in every kernel, the warpgroup register split, and no spills beyond
SPILLS (the one known spill, docs/kernels_flash_attention.md).
"""

from __future__ import annotations

import pytest

from jaxsys.kernels.flash_attention import mgpu_ptx

# (H, kernel) -> most (spill store, spill load) bytes allowed (ptxas 13.5, T = 4096, causal); others:
# none. H = 256 dK/dV: loop-invariant wgmma descriptors of the resident K (16 k-steps with the
# 64-byte swizzle) and scalars, not accumulator tiles (docs). The fused backward adds dQ's [64, H]
# fp32 product to the dK/dV kernel's registers
SPILLS = {
    (128, "flash_attention_mgpu_bwd_dkdv"): (12, 24),
    (256, "flash_attention_mgpu_bwd_dkdv"): (140, 172),
    (64, "flash_attention_mgpu_bwd_fused"): (12, 24),
    (128, "flash_attention_mgpu_bwd_fused"): (184, 192),
}
# registers the consumers take and the producer keeps: the backward kernels, whose consumers hold
# fp32 accumulators of 128 registers a thread (dK and dV, or dQ at H = 256), take FA3's 240 / 24
# (52 / 72 B of spills in dK/dV at H = 128 and 36 / 56 B in dQ at H = 256 with 232 / 40)
SETMAXNREG = {f"flash_attention_mgpu_bwd_{k}": ("inc 240", "dec 24") for k in ("dkdv", "dq", "fused")}
# the kernels of each backward variant (H = 256 has only the split one)
KERNELS = {"fused": ("bwd_fused", "fwd"), "split": ("bwd_dkdv", "bwd_dq", "fwd")}

PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
"""
PTX = """\tsetmaxnreg.inc.sync.aligned.u32 232;
\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {...};
\twgmma.fence.sync.aligned;
\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {...};
\tsetmaxnreg.dec.sync.aligned.u32 40;
"""


def test_parse_reads_registers_spills_and_wgmma():
    s = mgpu_ptx.parse("k", PTXAS, PTX, "HGMMA.64x128x16.F32.BF16 R24\nHGMMA.64x128x16.F32.BF16 R24\n")
    assert (s.registers, s.spill_stores, s.spill_loads, s.stack_frame) == (168, 12, 16, 8)
    assert (s.wgmma, s.hgmma, s.setmaxnreg) == (2, 2, ("inc 232", "dec 40"))
    assert mgpu_ptx.parse("k", PTXAS, PTX, None).hgmma is None
    with pytest.raises(ValueError, match="no register or spill line"):
        mgpu_ptx.parse("k", "ptxas fatal", PTX, None)


@pytest.mark.skipif(mgpu_ptx.missing() is not None, reason=str(mgpu_ptx.missing()))
@pytest.mark.parametrize("h, backward", [(64, "fused"), (128, "fused"), (128, "split"), (256, "split")])
def test_kernels_compile_for_sm90a_with_wgmma_and_no_new_spills(h, backward, tmp_path):
    stats = mgpu_ptx.compile_modules(mgpu_ptx.lower(h, causal=True, backward=backward), keep=str(tmp_path))
    by_name = {s.name: s for s in stats}
    assert sorted(by_name) == [f"flash_attention_mgpu_{k}" for k in KERNELS[backward]]
    for name, s in by_name.items():
        assert s.wgmma >= 4, s  # every kernel's matmuls are wgmma (two or more per loop)
        assert s.hgmma in (None, s.wgmma), s  # each survives ptxas as one HGMMA
        # 3 warpgroups: 168 registers at launch, the producer gives some to the two consumers
        assert s.registers <= 168 and s.setmaxnreg == SETMAXNREG.get(name, ("inc 232", "dec 40")), s
        stores, loads = SPILLS.get((h, name), (0, 0))
        assert s.spill_stores <= stores and s.spill_loads <= loads, s
    assert len(list(tmp_path.glob("module_*/*.ptx"))) == len(KERNELS[backward])
