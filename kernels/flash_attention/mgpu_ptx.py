"""PTX, ptxas and SASS figures of the Mosaic GPU flash-attention kernels, on a host with no GPU.

    python -m jaxsys.kernels.flash_attention.mgpu_ptx --head-dim 128 --causal

Lowers the forward (and, where kernel_mgpu has one, the dQ and dK/dV backward) kernels for an
abstract H100, then compiles each Mosaic module the way XLA's runtime does, through the CUDA
plugin's `MosaicGpuCompile` (MLIR -> LLVM -> PTX -> ptxas for sm_90a). That function asks the CUDA
driver for the current device's compute capability before compiling and loads the cubin after,
and there is no driver here: the compile runs in a child process whose libcuda.so.1 is a stand-in
(mgpu_ptx_cuda_stub.c, built with cc into a temporary folder) that reports one sm_90 device, accepts any
module and launches nothing. Mosaic's own dumps (MOSAIC_GPU_DUMP_PTX / _PTXAS / _SASS) are read
back, per kernel: registers a thread and spill bytes (ptxas -v), the `setmaxnreg` budgets and
`wgmma.mma_async` count in the PTX, and the HGMMA count in the SASS (only where nvdisasm is under
the CUDA root: the nvidia-cuda-nvdisasm wheel). Mosaic runs the first ptxas on PATH, and spills
differ between ptxas versions (13.0 and 13.5 do for one kernel), so the child's PATH leads with the
pinned nvidia-cuda-nvcc wheel's bin/; a GPU host runs whichever ptxas its own PATH finds first.

Nothing is run, so this says nothing about numerics or speed (kernel_mgpu.check_on_gpu, bench.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

STUB_SOURCE = pathlib.Path(__file__).with_name("mgpu_ptx_cuda_stub.c")
DUMPS = ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_SASS")


@dataclasses.dataclass(frozen=True)
class KernelStats:
    name: str
    registers: int  # per thread, as ptxas allots them at launch (before any setmaxnreg)
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_frame: int  # bytes
    wgmma: int  # wgmma.mma_async instructions in the PTX
    setmaxnreg: tuple[str, ...]  # e.g. ("inc 232", "dec 40")
    hgmma: int | None  # HGMMA instructions in the SASS; None without nvdisasm


def missing() -> str | None:
    """Why this cannot run here, or None."""
    from jaxsys.analysis import targets

    if not targets.has_cuda_plugin():
        return "needs jax-cuda13-plugin (the gpu-aot extra)"
    if shutil.which("cc") is None:
        return "needs a C compiler (cc) to build the stand-in libcuda.so.1"
    if not os.path.exists(os.path.join(_cuda_bin(), "ptxas")):
        return "needs ptxas under the CUDA root (nvidia-cuda-nvcc)"
    return None


def _cuda_bin() -> str:
    from jax._src.lib import cuda_path

    return os.path.join(cuda_path or "/usr/local/cuda", "bin")


def ptxas_version() -> str:
    """The version line of the ptxas that compile_modules runs."""
    done = subprocess.run([os.path.join(_cuda_bin(), "ptxas"), "--version"], capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1]


def build_stub(folder: str) -> str:
    """Build the stand-in libcuda.so.1 into `folder`; returns the folder."""
    out = os.path.join(folder, "libcuda.so.1")
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", out, str(STUB_SOURCE)],
        check=True,
        capture_output=True,
    )
    return folder


def lower(head_dim: int, causal: bool, seq: int = 4096, backward: str = "fused") -> list[bytes]:
    """The Mosaic modules (MLIR bytecode) of the forward and, where there is one, the backward
    kernels (`backward`: kernel_mgpu.BWD_VARIANTS), lowered for an abstract H100: b = 1, 4 query
    heads over 2 kv heads, bf16."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.mosaic.gpu import core

    from jaxsys.kernels.flash_attention import flash_attention, kernel_mgpu

    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)
    args = [jax.ShapeDtypeStruct((1, seq, n, head_dim), jnp.bfloat16) for n in (4, 2, 2)]

    def fwd(q, k, v):
        return flash_attention(q, k, v, causal=causal, backend="mosaic_gpu", interpret=False)

    fn = fwd
    if head_dim in kernel_mgpu.BWD_HEAD_DIMS:
        fn = jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
    known = dict(core.KNOWN_KERNELS)  # Mosaic's registry of lowered modules: collect ours alone
    core.KNOWN_KERNELS.clear()
    try:
        with jax.sharding.use_abstract_mesh(mesh), kernel_mgpu.backward_variant(backward):
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        return list(core.KNOWN_KERNELS.values())
    finally:
        core.KNOWN_KERNELS.update(known)


