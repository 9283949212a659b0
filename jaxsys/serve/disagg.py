"""Disaggregated prefill and decode (DistServe, Zhong et al. 2024; semi-PD): two engines on
disjoint sub-meshes, the KV cache of each prefilled prompt handed from one to the other.

    devices = [prefill sub-mesh (config.serve.prefill_mesh, e.g. tensor=4)]
            + [decode sub-mesh  (config.serve.decode_mesh,  e.g. data=2,tensor=2)]

Each side is a full jaxsys Program (program.build on a mesh over its devices, its own layout), the
same parameters resharded onto each, and a continuous-batching Engine (serve/engine.py) with its
own paged pools. A request's life:

1. placement (`CostModel.place`, at arrival or when decode pages free up): either
   - "prefill": its decode pages (prompt + max_new_tokens) are reserved on a decode batch shard
     now (so a prefilled sequence never waits for memory), and the prompt is submitted to the
     prefill engine with max_new_tokens=1; or
   - "colocated": it goes to a decode batch shard's scheduler like any request of a plain engine
     (chunked prefill among that shard's decodes).
2. the prefill engine runs chunked prefill; the step of the last chunk samples the first token
   (TTFT) and the prefill side's pages are freed (its engine sees a finished 1-token request).
3. handoff, right after that step and before the next prefill step can reuse the pages: the
   prompt's ceil(T / page_size) pages of every cache leaf are gathered on the prefill mesh
   (`Engine.export_pages`), moved to the devices of the chosen decode shard, each device getting
   its kv heads once (`Engine.receive_pages`: one jax.device_put per destination device), and
   scattered into the reserved pages at the next decode step (`Engine.import_pages`). The bytes
   moved are counted and equal `analysis.decode.kv_transfer_bytes` (2 L ceil(T/p) p K H b).
4. the decode engine decodes it from the next step on, exactly as if it had prefilled it.

`step()` runs one decode step, then one prefill step (so a sequence never gets two tokens in one
call); `step_decode(now)` / `step_prefill(now)` run one side, for replays that give each side its
own clock (a transfer is then ready `CostModel.transfer_s` after its prefill step ends).

On simulated CPU devices both sides share the host's cores: wall times serialise them, and only
the structure (which step waits behind which prefill) and modelled times say what disaggregation
buys. docs/serving.md ("Disaggregated prefill and decode").
"""

from __future__ import annotations

import copy
import dataclasses
import math

import jax

from jaxsys.analysis import hardware as hardware_lib
from jaxsys.analysis.decode import kv_transfer_bytes
from jaxsys.analysis.serving import CostModel
from jaxsys.config import MESH_AXES, ConfigError, validate
from jaxsys.serve.engine import Engine, EngineAPI
from jaxsys.serve.runner import check_servable
from jaxsys.serve.sampling import Sampling
from jaxsys.serve.scheduler import PoolExhausted, Request, Work

PLACEMENTS = ("cost", "prefill", "colocated")


# ----------------------------------------------------------------------------- config


def parse_mesh(text: str, key: str) -> dict:
    """ "data=2,tensor=2" -> {axis: size} over every mesh axis (unnamed axes 1); ConfigError naming `key`."""
    sizes = {a: 1 for a in MESH_AXES}
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        axis, eq, value = part.partition("=")
        axis = axis.strip()
        if not eq or axis not in MESH_AXES:
            raise ConfigError(
                f"{key}={text!r}: give axis=size pairs separated by commas, axes from {MESH_AXES} "
                "(e.g. 'data=2,tensor=2')"
            )
        try:
            sizes[axis] = int(value)
        except ValueError:
            raise ConfigError(f"{key}={text!r}: size {value!r} of axis {axis!r} is not an integer") from None
        if sizes[axis] < 1:
            raise ConfigError(f"{key}={text!r}: axis {axis!r} must have size >= 1")
    return sizes


