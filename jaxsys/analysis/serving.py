"""The serving cost model: what a step of the continuous-batching engine and a request's prefill
cost, in seconds on a hardware profile (analysis/hardware.py), before running them.

    cost = CostModel.for_configs(prefill_config, decode_config)   # where a prompt is cheapest
    side, shard = cost.place(tokens, prefill_queue, shards)       # disaggregated placement
    seconds = step_seconds(config, hw, shard_rows)                # one engine step, modelled

`step_seconds` is the decode analysis's step roofline (`decode.DecodeStep`, the formula the decode
report prices its rows with), applied to the rows of an engine step, prefill chunks included.
`CostModel` prices the placement of disaggregated serving (jaxsys/serve/disagg.py, DistServe /
semi-PD): a prompt's prefill on the prefill sub-mesh plus the KV handoff
(`decode.kv_transfer_bytes`), or colocated on a decode batch shard beside its running decodes.
Formulas only: nothing is compiled or run.
"""

from __future__ import annotations

import dataclasses
import math

from jaxsys.analysis import flops as flops_lib
from jaxsys.analysis import hardware
from jaxsys.analysis.decode import DecodeStep, cached_weight_bytes, kv_transfer_bytes
from jaxsys.config import MESH_AXES


@dataclasses.dataclass
class CostModel:
    """Where a request's prefill is cheapest, from predicted times in seconds (one request of T
    prompt tokens; chunks of C tokens; a side's step cannot be faster than reading its weights):

        F(T)          = T x forward_flops_per_token(T / 2)     2 N_matmul + causal attention per token
        prefill_x(T)  = max(F(T) / flops_x, ceil(T / C) x floor_x)     floor_x = weights per device / HBM bw
        transfer(T)   = kv_transfer_bytes(T) / link + latency          (analysis/decode.py)
        stall_d(T)    = max(0, F(T) / flops_d - ceil(T / C) x floor_d)
        prefill side:               queue_p + prefill_p(T) + transfer(T)
        colocated on decode shard d: queue_d + prefill_d(T) + interference x running_d x stall_d(T)

    queue = the matmul FLOPs (2 N_matmul per token) of the prompt tokens waiting on that side (or
    shard) over its FLOP/s. stall_d is what the prompt's chunks add to the steps of the shard's
    running decodes beyond the weight read those memory-bound steps pay anyway (Sarathi's
    piggybacking: a short chunk rides along for free), and every running decode waits that long;
    `interference` weighs those seconds of other requests' TPOT against this request's TTFT. So: an
    idle prefill side takes a prompt (more devices, no decodes to stall); behind a long prefill
    queue a short prompt piggybacks on a decode shard (its stall is ~0); a long prompt beside many
    running decodes stays on the prefill side even behind a queue. A prefill-side request decodes
    on the decode shard with the most free pages. Weak: constant MFU, no per-step dispatch overhead,
    queues by FLOPs only, one uncontended link.
    """

    model: object  # config.model
    page_size: int
    chunk_size: int
    prefill_flops_per_s: float  # the whole prefill sub-mesh, at the assumed MFU
    decode_shard_flops_per_s: float  # one decode batch shard
    prefill_floor_s: float  # a prefill step's weight read (per device, in parallel)
    decode_floor_s: float  # a decode step's weight read
    link_bytes_per_s: float
    link_latency_s: float = 20e-6
    interference: float = 1.0
    placement: str = "cost"

    @classmethod
    def for_configs(cls, prefill_config, decode_config, hw=None, mfu: float = 0.5, **kw) -> "CostModel":
        """Priced on hardware profile `hw` (default config.serve.hardware) for the two layouts."""
        from jaxsys.sharding import Layout

        hw = hw or hardware.profile(prefill_config.serve.hardware)
        peak = hw.peak(prefill_config.model.compute_dtype) * mfu
        n_pre = math.prod(prefill_config.mesh[a] for a in MESH_AXES)
        n_dec = math.prod(decode_config.mesh[a] for a in MESH_AXES)
        lay = Layout.from_config(decode_config)
        shards = lay.size(lay.compute_axes("batch"))
        sv = prefill_config.serve
        kw.setdefault("interference", float(sv.interference))
        kw.setdefault("placement", sv.placement)
        return cls(
            prefill_config.model,
            sv.page_size,
            sv.chunk_size,
            peak * n_pre,
            peak * n_dec / shards,
            cached_weight_bytes(prefill_config) / hw.hbm_bytes_per_s,
            cached_weight_bytes(decode_config) / hw.hbm_bytes_per_s,
            hw.intra_node_bytes_per_s,
            **kw,
        )

    def prefill_flops(self, tokens: float) -> float:
        return tokens * flops_lib.forward_flops_per_token(self.model, tokens / 2)

    def queue_flops(self, tokens: float) -> float:
        """Prompt tokens queued (of several requests): their matmuls, 2 N_matmul each."""
        return tokens * flops_lib.forward_flops_per_token(self.model, 0)

    def transfer_bytes(self, tokens: int) -> int:
        return kv_transfer_bytes(self.model, tokens, self.page_size)

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_bytes(tokens) / self.link_bytes_per_s + self.link_latency_s

    def costs(self, tokens: int, prefill_queue: int, shards: list[tuple[int, int]]) -> dict:
        """{"prefill": s, ("colocated", d): s}: `shards[d]` = (prompt tokens queued, running decodes)."""
        f, chunks = self.prefill_flops(tokens), math.ceil(tokens / self.chunk_size)
        out = {
            "prefill": (
                self.queue_flops(prefill_queue) / self.prefill_flops_per_s
                + max(f / self.prefill_flops_per_s, chunks * self.prefill_floor_s)
                + self.transfer_s(tokens)
            )
        }
        own = max(f / self.decode_shard_flops_per_s, chunks * self.decode_floor_s)
        stall = max(0.0, f / self.decode_shard_flops_per_s - chunks * self.decode_floor_s)
        for d, (queued, running) in enumerate(shards):
            out[("colocated", d)] = (
                self.queue_flops(queued) / self.decode_shard_flops_per_s + own + self.interference * running * stall
            )
        return out

    def place(self, tokens: int, prefill_queue: int, shards: list[tuple[int, int]]) -> tuple[str, int | None]:
        """("prefill", None) or ("colocated", decode shard), by `placement`: the cheaper under
        `costs` ("cost"), or always one side."""
        costs = self.costs(tokens, prefill_queue, shards)
        best = min((k for k in costs if k != "prefill"), key=costs.get)
        if self.placement == "prefill" or (self.placement == "cost" and costs["prefill"] <= costs[best]):
            return "prefill", None
        return best


def step_seconds(config, hw, shard_rows: list[tuple[int, int]], mfu: float = 0.5, overhead_s: float = 0.0) -> float:
    """Modelled time of one engine step in `config`'s layout on hardware `hw`: the slowest batch
    shard, whose rows are (tokens, sum of their context lengths): max(compute at `mfu`, weights +
    KV read) + two tensor all-reduces per layer (`decode.DecodeStep`, the decode analysis's step,
    with prefill rows in it). For replays on a virtual clock (experiments/disaggregation)."""
    step = DecodeStep.for_config(config, hw, cached_weight_bytes(config))
    worst = 0.0
    for rows, context in shard_rows:
        if rows == 0:
            continue
        worst = max(worst, step.seconds(rows, context, mfu))
    return worst + overhead_s
