"""Reading a compiled (optimised, scheduled) XLA HLO module: what the backend's compiler made of
the program, as opposed to the StableHLO jaxsys wrote (`collectives.py`).

    module = hlo.parse(compiled.as_text())
    module.collectives(mesh_sizes)   # every collective, with how often it runs and what overlaps it
    module.matmul_flops()            # FLOPs of every dot and convolution, loops included

Two things a compiler's own summaries get wrong for a training step, and this module gets right:
- XLA's cost analysis counts a while loop's body once; the layer scan runs it L times. Every
  instruction here carries its execution count: the product of the trip counts of the loops
  around it (read from each loop's condition, `i < N`).
- A collective that the compiler made asynchronous runs while the instructions scheduled between
  its start and done compute; those are listed, so the analysis can say whether, and behind how many
  FLOPs, each collective hides. Three forms: `*-start` / `*-done` pairs (all-gather-start,
  collective-permute-start, ...; XLA:GPU's `"is_sync":true` ones are synchronous), `async-start`
  wrapping a collective, and the TPU's async collective fusions (v5e): a start fusion (the gather's
  first step and an `AsyncCollectiveStart` custom-call), continuation fusions (one step of the gather
  fused with a matmul that does not need it) and a done fusion (`AsyncCollectiveDone`), chained by
  data flow. Each is one collective; the matmuls in its own continuation fusions count as hidden.
- Compute between a start and its done counts with everything it calls: a loop by its trip count,
  a fusion or call by its body, a conditional by its cheapest branch (the lower bound every device
  hides behind whichever branch it takes).

Conditionals (the pipeline's per-stage branches, ring attention's block cases) count their
heaviest branch per execution (most matmul FLOPs, then most collective bytes): in a lockstep SPMD
program every device waits for the device that takes it. The StableHLO count, by contrast, lists
every branch once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np

# Bytes per element; sub-byte types round up per element, which is wrong only for packed int4.
DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^{}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_NAME_EQ = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = ")
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\(")

COLLECTIVE_KINDS = {
    "all-reduce": "all_reduce",
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "all-to-all": "all_to_all",
    "collective-permute": "collective_permute",
    "ragged-all-to-all": "ragged_all_to_all",
}
# Instructions that do work a collective can hide behind (fusions hold the matmuls on TPU; GPU's
# fusion-start runs a fusion asynchronously).
_COMPUTE = {
    "fusion-start",
    "fusion",
    "convolution",
    "dot",
    "custom-call",
    "while",
    "call",
    "conditional",
    "sort",
    "reduce",
    "scatter",
    "gather",
    "select-and-scatter",
    "reduce-window",
}


@dataclasses.dataclass
class Array:
    dtype: str
    dims: tuple[int, ...]
    memory_space: int = 0  # the layout's S(n): 0 is HBM; TPU puts small buffers in on-chip memory

    @property
    def bytes(self) -> float:
        return math.prod(self.dims) * DTYPE_BYTES.get(self.dtype, 4)


def arrays(shape_text: str) -> list[Array]:
    """The arrays of a shape (one, or the elements of a tuple), with their memory space."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape_text):
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append(Array(dtype, tuple(int(d) for d in dims.split(",") if d), int(space.group(1)) if space else 0))
    return out


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at `start` (any of (), [], {})."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False

    def attr(self, key: str) -> str | None:
        """The raw value of `key=...` (up to the next top-level comma)."""
        m = re.search(r"(?:^|, )" + re.escape(key) + r"=", self.attrs)
        if not m:
            return None
        i, depth = m.end(), 0
        for j in range(i, len(self.attrs)):
            c = self.attrs[j]
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            elif c == "," and depth == 0:
                return self.attrs[i:j]
        return self.attrs[i:]

    def called(self) -> list[str]:
        """Computations this instruction calls (fusion bodies, loop bodies, branches, ...)."""
        out = []
        for key in ("calls", "body", "condition", "to_apply", "true_computation", "false_computation"):
            value = self.attr(key)
            if value:
                out += [v.strip().lstrip("%") for v in value.strip("{}").split(",")]
        branches = self.attr("branch_computations")
        if branches:
            out += [v.strip().lstrip("%") for v in branches.strip("{}").split(",")]
        return out


