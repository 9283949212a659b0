"""Goodput: the share of the wall time since launch that trained, and where the rest went
(docs/goodput.md).

    goodput = productive step time / wall time since `jaxsys.train.main` was called

as MaxText records it (its badput kinds: program startup, compilation, data loading, checkpoint
saving and loading, wasted progress after a disruption). The training loop times the other kinds
where they happen; the productive step time is the loop's wall time less the pauses inside it
(waiting for a batch, evaluation, checkpoint saves, expert re-placement, ...), so the dispatch and
host work of the steps counts as training. What no kind claims (building the program, reading the
corpus, the startup report, logging after the loop) is `other`.

Kinds (seconds each): `compile` (the train step's ahead-of-time compile; evaluation's compile is
in `eval`), `init` (a fresh state), `restore` (recovery: reading the checkpoint or in-memory snapshot
a restart resumes from), `data_wait` (the loop waiting for its next batch), `checkpoint` (saves),
`snapshot` (in-memory snapshots, docs/fault_tolerance.md), `eval`, `other`.
A restart also reports `lost_steps`: steps the previous launch logged after its last checkpoint,
trained again now.
"""

from __future__ import annotations

import contextlib
import time

KINDS = ("compile", "init", "restore", "data_wait", "checkpoint", "snapshot", "eval", "other")


class Goodput:
    """A stopwatch by kind, started at launch. `timed(kind)` around a badput; `loop_started()` /
    `loop_ended()` around the step loop."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.launch = clock()
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.loop_start: float | None = None
        self.loop_end: float | None = None
        self.in_loop = 0.0  # badput seconds inside the step loop
        self.lost_steps = 0

    @contextlib.contextmanager
    def timed(self, kind: str):
        start = self.clock()
        try:
            yield
        finally:
            self.add(kind, self.clock() - start)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds
        if self.loop_start is not None and self.loop_end is None:
            self.in_loop += seconds

    def loop_started(self) -> None:
        self.loop_start = self.clock()

    def loop_ended(self) -> None:
        self.loop_end = self.clock()

    def productive(self, now: float) -> float:
        """Step time so far: the loop's wall time less the badput inside it."""
        if self.loop_start is None:
            return 0.0
        end = self.loop_end if self.loop_end is not None else now
        return max(0.0, end - self.loop_start - self.in_loop)

    def record(self) -> dict:
        """{"goodput", "wall_s", "step_s", "<kind>_s", ...} now."""
        now = self.clock()
        wall = now - self.launch
        steps = self.productive(now)
        out = {"goodput": steps / wall if wall > 0 else 0.0, "wall_s": wall, "step_s": steps}
        out.update({f"{k}_s": v for k, v in self.seconds.items() if k != "other"})
        out["other_s"] = max(0.0, wall - steps - sum(self.seconds.values()))
        if self.lost_steps:
            out["lost_steps"] = self.lost_steps
        return out

    @staticmethod
    def line(record: dict) -> str:
        """One printed line of `record()`."""
        parts = ", ".join(f"{k[:-2].replace('_', ' ')} {record[k]:.1f} s" for k in record if k.endswith("_s"))
        lost = f", {record['lost_steps']} steps trained again" if record.get("lost_steps") else ""
        return f"goodput {record['goodput']:.2f} ({parts}){lost}"
