"""The package's stated boundaries, checked on the source (an AST scan, nothing imported):

- every collective (psum, all_gather, ppermute, all_to_all, psum_scatter, axis_index, ...) is
  written in jaxsys/parallel/, under the name of its technique; the one exception is
  `lax.axis_index("name")` of an axis the same file declares as a Pallas kernel's own grid or
  thread axis (`grid_names=` / `thread_name=`, e.g. a Mosaic GPU kernel's block and warpgroup
  index, for which Pallas has no other API): that names no device mesh;
- `jax.shard_map` is built in one place, jaxsys/parallel/spmd.py (`per_shard`);
- no import circle among jaxsys's modules (function-level imports count: a circle hidden in a
  function is still a circle).
"""

from __future__ import annotations

import ast
import os

from tests.helpers import ROOT

COLLECTIVES = {
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "all_gather_invariant",
    "psum_scatter",
    "ppermute",
    "pshuffle",
    "pswapaxes",
    "all_to_all",
    "ragged_all_to_all",
    "axis_index",
    "psend",
    "precv",
}
PARALLEL = os.path.join("jaxsys", "parallel")
SPMD = os.path.join("jaxsys", "parallel", "spmd.py")


def library_files():
    """(path relative to the repository, module name) of every library module: jaxsys/ and the
    top-level kernels/ folder, which installs as jaxsys.kernels."""
    for top, package in (("jaxsys", "jaxsys"), ("kernels", "jaxsys.kernels")):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(folder, name), ROOT)
                parts = os.path.relpath(os.path.join(folder, name), os.path.join(ROOT, top))[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                yield rel, ".".join([package, *parts])


def _parse(rel: str) -> ast.Module:
    with open(os.path.join(ROOT, rel)) as f:
        return ast.parse(f.read(), rel)


def _lax_names(tree: ast.Module) -> set[str]:
    """Names bound to jax.lax or to a collective imported from it in this module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("jax", "jax.lax"):
            for alias in node.names:
                if (node.module == "jax" and alias.name == "lax") or alias.name in COLLECTIVES:
                    names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "jax.lax" and alias.asname:
                    names.add(alias.asname)
    return names


def _kernel_axis_names(tree) -> set[str]:
    """String axis names given as `grid_names=(...)` or `thread_name=...` in any call of the file:
    a Pallas kernel's own grid / thread axes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in ("grid_names", "thread_name"):
            values = node.value.elts if isinstance(node.value, (ast.Tuple, ast.List)) else [node.value]
            names |= {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return names


def collective_calls(rel: str) -> list[str]:
    """`lax.<collective>` / `jax.lax.<collective>` / a collective imported from jax.lax, used in `rel`."""
    return _collective_hits(_parse(rel), rel)


def _collective_hits(tree, rel: str) -> list[str]:
    lax = _lax_names(tree)
    kernel_axes = _kernel_axis_names(tree)
    exempt = {
        id(node.func)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "axis_index"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value in kernel_axes
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            base = node.value
            if (isinstance(base, ast.Name) and base.id in lax) or (
                isinstance(base, ast.Attribute) and base.attr == "lax"
            ):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id in lax and node.id in COLLECTIVES:
            found.append(f"{rel}:{node.lineno} {node.id}")
    return found


def shard_map_uses(rel: str) -> list[str]:
    """Every reference to shard_map (jax.shard_map, an import of it) in `rel`."""
    found = []
    for node in ast.walk(_parse(rel)):
        if isinstance(node, ast.Attribute) and node.attr == "shard_map":
            found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and any(a.name == "shard_map" for a in node.names):
            found.append(f"{rel}:{node.lineno} from {node.module} import shard_map")
    return found


def imports(rel: str, module: str, modules: set[str]) -> set[str]:
    """The jaxsys modules `rel` imports anywhere in it (module level or inside functions): `import
    a.b` -> a.b; `from a.b import c` -> a.b.c when that is a module, else a.b."""
    out = set()
    package = module if rel.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(_parse(rel)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                out.add(name if name in modules else base)
    return {m for m in out if m in modules and m != module}


def test_collectives_are_written_in_parallel_only():
    found = [
        hit for rel, _ in library_files() if not rel.startswith(PARALLEL + os.sep) for hit in collective_calls(rel)
    ]
    assert not found, "collectives outside jaxsys/parallel/ (write them there, under the technique's name):\n" + (
        "\n".join(found)
    )


def test_shard_map_is_built_in_one_place():
    found = [hit for rel, _ in library_files() if rel != SPMD for hit in shard_map_uses(rel)]
    assert not found, "shard_map outside jaxsys/parallel/spmd.py (use spmd.per_shard):\n" + "\n".join(found)
    assert shard_map_uses(SPMD), "jaxsys/parallel/spmd.py no longer builds the shard_map"


def test_the_scan_sees_what_it_must():
    """The scanner finds the forms it forbids (so the two tests above cannot pass vacuously)."""
    assert collective_calls(os.path.join(PARALLEL, "collectives.py"))  # lax.psum, lax.all_gather, ...
    assert any("ppermute" in hit for hit in collective_calls(os.path.join(PARALLEL, "context.py")))
    assert shard_map_uses(SPMD)
    # the kernel-axis exemption covers only axes declared as a kernel's grid / thread names
    src = (
        "from jax import lax\n"
        "def body():\n    return lax.axis_index('wg'), lax.axis_index('data'), lax.axis_index(name)\n"
        "kernel(body, grid_names=('q_tile',), thread_name='wg')\n"
    )
    hits = _collective_hits(ast.parse(src), "x.py")
    assert hits == ["x.py:3 lax.axis_index", "x.py:3 lax.axis_index"], hits


def test_every_package_is_installed():
    """pyproject's package list names every package of the library (a package left out is missing
    from the wheel: `import jaxsys.<it>` fails after `pip install jaxsys`)."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    packages = {module for rel, module in library_files() if rel.endswith("__init__.py")}
    assert packages - listed == set(), (
        f"add to pyproject.toml's [tool.setuptools] packages: {sorted(packages - listed)}"
    )


def test_no_import_circle():
    files = dict(library_files())
    modules = set(files.values())
    graph = {module: imports(rel, module, modules) for rel, module in files.items()}
    assert graph["jaxsys.program"], "the import scan found nothing: it is broken"
    state: dict = {}
    cycles = []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import circles in jaxsys:\n" + "\n".join(cycles)
