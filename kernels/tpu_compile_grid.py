"""The grid the kernels' TPU compile checks share (flash_attention/tpu_compile.py,
linear_attention/tpu_compile.py): targets x dtypes x (forward, forward + backward) x T x H, each
case compiled ahead of time for a TPU target's compile-only devices, a markdown table of compile
seconds, every failure listed, exit status 1 if any."""

from __future__ import annotations

import datetime
import importlib.metadata
import sys
import time

import jax
import numpy as np

CUSTOM_CALL = 'custom_call_target="tpu_custom_call"'
PASSES = (("fwd", False), ("fwd+bwd", True))


def tpu_mesh(target: str):
    """A one-axis ("data") mesh over the compile-only devices of a TPU target such as v5p:2x2x1."""
    from jaxsys.analysis import targets

    devices = targets.devices(targets.parse(target))
    return jax.sharding.Mesh(np.array(devices).reshape(-1), ("data",))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def add_grid_arguments(parser, head_dims_help: str = "") -> None:
    parser.add_argument("--targets", type=lambda s: s.split(","), default=["v5p:2x2x1", "v6e:2x2"])
    parser.add_argument("--seq-lens", type=_ints, default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--head-dims", type=_ints, default=[64, 128, 256], help=head_dims_help)
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])


def run_grid(args, check_case, title: str) -> int:
    """Compile every case with `check_case(mesh, t, h, dtype, backward)` (raises when the compiler
    refuses it or its HLO lacks the kernels), print the table under `title`, return the exit code."""
    import jax.numpy as jnp

    from jaxsys.analysis import targets

    cells, failures = {}, []
    start = time.time()
    for target in args.targets:
        mesh = tpu_mesh(target)
        for dtype in args.dtypes:
            for pass_name, backward in PASSES:
                for t in args.seq_lens:
                    for h in args.head_dims:
                        case = (target, dtype, pass_name, t, h)
                        t0 = time.time()
                        try:
                            with targets.quiet_libtpu():
                                check_case(mesh, t, h, jnp.dtype(dtype), backward)
                            cells[case] = f"{time.time() - t0:.1f} s"
                        except Exception as e:  # report every case, then fail at the end
                            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                            cells[case] = "FAIL"
                            failures.append((case, f"{type(e).__name__}: {first[:300]}"))
                        print(f"{' '.join(map(str, case))}: {cells[case]}", file=sys.stderr, flush=True)

    libtpu = importlib.metadata.version("libtpu")
    print(
        f"{title}, {datetime.date.today()}, jax {jax.__version__}, libtpu {libtpu}; compile seconds "
        "(lower + compile) per case\n"
    )
    print("| target | dtype | pass | T | " + " | ".join(f"H={h}" for h in args.head_dims) + " |")
    print("| --- | --- | --- | ---: | " + " | ".join("---:" for _ in args.head_dims) + " |")
    for target in args.targets:
        for dtype in args.dtypes:
            for pass_name, _ in PASSES:
                for t in args.seq_lens:
                    row = [cells[(target, dtype, pass_name, t, h)] for h in args.head_dims]
                    print(f"| {target} | {dtype} | {pass_name} | {t} | " + " | ".join(row) + " |")
    print(f"\n{len(cells)} cases, {len(failures)} failed, {time.time() - start:.0f} s in all")
    for case, message in failures:
        print(f"- FAIL {' '.join(map(str, case))}: {message}")
    return 1 if failures else 0