def _compile_worker(folder: str) -> None:
    """In the child: MosaicGpuCompile each module_<i>.mlirbc, dumping into folder/<i>/."""
    import jax_plugins.xla_cuda13 as plugin  # type: ignore[import-not-found]
    from jax.experimental.mosaic.gpu import core  # noqa: F401  (sets MOSAIC_GPU_CUDA_ROOT etc.)

    lib = ctypes.CDLL(plugin._get_library_path())
    compile_fn = lib.MosaicGpuCompile
    compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
    compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
    for path in sorted(pathlib.Path(folder).glob("module_*.mlirbc")):
        dump = os.path.join(folder, path.stem)
        os.makedirs(dump, exist_ok=True)
        os.environ["MOSAIC_GPU_DUMP_TO"] = dump  # read at each compile
        module = path.read_bytes()
        if not compile_fn(module, len(module)):
            sys.exit(f"MosaicGpuCompile failed on {path.name}")


def parse(name: str, ptxas: str, ptx: str, sass: str | None) -> KernelStats:
    """The figures from one kernel's ptxas -v output, PTX and SASS text."""
    regs = re.search(r"Used (\d+) registers", ptxas)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    if regs is None or frame is None:
        raise ValueError(f"{name}: no register or spill line in the ptxas output:\n{ptxas}")
    return KernelStats(
        name=name,
        registers=int(regs.group(1)),
        spill_stores=int(frame.group(2)),
        spill_loads=int(frame.group(3)),
        stack_frame=int(frame.group(1)),
        wgmma=len(re.findall(r"\bwgmma\.mma_async\b", ptx)),
        setmaxnreg=tuple(
            f"{op} {n}" for op, n in re.findall(r"\bsetmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+)", ptx)
        ),
        hgmma=None if sass is None else len(re.findall(r"\bHGMMA\.", sass)),
    )


def compile_modules(modules: list[bytes], keep: str | None = None) -> list[KernelStats]:
    """Compile the modules in a child process with the stand-in driver; their figures, in order.
    `keep`: a folder to leave the PTX / ptxas / SASS dumps in (each kernel in its own subfolder)."""
    with tempfile.TemporaryDirectory(prefix="mgpu_ptx_") as tmp:
        folder = keep or os.path.join(tmp, "dumps")
        os.makedirs(folder, exist_ok=True)
        for i, module in enumerate(modules):
            pathlib.Path(folder, f"module_{i:02d}.mlirbc").write_bytes(module)
        stub = build_stub(tmp)
        env = dict(os.environ, JAX_PLATFORMS="cpu", **dict.fromkeys(DUMPS, "1"))
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (stub, os.environ.get("LD_LIBRARY_PATH")) if p)
        # Mosaic runs the first ptxas on PATH: make it the pinned wheel's (spills vary by version)
        env["PATH"] = os.pathsep.join(p for p in (_cuda_bin(), os.environ.get("PATH")) if p)
        env.pop("MOSAIC_GPU_DUMP_TO", None)
        cmd = [sys.executable, "-m", "jaxsys.kernels.flash_attention.mgpu_ptx", "--compile-worker", folder]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the compile child failed ({done.returncode}):\n{done.stderr[-4000:]}")
        stats = []
        for i in range(len(modules)):
            dump = pathlib.Path(folder, f"module_{i:02d}")
            for log in dump.glob("*.mlir-passes.log"):  # tens of MB each, always written
                log.unlink()
            (ptxas,) = dump.glob("*.ptxas")
            name = ptxas.name.removesuffix(".ptxas")
            sass = next(iter(dump.glob(f"{name}.sass*")), None)
            stats.append(
                parse(
                    re.sub(r"_\d+$", "", name),
                    ptxas.read_text(),
                    pathlib.Path(dump, f"{name}.ptx").read_text(),
                    None if sass is None else sass.read_text(),
                )
            )
        return stats


def table(rows: list[tuple[int, bool, KernelStats]]) -> str:
    lines = [
        "| kernel | H | causal | registers | spill stores / loads (B) | setmaxnreg | wgmma (PTX) | HGMMA (SASS) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for h, causal, s in rows:
        hgmma = "n/a" if s.hgmma is None else str(s.hgmma)
        lines.append(
            f"| {s.name} | {h} | {causal} | {s.registers} | {s.spill_stores} / {s.spill_loads} "
            f"| {', '.join(s.setmaxnreg) or '-'} | {s.wgmma} | {hgmma} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128], help="one or more of 64 128 256")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length T = S (a multiple of 128)")
    parser.add_argument("--backward", choices=("fused", "split"), default="fused", help="the backward's variant")
    parser.add_argument("--keep", help="leave the PTX / ptxas / SASS dumps in this folder")
    parser.add_argument("--compile-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_worker:
        _compile_worker(args.compile_worker)
        return 0
    if (why := missing()) is not None:
        print(f"mgpu_ptx: {why}", file=sys.stderr)
        return 2
    rows = []
    for h in args.head_dim:
        keep = None if args.keep is None else os.path.join(args.keep, f"h{h}")
        rows += [(h, args.causal, s) for s in compile_modules(lower(h, args.causal, args.seq, args.backward), keep)]
    print(f"ptxas: {ptxas_version()} (-arch=sm_90a, as MosaicGpuCompile runs it)\n")
    print(table(rows))
    return 1 if any(s.spill_stores or s.spill_loads for _, _, s in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