def _model_divides(config, key: str) -> None:
    """Every parameter dimension divisible by the mesh axes it is split over (and the kv heads of
    the cache by the tensor axis): the named error before program.build would fail or pad."""
    from jaxsys.models import transformer
    from jaxsys.models.params import is_spec
    from jaxsys.sharding import Layout

    layout = Layout.from_config(config)
    m = config.model
    checks = [
        ("n_kv_heads", m.n_kv_heads, layout.compute_axes("kv_heads")),
        ("n_heads", m.n_heads, layout.compute_axes("heads")),
    ]
    for spec in jax.tree.leaves(transformer.param_specs(m), is_leaf=is_spec):
        for dim, logical in zip(spec.shape, spec.axes):
            checks.append((f"a {logical} dimension", dim, layout.param_axes(logical)))
    for what, dim, axes in checks:
        n = layout.size(axes)
        if n > 1 and dim % n:
            raise ConfigError(
                f"{key}: the layout splits {what} of the model ({dim}) {n} ways over "
                f"{'x'.join(axes)}, which does not divide it: choose sizes that divide it"
            )


def side_configs(config, num_devices: int | None = None) -> tuple:
    """(prefill config, decode config): `config` with config.mesh set to each sub-mesh, checked
    before anything is built: the sizes parse, together they use exactly the devices, each is a
    servable layout that divides the model. ConfigError names the key."""
    sv = config.serve
    if sv.placement not in PLACEMENTS:
        raise ConfigError(f"config.serve.placement={sv.placement!r}: choose one of {PLACEMENTS}")
    if not (isinstance(sv.interference, (int, float)) and sv.interference >= 0):
        raise ConfigError(f"config.serve.interference={sv.interference!r} must be a number >= 0")
    if sv.hardware not in hardware_lib.PROFILES:
        _bad_hardware(sv.hardware)
    if sv.get("kv_quant", "none") != "none":  # its full-precision residual pages have their own bookkeeping
        raise ConfigError(
            f"config.serve.disaggregate with config.serve.kv_quant={sv.kv_quant!r} is not "
            "implemented: the page methods move every cache leaf, but the residual window's "
            "page state (cache/kivi.ResidualPages) is not handed over yet; use kv_quant=none"
        )
    if sv.get("cache", "paged") != "paged":
        raise ConfigError(
            f"config.serve.disaggregate with config.serve.cache={sv.cache!r} is not implemented: the "
            "handoff moves a prompt's pages; set cache='paged'"
        )
    if sv.get("spec_k", 0):
        raise ConfigError(
            f"config.serve.disaggregate with config.serve.spec_k={sv.spec_k} is not implemented: "
            "the decode side is a plain Engine; set spec_k=0"
        )
    num_devices = jax.device_count() if num_devices is None else num_devices
    out = []
    sizes = {}
    for side in ("prefill", "decode"):
        key = f"config.serve.{side}_mesh"
        sizes[side] = parse_mesh(sv[f"{side}_mesh"], key)
    n = {side: math.prod(s.values()) for side, s in sizes.items()}
    if n["prefill"] + n["decode"] != num_devices:
        raise ConfigError(
            f"config.serve.prefill_mesh={sv.prefill_mesh!r} ({n['prefill']} devices) and "
            f"config.serve.decode_mesh={sv.decode_mesh!r} ({n['decode']} devices) use "
            f"{n['prefill'] + n['decode']} devices, but {num_devices} are available: their "
            f"device counts must add up to {num_devices}"
        )
    for side in ("prefill", "decode"):
        key = f"config.serve.{side}_mesh={sv[f'{side}_mesh']!r}"
        c = copy.deepcopy(config)
        for axis, size in sizes[side].items():
            c.mesh[axis] = size
        c.serve.disaggregate = False
        try:
            validate(c, num_devices=n[side])
            check_servable(c)
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
        _model_divides(c, key)
        out.append(c)
    return tuple(out)


def _bad_hardware(name):
    raise ConfigError(f"config.serve.hardware={name!r}: choose one of {sorted(hardware_lib.PROFILES)}")


def build_programs(config, devices=None) -> tuple:
    """(prefill Program, decode Program) on the first and the next devices of `devices`."""
    from jaxsys import program as program_lib
    from jaxsys.mesh import make_mesh

    devices = list(jax.devices() if devices is None else devices)
    pre, dec = side_configs(config, len(devices))
    n_pre = math.prod(pre.mesh[a] for a in MESH_AXES)
    return (
        program_lib.build(pre, make_mesh(pre, devices[:n_pre])),
        program_lib.build(dec, make_mesh(dec, devices[n_pre:])),
    )