def _parse_instruction(line: str) -> Instruction | None:
    m = _NAME_EQ.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):  # tuple shape
        end = _matching(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = _OPCODE.match(rest)
    if not op:
        return None
    open_at = op.end() - 1
    close = _matching(rest, open_at)
    listed = re.sub(r"/\*.*?\*/", "", rest[open_at + 1 : close])  # /*index=5*/ markers
    operands = [o.strip().split(" ")[-1].lstrip("%") for o in listed.split(",") if o.strip()]
    attrs = rest[close + 1 :].lstrip(", ")
    return Instruction(m.group(2), shape, op.group(1), operands, attrs, root=bool(m.group(1)))


@dataclasses.dataclass
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, collective_permute, ...
    axes: tuple[str, ...]
    group_size: int
    operand_bytes: float  # per execution, per device (all operands of a combined collective)
    dtype: str
    executions: int  # per step (loop trip counts multiplied)
    is_async: bool
    overlapped_ops: int  # compute instructions scheduled between start and done
    overlapped_flops: float  # their matmul FLOPs, per execution
    computation: str
    name: str
    # how the schedule issues it: "sync", "start-done" (`*-start`/`*-done`, `async-start`),
    # "async-fusion" (the TPU's async collective fusions), "send" (a megascale DCN transfer)
    form: str = "sync"
    done: str | None = None  # the instruction that completes it (its result), when asynchronous


class Module:
    """A parsed HLO module: computations (instructions in schedule order) and execution counts."""

    def __init__(self, text: str):
        self.computations: dict[str, list[Instruction]] = {}
        self.entry = None
        current = None
        for line in text.splitlines():
            header = _HEADER.match(line)
            if header:
                current = header.group(2)
                self.computations[current] = []
                if header.group(1):
                    self.entry = current
                continue
            if line.startswith("}"):
                current = None
                continue
            if current is not None:
                inst = _parse_instruction(line)
                if inst is not None:
                    self.computations[current].append(inst)
        self.by_name = {c: {i.name: i for i in insts} for c, insts in self.computations.items()}
        # bodies of the TPU's async collective fusions and of async-starts wrapping a collective: their
        # collectives are counted once, at the start
        self.async_bodies = {
            c
            for insts in self.computations.values()
            for i in insts
            if self.async_fusion_role(i) or (i.opcode == "async-start" and self._collective_kind(i)[0])
            for c in i.called()
        }
        self.unknown_trip_counts = 0
        self.fused: set[str] = set()  # computations inlined into one kernel (fusion bodies, regions)
        self.executions = self._executions()

    # -- execution counts
    def _constant(self, computation: str, name: str) -> int | None:
        inst = self.by_name[computation].get(name)
        if inst is None or inst.opcode != "constant" or len(inst.operands) != 1:
            return None
        try:
            return int(inst.operands[0])
        except ValueError:
            return None

    def trip_count(self, computation: str, loop: Instruction) -> int | None:
        """Iterations of a while loop whose condition is `i < N` (i from a constant init, step 1),
        or `known_trip_count` where the compiler wrote it."""
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
        if known:
            return int(known.group(1))
        cond = (loop.attr("condition") or "").lstrip("%")
        insts = self.by_name.get(cond, {})
        root = next((i for i in self.computations.get(cond, []) if i.root), None)
        if root is None or root.opcode != "compare" or len(root.operands) != 2:
            return None
        direction = root.attr("direction")
        a, b = (insts.get(o) for o in root.operands)
        if a is None or b is None:
            return None
        if a.opcode == "constant" and b.opcode == "get-tuple-element":
            a, b = b, a
            direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
        if a.opcode != "get-tuple-element" or b.opcode != "constant":
            return None
        limit = self._constant(cond, b.name)
        index = int(a.attr("index") or 0)
        init = 0
        tuple_init = self.by_name[computation].get(loop.operands[0]) if loop.operands else None
        if tuple_init is not None and tuple_init.opcode == "tuple" and index < len(tuple_init.operands):
            value = self._constant(computation, tuple_init.operands[index])
            init = 0 if value is None else value
        if limit is None:
            return None
        if direction == "LT":
            return max(limit - init, 0)
        if direction == "LE":
            return max(limit - init + 1, 0)
        return None

    def _executions(self) -> dict[str, int]:
        """Executions per step of each computation reachable from the entry: a loop body the trip
        count times; of a conditional's branches only the heaviest (`branch_cost`), which every
        device waits for in a lockstep SPMD program."""
        counts: dict[str, int] = {}
        self.conditionals = 0

        def visit(comp: str, times: int):
            if comp not in self.computations:
                return
            counts[comp] = counts.get(comp, 0) + times
            for inst in self.computations[comp]:
                if inst.opcode == "while":
                    trip = self.trip_count(comp, inst)
                    if trip is None:
                        self.unknown_trip_counts += 1
                        trip = 1
                    visit((inst.attr("body") or "").lstrip("%"), times * trip)
                elif inst.opcode == "conditional":
                    branches = [c for c in inst.called() if c in self.computations]
                    if branches:
                        self.conditionals += 1
                        visit(max(branches, key=self.branch_cost), times)
                else:
                    for callee in inst.called():
                        if inst.opcode in (
                            "all-reduce",
                            "reduce-scatter",
                            "reduce",
                            "sort",
                            "scatter",
                            "reduce-window",
                            "select-and-scatter",
                            "map",
                        ):
                            self.fused.add(callee)
                            continue  # reduction regions: scalar code, not program structure
                        if inst.opcode == "fusion":
                            self.fused.add(callee)
                        visit(callee, times)

        if self.entry:
            visit(self.entry, 1)
        return counts

    def branch_cost(self, comp: str) -> tuple[float, float]:
        """(matmul FLOPs, collective operand bytes) of one execution of `comp` with everything it
        calls (loops by their trip counts, nested conditionals by their heaviest branch)."""
        cache = self.__dict__.setdefault("_branch_costs", {})
        if comp in cache:
            return cache[comp]
        cache[comp] = (0.0, 0.0)  # a recursion guard; HLO has no recursion
        flops = moved = 0.0
        for inst in self.computations.get(comp, []):
            flops += self.instruction_flops(comp, inst)
            if self._collective_kind(inst)[0] is not None:
                moved += self._operand_bytes(comp, inst)[0]
            callees = [c for c in inst.called() if c in self.computations]
            if inst.opcode == "while":
                body = (inst.attr("body") or "").lstrip("%")
                f, b = self.branch_cost(body)
                trip = self.trip_count(comp, inst) or 1
                flops, moved = flops + trip * f, moved + trip * b
            elif inst.opcode == "conditional" and callees:
                f, b = max(self.branch_cost(c) for c in callees)
                flops, moved = flops + f, moved + b
            elif inst.opcode in ("fusion", "call", "async-start", "custom-call"):
                for c in callees:
                    f, b = self.branch_cost(c)
                    flops, moved = flops + f, moved + b
        cache[comp] = (flops, moved)
        return cache[comp]

    # -- FLOPs
    def instruction_flops(self, comp: str, inst: Instruction) -> float:
        """Matmul FLOPs of one execution of `inst` (a dot, a convolution, a Pallas call with a cost
        estimate); 0 for anything else."""
        if inst.opcode == "dot":
            out = arrays(inst.shape)[0]
            lhs = self._operand_array(comp, inst, 0)
            if lhs is None:
                return 0.0
            contracting = [int(d) for d in (inst.attr("lhs_contracting_dims") or "{}").strip("{}").split(",") if d]
            return 2.0 * math.prod(out.dims) * math.prod(lhs.dims[d] for d in contracting)
        if inst.opcode == "convolution":
            return self._convolution_flops(comp, inst)
        if inst.opcode == "custom-call":
            m = re.search(r'"flops":\s*"?(\d+)', inst.attrs)
            return float(m.group(1)) if m else 0.0
        return 0.0

    def _operand_array(self, comp: str, inst: Instruction, i: int) -> Array | None:
        if i >= len(inst.operands):
            return None
        src = self.by_name[comp].get(inst.operands[i])
        if src is None:
            return None
        found = arrays(src.shape)
        return found[0] if found else None

    def _convolution_flops(self, comp: str, inst: Instruction) -> float:
        """2 x the multiply-adds that land on real (not padded, not dilated-hole) inputs, as XLA's
        HloCostAnalysis counts them."""
        lhs, rhs = self._operand_array(comp, inst, 0), self._operand_array(comp, inst, 1)
        out = arrays(inst.shape)[0]
        labels = inst.attr("dim_labels")
        if lhs is None or rhs is None or not labels:
            return 0.0
        lhs_l, rest = labels.split("_", 1)
        rhs_l, out_l = rest.split("->")
        spatial = sorted(c for c in lhs_l if c.isdigit())
        window = _window(inst.attr("window") or "", len(spatial))
        counts = []
        for s, w in zip(spatial, window):
            counts.append(
                _valid_positions(lhs.dims[lhs_l.index(s)], rhs.dims[rhs_l.index(s)], out.dims[out_l.index(s)], **w)
            )
        groups = int(inst.attr("feature_group_count") or 1)
        batch_groups = int(inst.attr("batch_group_count") or 1)
        fma = (
            (lhs.dims[lhs_l.index("f")] // groups)
            * out.dims[out_l.index("f")]
            * (lhs.dims[lhs_l.index("b")] // batch_groups)
            * math.prod(counts)
        )
        return 2.0 * fma

    def matmul_flops(self) -> float:
        """Matmul FLOPs of one step: every dot and convolution (inside fusions too), times the
        executions of its computation."""
        total = 0.0
        for comp, times in self.executions.items():
            for inst in self.computations[comp]:
                total += times * self.instruction_flops(comp, inst)
        return total

    def window_flops(self, comp: str, inst: Instruction) -> float:
        """Matmul FLOPs that one execution of `inst` surely does, everything it calls included: a
        loop times its trip count (1 when unknown), a conditional its cheapest branch. What a
        collective whose start and done enclose `inst` can hide behind."""
        if inst.opcode == "while":
            trip = self.trip_count(comp, inst) or 1
            return trip * self.computation_flops((inst.attr("body") or "").lstrip("%"))
        callees = [c for c in inst.called() if c in self.computations]
        if inst.opcode == "conditional":
            return min((self.computation_flops(c) for c in callees), default=0.0)
        return self.instruction_flops(comp, inst) + sum(self.computation_flops(c) for c in callees)

    def computation_flops(self, comp: str) -> float:
        """`window_flops` of every instruction of `comp`, summed (one execution of `comp`)."""
        cache = self.__dict__.setdefault("_computation_flops", {})
        if comp not in cache:
            cache[comp] = 0.0  # a recursion guard; HLO has no recursion
            cache[comp] = sum(self.window_flops(comp, i) for i in self.computations.get(comp, []))
        return cache[comp]

    # -- memory traffic
    _NO_TRAFFIC = {
        "parameter",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "constant",
        "while",
        "conditional",
        "call",
        "after-all",
        "partition-id",
        "replica-id",
        "copy-done",
        "async-start",
        "async-done",
        "async-update",
        "opt-barrier",
    }
    _SLICING = {"dynamic-slice", "slice", "gather"}

    def _hbm(self, shape_text: str) -> float:
        return sum(a.bytes for a in arrays(shape_text) if a.memory_space == 0)

    def _kernel_traffic(self, comp: str, inst: Instruction) -> float:
        """HBM bytes one execution of a kernel moves, as XLA's cost analysis counts them: its
        results written and its operands read, except that an operand only sliced (dynamic-slice,
        slice, gather) costs the slices, and a result updated in place (a dynamic-update-slice into
        an operand: the layer scan's stacked buffers) costs the update, not the buffer."""
        names = self.by_name[comp]
        operands = [names.get(o) for o in inst.operands]
        if inst.opcode == "dynamic-update-slice":
            return 2 * self._hbm(operands[1].shape) if len(operands) > 1 and operands[1] is not None else 0.0
        if inst.opcode in self._SLICING:
            return 2 * self._hbm(inst.shape)
        body = self.computations.get((inst.attr("calls") or "").lstrip("%"), []) if inst.opcode == "fusion" else []
        if not body:
            return self._hbm(inst.shape) + sum(self._hbm(o.shape) for o in operands if o is not None)
        fused = {b.name: b for b in body}

        def through(b):  # look through bitcasts to the instruction that makes the value
            return through(fused[b.operands[0]]) if b.opcode == "bitcast" and b.operands[0] in fused else b

        root = next(b for b in body if b.root)
        outputs = [fused[o] for o in root.operands if o in fused] if root.opcode == "tuple" else [root]
        written, in_place = 0.0, set()
        for out in outputs:
            target = through(out)
            if target.opcode == "dynamic-update-slice" and len(target.operands) > 1:
                buffer = through(fused[target.operands[0]]) if target.operands[0] in fused else None
                if buffer is not None and buffer.opcode == "parameter":
                    in_place.add(buffer.name)
                update = fused.get(target.operands[1])
                if update is not None and self._hbm(out.shape):
                    written += 2 * sum(a.bytes for a in arrays(update.shape))
                continue
            written += self._hbm(out.shape)
        read = 0.0
        for k, src in enumerate(operands):
            param = next((b for b in body if b.opcode == "parameter" and b.operands == [str(k)]), None)
            if src is None or (param is not None and param.name in in_place):
                continue
            read += self._operand_read(body, param, src)
        return written + read

    def _operand_read(self, body, param, src: Instruction) -> float:
        """Bytes read of a kernel operand: the slices taken of it when the fusion only slices it."""
        full = self._hbm(src.shape)
        if param is None or full == 0:
            return full
        frontier, users = [param.name], []
        while frontier:  # users, looking through bitcasts
            name = frontier.pop()
            for b in body:
                if name in b.operands:
                    if b.opcode == "bitcast":
                        frontier.append(b.name)
                    else:
                        users.append((b, name))
        if users and all(u.opcode in self._SLICING and u.operands[0] == name for u, name in users):
            return min(full, sum(sum(a.bytes for a in arrays(u.shape)) for u, _ in users))
        return full

    def hbm_bytes(self) -> float:
        """HBM traffic of one step, estimated as XLA's cost analysis does for a fused program:
        every kernel (fusion, or an unfused instruction) reads its operands and writes its
        result once (sliced operands and in-place updates at their real size, `_kernel_traffic`);
        arrays the layout places in on-chip memory (S(n), n > 0) are not counted; asynchronous
        copies count their HBM side; loop trip counts applied."""
        total = 0.0
        for comp, times in self.executions.items():
            if comp in self.fused:
                continue
            names = self.by_name[comp]
            for inst in self.computations[comp]:
                if inst.opcode in self._NO_TRAFFIC or (inst.opcode.endswith("-done")):
                    continue
                if inst.opcode == "copy-start":  # a prefetch into (or eviction out of) on-chip memory
                    src = names.get(inst.operands[0]) if inst.operands else None
                    dst = arrays(inst.shape)[:1]
                    total += times * (
                        (self._hbm(src.shape) if src is not None else 0.0)
                        + sum(a.bytes for a in dst if a.memory_space == 0)
                    )
                    continue
                if inst.opcode in (
                    "all-reduce",
                    "all-gather",
                    "reduce-scatter",
                    "all-to-all",
                    "collective-permute",
                ) or inst.opcode.endswith("-start"):
                    continue  # the wire, not HBM bandwidth, bounds a collective
                total += times * self._kernel_traffic(comp, inst)
        return total

    # -- collectives
    def async_fusion_role(self, inst: Instruction) -> str | None:
        """Which part of a TPU async collective fusion `inst` is ("start", "continuation" or "done"),
        or None: a continuation says so in its backend config, a start or done by the custom-call
        (`AsyncCollectiveStart` / `AsyncCollectiveDone`) in its body."""
        if inst.opcode != "fusion":
            return None
        if "continuation_config" in inst.attrs:
            return "continuation"
        roles = self.__dict__.get("_async_roles")
        if roles is None:  # the bodies holding the custom-calls, found once
            roles = self._async_roles = {}
            for comp, insts in self.computations.items():
                for sub in insts:
                    if sub.opcode == "custom-call" and 'custom_call_target="AsyncCollectiveStart"' in sub.attrs:
                        roles[comp] = "start"
                    elif sub.opcode == "custom-call" and 'custom_call_target="AsyncCollectiveDone"' in sub.attrs:
                        roles[comp] = "done"
        return next((roles[c] for c in inst.called() if c in roles), None)

    def _is_compute(self, inst: Instruction) -> bool:
        """Whether `inst` does work a collective in flight can hide behind (not another collective)."""
        if self.async_fusion_role(inst) in ("start", "done"):
            return False
        if inst.opcode == "async-start":
            return self._collective_kind(inst)[0] is None
        return inst.opcode in _COMPUTE

    def _fusion_done(self, insts: list[Instruction], k: int) -> str | None:
        """The done fusion of the async collective fusion started by insts[k], followed through the
        data flow of the collective's state (get-tuple-element, bitcast, continuation fusions), not
        by name. A continuation fusion also carries its matmul's operands and result (its
        `continuation_config` names their index ranges): those lead to other chains, not followed."""
        by_name = {i.name: i for i in insts}

        def ranges(inst: Instruction, key: str) -> range:
            m = re.search(rf'"{key}_original_start":"(\d+)","{key}_original_end":"(\d+)"', inst.attrs)
            return range(int(m.group(1)), int(m.group(2)) + 1) if m else range(0)

        users: dict[str, list[Instruction]] = {}
        for later in insts[k + 1 :]:
            for o in later.operands:
                users.setdefault(o, []).append(later)
        todo, seen = [insts[k].name], set()
        while todo:
            name = todo.pop()
            for user in users.get(name, []):
                role = self.async_fusion_role(user)
                if role == "continuation":
                    matmul_operands = ranges(user, "operand")
                    if all(i in matmul_operands for i, o in enumerate(user.operands) if o == name):
                        continue
                elif user.opcode == "get-tuple-element":
                    source = by_name.get(user.operands[0])
                    if source is not None and self.async_fusion_role(source) == "continuation":
                        if int(user.attr("index") or 0) in ranges(source, "output_tuple"):
                            continue
                elif role == "done":
                    return user.name
                elif user.opcode != "bitcast":
                    continue
                if user.name not in seen:
                    seen.add(user.name)
                    todo.append(user.name)
        return None

    def collectives(self, mesh_sizes: dict, dcn: dict | None = None) -> list[Collective]:
        """Every collective of the step: kind, mesh axes, bytes, executions, and for asynchronous
        ones what is scheduled between start and done (the module docstring's three forms).
        Across TPU slices the compiler hands the DCN part of a collective to the megascale runtime
        as a host-transfer `send` (frontend attribute `_xla_megascale_transfer_type`); it is
        counted over the mesh axes with a `dcn` factor, among the slices."""
        dcn_axes = tuple(a for a in mesh_sizes if (dcn or {}).get(a, 1) > 1)
        slices = math.prod((dcn or {}).get(a, 1) for a in dcn_axes)
        out = []
        for comp, times in self.executions.items():
            if comp in self.async_bodies:  # counted at the start that wraps them
                continue
            insts = self.computations[comp]
            position = {inst.name: k for k, inst in enumerate(insts)}

            def window(k: int, done: str | None) -> tuple[int, float]:
                """(compute instructions, their matmul FLOPs) from insts[k] to `done`: to the end of
                the computation when the done lies elsewhere (a collective carried across a loop)."""
                between = insts[k + 1 : position[done]] if done in position else insts[k + 1 :]
                compute = [b for b in between if self._is_compute(b)]
                return len(compute), sum(self.window_flops(comp, b) for b in compute)

            for k, inst in enumerate(insts):
                megascale = re.search(r'_xla_megascale_transfer_type="(\w+)"', inst.attrs)
                if inst.opcode == "send" and megascale:
                    done = next(
                        (
                            later.name
                            for later in insts[k + 1 :]
                            if later.opcode == "send-done" and inst.name in later.operands
                        ),
                        None,
                    )
                    ops, flops = window(k, done) if done is not None else (0, 0.0)
                    operand_bytes, dtype = self._operand_bytes(comp, inst, arrays_only=True)
                    out.append(
                        Collective(
                            megascale.group(1).lower(),
                            dcn_axes,
                            slices,
                            operand_bytes,
                            dtype,
                            times,
                            done is not None,
                            ops,
                            flops,
                            comp,
                            inst.name,
                            "send",
                            done,
                        )
                    )
                    continue
                if self.async_fusion_role(inst) == "start":
                    body = next((c for c in inst.called() if c in self.computations), "")
                    steps = [sub for sub in self.computations.get(body, []) if sub.opcode in COLLECTIVE_KINDS]
                    if not steps:
                        continue
                    first = steps[0]
                    done = self._fusion_done(insts, k)
                    ops, flops = window(k, done)
                    operand_bytes, dtype = self._operand_bytes(body, first)
                    axes, size = _group(first, mesh_sizes)
                    out.append(
                        Collective(
                            COLLECTIVE_KINDS[first.opcode],
                            axes,
                            size,
                            operand_bytes,
                            dtype,
                            times,
                            True,
                            ops,
                            flops,
                            comp,
                            inst.name,
                            "async-fusion",
                            done,
                        )
                    )
                    continue
                kind, body = self._collective_kind(inst)
                if kind is None:
                    continue
                if kind == "all_reduce" and comp.startswith("all-reduce-scatter"):
                    # XLA TPU's reduce-scatter emitter: all-reduce + dynamic-slice fused into one
                    # kernel that moves a reduce-scatter's bytes
                    kind = "reduce_scatter"
                started = inst.opcode.endswith("-start")
                done = self._done_of(insts, k, inst) if started else None
                # XLA:GPU marks start/done pairs it runs synchronously (is_sync): nothing overlaps them
                is_async = started and '"is_sync":true' not in inst.attrs
                ops, flops = window(k, done) if is_async else (0, 0.0)
                operand_bytes, dtype = self._operand_bytes(comp, inst)
                axes, size = _group(body or inst, mesh_sizes)
                out.append(
                    Collective(
                        kind,
                        axes,
                        size,
                        operand_bytes,
                        dtype,
                        times,
                        is_async,
                        ops,
                        flops,
                        comp,
                        inst.name,
                        "start-done" if is_async else "sync",
                        done,
                    )
                )
        return out

    def _collective_kind(self, inst: Instruction):
        op = inst.opcode
        if op.endswith("-done"):
            return None, None
        base = op[: -len("-start")] if op.endswith("-start") else op
        if base in COLLECTIVE_KINDS:
            return COLLECTIVE_KINDS[base], None
        if op == "async-start":
            for callee in inst.called():
                for sub in self.computations.get(callee, []):
                    if sub.opcode in COLLECTIVE_KINDS:
                        return COLLECTIVE_KINDS[sub.opcode], sub
        return None, None

    @staticmethod
    def _done_of(insts, k, start):
        if not (start.opcode.endswith("-start")):
            return None
        for later in insts[k + 1 :]:
            if later.opcode.endswith("-done") and start.name in later.operands:
                return later.name
        return None

    def _operand_bytes(self, comp: str, inst: Instruction, arrays_only: bool = False) -> tuple[float, str]:
        total, dtype = 0.0, ""
        for name in inst.operands:
            src = self.by_name[comp].get(name)
            if src is None or (arrays_only and src.opcode == "after-all"):  # a send's token
                continue
            for a in arrays(src.shape):
                total += a.bytes
                dtype = dtype or a.dtype
        return total, dtype


def _window(text: str, n: int) -> list[dict]:
    """Per spatial dimension: size, stride, padding, base (lhs) and window (rhs) dilation."""
    fields = dict(re.findall(r"(\w+)=([^ ]+)", text.strip("{}")))

    def split(key, default, cast=int):
        if key not in fields:
            return [default] * n
        return [cast(v) for v in fields[key].split("x")]

    pads = [tuple(int(p) for p in v.split("_")) for v in fields["pad"].split("x")] if "pad" in fields else [(0, 0)] * n
    sizes = split("size", 1)
    return [
        dict(stride=st, pad_low=p[0], base_dilation=bd, window_dilation=wd)
        for _, st, p, bd, wd in zip(sizes, split("stride", 1), pads, split("lhs_dilate", 1), split("rhs_dilate", 1))
    ]


def _valid_positions(
    n_in: int, n_kernel: int, n_out: int, *, stride: int, pad_low: int, base_dilation: int, window_dilation: int
) -> int:
    """(output, kernel) index pairs of one spatial dimension that read a real input element."""
    o = np.arange(n_out, dtype=np.int64)[None, :]
    k = np.arange(n_kernel, dtype=np.int64)[:, None]
    undilated = o * stride - pad_low + k * window_dilation
    ok = (undilated % base_dilation == 0) & (undilated >= 0) & (undilated // base_dilation < n_in)
    return int(ok.sum())


_MESH_GROUPS = re.compile(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{(.*?)\}\}")


def _group(inst: Instruction, mesh_sizes: dict) -> tuple[tuple[str, ...], int]:
    """(mesh axes, devices per group) of a collective, from `replica_groups=mesh[...] {axes}`, the
    explicit `{{0,1},...}` / iota forms (axes from the devices' mesh coordinates), or a
    collective-permute's source-target pairs (the axes its pairs move along; group size 2)."""
    from jaxsys.analysis.collectives import permute_axes

    names = list(mesh_sizes)
    m = _MESH_GROUPS.search(inst.attrs)
    if m:
        axes = tuple(a.strip().strip("'") for a in m.group(2).split(",") if a.strip())
        return tuple(a for a in names if a in axes), math.prod(mesh_sizes[a] for a in axes)
    pairs = _PAIRS.search(inst.attrs)
    if pairs:
        found = [tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)", "{" + pairs.group(1) + "}}")]
        return permute_axes(found, mesh_sizes), 2
    groups = inst.attr("replica_groups")
    if groups and groups.startswith("{{"):
        members = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]+)\}", groups)]
        if members:
            pairs = [(g[0], x) for g in members for x in g[1:]]
            return permute_axes(pairs, mesh_sizes), len(members[0])
    iota = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", groups or "")
    if iota:  # [groups, size]<=[dims]T(perm): iota over dims, transposed, split into groups
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        grid = ids.reshape(int(iota.group(1)), int(iota.group(2)))
        pairs = [(int(g[0]), int(x)) for g in grid for x in g[1:]]
        return permute_axes(pairs, mesh_sizes), grid.shape[1]
    return (), math.prod(mesh_sizes.values())


def parse(text: str) -> Module:
    return Module(text)


def dump_json(collectives: list[Collective]) -> str:
    return json.dumps([dataclasses.asdict(c) for c in collectives])
