"""The collectives of a lowered program, read from its StableHLO text.

shard_map lowers every collective with its mesh axes spelled out
(`replica_groups = #stablehlo.replica_group_mesh_axes<... axes = [..."tensor"...]>`) and its true
operand dtype, so the program itself says which technique communicates over which axis.
This reads each collective op once as written (a collective inside the layer scan appears once).
"""

from __future__ import annotations

import dataclasses
import math
import re

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")
_OP = re.compile(r'"stablehlo\.(' + "|".join(KINDS) + r')"\(')
_AXES = re.compile(r'axis_ref<name = "([^"]+)"')
_TENSOR = re.compile(r"tensor<([^>]*)>")
_BYTES = {
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "f64": 8,
    "i32": 4,
    "i64": 8,
    "i8": 1,
    "ui8": 1,
    "i16": 2,
    "ui16": 2,
    "ui32": 4,
    "i1": 1,
}


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]
    shape: tuple[int, ...]  # of the (first) operand, per device
    dtype: str

    @property
    def operand_bytes(self) -> int:
        return math.prod(self.shape) * _BYTES.get(self.dtype, 4)


def _parse_tensor(text: str) -> tuple[tuple[int, ...], str]:
    *dims, dtype = text.split("x") if text and text[0].isdigit() else [text]
    return tuple(int(d) for d in dims), dtype


_PAIRS = re.compile(r"source_target_pairs = dense<(\[\[.*?\]\])>")


def permute_axes(pairs, mesh_sizes) -> tuple[str, ...]:
    """Mesh axes a collective_permute moves data along: those whose coordinate differs between a
    source and its target (devices are numbered row-major over the mesh, as shard_map lowers them).
    `mesh_sizes` is ordered like the mesh axes."""
    names, sizes = list(mesh_sizes), [mesh_sizes[a] for a in mesh_sizes]

    def coords(i):
        out = []
        for size in reversed(sizes):
            out.append(i % size)
            i //= size
        return out[::-1]

    moved = set()
    for src, dst in pairs:
        moved.update(a for a, x, y in zip(names, coords(src), coords(dst)) if x != y)
    return tuple(a for a in names if a in moved)


def parse(stablehlo: str, mesh_sizes=None) -> list[Collective]:
    """Every collective op of a StableHLO module, in textual order. With `mesh_sizes` (ordered like
    the mesh), a collective_permute, which names no mesh axes, gets the axes its pairs move along."""
    lines = stablehlo.splitlines()
    found = []
    for i, line in enumerate(lines):
        match = _OP.search(line)
        if not match:
            continue
        signature = line
        j = i
        while " : (" not in signature and j + 1 < len(lines):  # ops with a reduction region
            j += 1
            if lines[j].lstrip().startswith("})"):
                signature = lines[j]
        operands = signature.split(" : (", 1)[1].split(") ->", 1)[0]
        shape, dtype = _parse_tensor(_TENSOR.search(operands).group(1))
        axes = tuple(_AXES.findall(line))
        pairs = _PAIRS.search(line)
        if match.group(1) == "collective_permute" and pairs and mesh_sizes:
            import json

            axes = permute_axes(json.loads(pairs.group(1)), mesh_sizes)
        found.append(Collective(match.group(1), axes, shape, dtype))
    return found


def kinds_by_axes(collectives) -> set[tuple[str, tuple[str, ...]]]:
    """{(kind, axes)} present in a program: a compact fingerprint of its communication."""
    return {(c.kind, c.axes) for c in collectives}