def reshard(params, program):
    """The same parameters on `program`'s mesh, in its layout (a device-to-device copy)."""
    return jax.device_put(params, program.param_shardings)


def step_rows(work: list[Work], shard_of: dict, shards: int) -> list[tuple[int, int]]:
    """Per batch shard of a step: (rows, sum of the rows' context lengths) from its work."""
    out = [[0, 0] for _ in range(shards)]
    for w in work:
        d = shard_of.get(w.request.id, 0)
        out[d][0] += w.tokens
        out[d][1] += sum(w.start + i + 1 for i in range(w.tokens))
    return [tuple(r) for r in out]


# ----------------------------------------------------------------------------- the engine pair


@dataclasses.dataclass
class _Pending:
    request: Request  # what the caller sees: prompt, max_new_tokens, generated
    sampling: Sampling
    shard: int | None = None  # the decode shard
    ready_at: float | None = None  # modelled clock: when its transfer has landed
    placed: object = None  # the transferred pages on the decode mesh


class DisaggregatedEngine(EngineAPI):
    @classmethod
    def from_config(
        cls, config, params, devices=None, max_len: int | None = None, cost: CostModel | None = None
    ) -> "DisaggregatedEngine":
        """Both sides as `config.serve` describes (pages, budget, ... per batch shard of each)."""
        pre, dec = build_programs(config, devices)
        sv = config.serve
        keys = ("page_size", "token_budget", "chunk_size", "max_seqs", "policy")
        return cls(pre, dec, params, sv.pages, **{k: sv[k] for k in keys}, max_len=max_len, cost=cost)

    def __init__(
        self,
        prefill_program,
        decode_program,
        params,
        num_pages: int,
        page_size: int,
        token_budget: int,
        chunk_size: int,
        max_seqs: int,
        policy: str = "chunked",
        max_len: int | None = None,
        cost: CostModel | None = None,
    ):
        args = (num_pages, page_size, token_budget, chunk_size, max_seqs, policy, max_len)
        self.program = decode_program  # what callers read the model's config from (server.py)
        self.prefill = Engine(prefill_program, reshard(params, prefill_program), *args)
        self.decode = Engine(decode_program, reshard(params, decode_program), *args)
        cost = cost or CostModel.for_configs(prefill_program.config, decode_program.config)
        self.cost = dataclasses.replace(cost, page_size=page_size)  # priced on this engine's pages
        self.page_size = page_size
        self.waiting: list[_Pending] = []  # not yet placed (no decode pages free)
        self.in_prefill: dict = {}  # request id -> _Pending, prefilling on the prefill side
        self.inbox: list[_Pending] = []  # prefilled and transferred, not yet in the decode engine
        self.placement: dict = {}  # request id -> "prefill" | "colocated"
        self.transfers: list[dict] = []  # one per handoff: tokens, pages, bytes moved, formula
        self._done: list[Request] = []  # finished at their first token (max_new_tokens == 1)
        self.decode_steps = self.stalled_steps = self.stalled_decode_tokens = 0
        self.last_shard_rows: tuple = ()  # (side, per-shard rows) of the last step, for modelled clocks

    def warmup(self) -> None:
        self.prefill.warmup()
        self.decode.warmup()

    def abort(self, request_id) -> bool:
        return self.finish(request_id, "abort")

    def finish(self, request_id, reason: str) -> bool:
        """End a request wherever it is: waiting for placement, prefilling (its decode pages
        reserved), handed over, or decoding; finish_reason `reason` ("abort": not listed in
        `finished`)."""
        pending = next((p for p in self.waiting if p.request.id == request_id), None)
        if pending is not None:
            self.waiting.remove(pending)
        else:
            pending = self.in_prefill.pop(request_id, None)
            if pending is None:
                pending = next((p for p in self.inbox if p.request.id == request_id), None)
                if pending is not None:
                    self.inbox.remove(pending)
            if pending is None:
                return self.decode.finish(request_id, reason)
            self.prefill.abort(request_id)
            self.decode.pools[pending.shard].free(request_id)
        pending.request.finish_reason = reason
        if reason != "abort":
            self._done.append(pending.request)
        return True

    # -- state
    @property
    def idle(self) -> bool:
        return self.prefill.idle and self.decode.idle and not self.waiting and not self.in_prefill and not self.inbox

    @property
    def finished(self) -> list[Request]:
        return self.decode.finished + self._done

    def forget_finished(self) -> None:
        self.prefill.forget_finished()
        self.decode.forget_finished()
        self._done.clear()

    def has_work(self, side: str) -> bool:
        if side == "prefill":
            return not self.prefill.idle
        return not self.decode.idle or bool(self.inbox)

    def _queued_prefill(self, schedulers) -> int:
        return sum(len(r.prompt) - r.prefilled for s in schedulers for r in s.waiting + s.running)

    # -- requests
    def submit(self, request_id, prompt: list, max_new_tokens: int, sampling: Sampling | None = None) -> Request:
        """Queue a request; it is placed (prefill side or a decode shard) at once if it can be.
        ValueError for one that can never be served."""
        vocab = self.decode.program.config.model.vocab_size
        prompt = list(prompt)
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"request {request_id!r}: token ids outside [0, {vocab})")
        if not prompt or max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: needs a non-empty prompt and max_new_tokens >= 1")
        total = len(prompt) + max_new_tokens
        pool = self.decode.pools[0]
        if pool.pages_for(total) > pool.num_pages or total > self.decode.max_len:
            raise ValueError(
                f"request {request_id!r} needs {total} tokens of cache ({pool.pages_for(total)} pages), "
                f"more than the pool's {pool.num_pages} pages or the {self.decode.max_len}-token limit"
            )
        budget = self.decode.budget
        if self.decode.schedulers[0].policy != "chunked" and len(prompt) > budget:
            raise ValueError(
                f"request {request_id!r}: a {len(prompt)}-token prompt exceeds the token budget of "
                f"{budget} under policy {self.decode.schedulers[0].policy!r}; use policy='chunked'"
            )
        request = Request(request_id, prompt, max_new_tokens)
        self.waiting.append(_Pending(request, sampling or Sampling()))
        self._dispatch()
        return request

    def _dispatch(self) -> None:
        """Place waiting requests, first come first served."""
        dec = self.decode
        while self.waiting:
            p = self.waiting[0]
            r = p.request
            shards = [
                (self._queued_prefill([s]), sum(x.prefilled == len(x.prompt) for x in s.running))
                for s in dec.schedulers
            ]
            side, shard = self.cost.place(len(r.prompt), self._queued_prefill(self.prefill.schedulers), shards)
            if side == "colocated":
                dec.schedulers[shard].add(r)
                dec.shard_of[r.id] = shard
                dec.sampling[r.id] = p.sampling
            else:
                # decode pages now, on the shard with the most free pages that has a sequence slot
                busy = lambda d: (
                    len(dec.schedulers[d].running)
                    + len(dec.schedulers[d].waiting)
                    + sum(q.shard == d for q in list(self.in_prefill.values()) + self.inbox)
                )
                order = sorted(range(dec.shards), key=lambda d: -dec.pools[d].free_pages)
                shard = next(
                    (d for d in order if busy(d) < dec.schedulers[d].max_seqs and not dec.schedulers[d].waiting), None
                )
                if shard is None:
                    return
                try:
                    dec.pools[shard].reserve(r.id, len(r.prompt) + r.max_new_tokens)
                except PoolExhausted:
                    return
                p.shard = shard
                self.prefill.submit(r.id, r.prompt, 1, p.sampling)
                self.in_prefill[r.id] = p
            self.placement[r.id] = side
            self.waiting.pop(0)

    # -- steps
    def step_prefill(self, now: float | None = None) -> tuple[list, dict]:
        """One prefill-side step; the prompts it finishes are handed off (gathered and moved to
        their decode shard). `now`: the modelled time the step ends (their transfers are ready
        `cost.transfer_s` later); None: ready at once."""
        self._dispatch()
        if self.prefill.idle:
            return [], {}
        for s in self.prefill.schedulers:
            s._admit()  # admit now what the step would (its plan admits again: no-op), to see its pages
        pages = {
            r.id: (self.prefill.shard_of[r.id], self.prefill.pools[self.prefill.shard_of[r.id]].table(r.id))
            for s in self.prefill.schedulers
            for r in s.running
        }
        shard_of = dict(self.prefill.shard_of)
        work, sampled = self.prefill.step()
        self.last_shard_rows = ("prefill", step_rows(work, shard_of, self.prefill.shards))
        out = []
        for w in work:
            p = self.in_prefill[w.request.id]
            r = p.request
            out.append(Work(r, w.kind, w.start, w.tokens))
            if w.request.id not in sampled:
                continue
            # the prompt's last chunk ran: its first token; hand its pages over before the next step
            del self.in_prefill[r.id]
            r.prefilled = len(r.prompt)
            r.generated.append(sampled[r.id])
            # what the prefill side's request gathered for it: the first token's logprobs, the prompt's
            side = w.request
            r.logprobs += side.logprobs
            r.top_logprobs += side.top_logprobs
            r.prompt_logprobs, r.prompt_top_logprobs = list(side.prompt_logprobs), list(side.prompt_top_logprobs)
            if r.done:
                self.decode.pools[p.shard].free(r.id)
                self._done.append(r)
                continue
            shard, table = pages[r.id]
            ids = table[: math.ceil(len(r.prompt) / self.page_size)]
            block = self.prefill.export_pages(shard, ids)
            p.placed, moved = self.decode.receive_pages(p.shard, block)
            tokens = len(r.prompt)
            layout = self.decode.program.layout
            self.transfers.append(
                {
                    "id": r.id,
                    "tokens": tokens,
                    "pages": len(ids),
                    "bytes": moved,
                    "formula_bytes": kv_transfer_bytes(
                        self.decode.program.config.model,
                        tokens,
                        self.page_size,
                        layout.size(layout.compute_axes("heads")),
                    ),
                }
            )
            p.ready_at = None if now is None else now + self.cost.transfer_s(tokens)
            self.inbox.append(p)
        return out, sampled

    def land_at(self, end: float) -> None:
        """Modelled clocks: the handoffs of the prefill step that ended at `end` land on the decode
        side `cost.transfer_s` later (step_prefill(now=end) does the same)."""
        for p in self.inbox:
            if p.ready_at is None:
                p.ready_at = end + self.cost.transfer_s(len(p.request.prompt))

    def next_ready(self) -> float | None:
        """The earliest modelled time an inbox transfer lands (None: nothing in flight)."""
        times = [p.ready_at or 0.0 for p in self.inbox]
        return min(times) if times else None

    def step_decode(self, now: float | None = None) -> tuple[list, dict]:
        """Take in the transfers that have landed by `now` (all when None), then one decode step."""
        dec = self.decode
        for p in [p for p in self.inbox if now is None or (p.ready_at or 0.0) <= now]:
            self.inbox.remove(p)
            r = p.request
            ids = dec.pools[p.shard].table(r.id)[: math.ceil(len(r.prompt) / self.page_size)]
            dec.import_pages(p.shard, ids, p.placed)
            p.placed = None
            dec.schedulers[p.shard].running.append(r)
            dec.shard_of[r.id] = p.shard
            dec.sampling[r.id] = p.sampling
        self._dispatch()
        if dec.idle:
            return [], {}
        shard_of = dict(dec.shard_of)
        work, sampled = dec.step()
        self.last_shard_rows = ("decode", step_rows(work, shard_of, dec.shards))
        kinds = [w.kind for w in work]
        if "decode" in kinds:
            self.decode_steps += 1
            if "prefill" in kinds:  # decodes that waited behind a prefill chunk in their step
                self.stalled_steps += 1
                self.stalled_decode_tokens += kinds.count("decode")
        self._dispatch()
        return work, sampled

    def step(self) -> tuple[list, dict]:
        """One decode step, then one prefill step (a sequence handed off now decodes next call)."""
        w1, s1 = self.step_decode()
        w2, s2 = self.step_prefill()
        return w1 + w2, {**s1, **s2}

    def run(self, max_steps: int = 100_000) -> list[Request]:
        for _ in range(max_steps):
            if self.idle:
                break
            self.step()
        return self.finished


def colocated_stalls(work: list[Work]) -> tuple[int, int]:
    """(1 if the step's decodes shared it with a prefill chunk, decode tokens stalled so): the same
    count as DisaggregatedEngine's, for a plain Engine's step."""
    kinds = [w.kind for w in work]
    if "decode" in kinds and "prefill" in kinds:
        return 1, kinds.count("decode")
    return 0, 0
