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
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i32": 4, "i64": 8, "i8": 1, "ui8": 1,
          "i16": 2, "ui16": 2, "ui32": 4, "i1": 1}


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


def parse(stablehlo: str) -> list[Collective]:
    """Every collective op of a StableHLO module, in textual order."""
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
        found.append(Collective(match.group(1), tuple(_AXES.findall(line)), shape, dtype))
    return found


def kinds_by_axes(collectives) -> set[tuple[str, tuple[str, ...]]]:
    """{(kind, axes)} present in a program: a compact fingerprint of its communication."""
    return {(c.kind, c.axes) for c in collectives}
