"""In-memory snapshots with ring replication, a peer watchdog, and restore onto any mesh
(docs/fault_tolerance.md).

Every `config.train.snapshot.every` (k) steps each process P_p:

1. copies the shards of the TrainState it holds with `replica_id == 0` (each element of each array
   once over the whole job) to the host and packs them, with their global index, the step and the
   loader state, into one byte buffer (`pack`);
2. sends that buffer to process (p + 1) % P through the training devices: one `ppermute` over a
   1-D mesh of one device per process (`ring_send`), the same collective path as the step's, so it
   works across hosts over ICI/NVLink/DCN or gloo, with no second transport to configure;
3. writes its own buffer and the one it received to its area `{root}/p{p}/{step}/` (a temporary
   directory renamed when whole), waits at a barrier of the coordination service, and then marks
   the step complete (`{root}/complete_{step}`; every process, in its own root when they differ). A kill mid-snapshot leaves the previous
   complete step as the newest.

`root` defaults to /dev/shm (tmpfs: host RAM that outlives the process, not the host). A restart
reads every area it can see (`restore`), keeps each piece once, and rebuilds each array on the new
mesh with `make_array_from_callback`: the callback cuts the requested block out of the saved
pieces, so a different device count or layout is the ordinary path. A process whose own area is
gone is recovered from its peer's replica.

`Watchdog`: a thread that bumps this process's counter in the coordination service's key-value
store every second and exits the process with `PeerLost` (exit code 75) once a peer's counter has
not moved for `peer_timeout_s`, or the coordinator no longer answers, so survivors of a SIGKILL do
not hang in a collective.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import jax
import numpy as np

from jaxsys.checkpoint import CheckpointError, _name
from jaxsys.parallel import process_ring

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: a launcher restarts the job
_MAGIC = b"JXSNAP01"


class SnapshotError(CheckpointError):
    """A snapshot that cannot be restored (a piece missing everywhere): the message names it."""


def root(snap_cfg, workdir: str) -> str:
    """The snapshot directory of `workdir`: config.train.snapshot.dir, else a directory under
    /dev/shm (or the temp dir where there is none) named by a hash of the workdir's path, so that
    a restart of the same workdir finds it and two runs never share one. A `{process}` in the
    directory gives each process its own (host-local memory, as on a cluster whose hosts each have
    their own /dev/shm): a restart then exchanges what each process sees (`restore`)."""
    if snap_cfg.dir:
        return os.path.abspath(str(snap_cfg.dir).replace("{process}", str(jax.process_index())))
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    key = hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:12]
    return os.path.join(base, "jaxsys-snapshots", key)


# ----------------------------------------------------------------------------- pieces and buffers


def _bounds(index, shape) -> list[tuple[int, int]]:
    return [(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape)]


def pieces(state) -> list[tuple[str, list, np.ndarray]]:
    """(leaf name, [(start, stop) per dim], host copy) of every shard this process holds with
    replica_id 0; leaves that are not jax.Arrays are kept whole by process 0."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = _name(path)
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                if shard.replica_id == 0:
                    out.append((name, _bounds(shard.index, leaf.shape), np.asarray(shard.data)))
        elif jax.process_index() == 0:
            a = np.asarray(leaf)
            out.append((name, [(0, n) for n in a.shape], a))
    return out


def pack(parts, meta: dict) -> np.ndarray:
    """One uint8 buffer: magic, header length, JSON header (meta and each piece's name, dtype,
    bounds, offset), then the pieces' bytes."""
    entries, offset = [], 0
    for name, bounds, a in parts:
        entries.append({"name": name, "dtype": a.dtype.name, "bounds": bounds, "offset": offset, "nbytes": a.nbytes})
        offset += a.nbytes
    header = json.dumps({"meta": meta, "pieces": entries}).encode()
    buf = np.empty(len(_MAGIC) + 8 + len(header) + offset, np.uint8)
    buf[:8] = np.frombuffer(_MAGIC, np.uint8)
    buf[8:16] = np.frombuffer(np.int64(len(header)).tobytes(), np.uint8)
    start = 16 + len(header)
    buf[16:start] = np.frombuffer(header, np.uint8)
    for (_, _, a), e in zip(parts, entries):
        buf[start + e["offset"] : start + e["offset"] + e["nbytes"]] = np.frombuffer(
            np.ascontiguousarray(a).tobytes(), np.uint8
        )
    return buf


def unpack(buf: np.ndarray) -> tuple[dict, list[tuple[str, list, np.ndarray]]]:
    if bytes(buf[:8]) != _MAGIC:
        raise SnapshotError("not a jaxsys snapshot buffer (bad magic)")
    n = int(np.frombuffer(bytes(buf[8:16]), np.int64)[0])
    header = json.loads(bytes(buf[16 : 16 + n]))
    start = 16 + n
    parts = []
    for e in header["pieces"]:
        shape = [b - a for a, b in e["bounds"]]
        raw = buf[start + e["offset"] : start + e["offset"] + e["nbytes"]]
        parts.append((e["name"], [tuple(b) for b in e["bounds"]], raw.view(jax.numpy.dtype(e["dtype"])).reshape(shape)))
    return header["meta"], parts


# ----------------------------------------------------------------------------- the ring


def ring_send(buf: np.ndarray) -> np.ndarray:
    """Send `buf` to process (p + 1) % P and return the buffer of process (p - 1) % P, through one
    ppermute over one device per process (buffers padded to the longest, rounded up to 64 KiB so
    that the program compiles once for a model). Every process calls it (a collective)."""
    n_proc, pid = jax.process_count(), jax.process_index()
    if n_proc == 1:
        return buf
    from jax.experimental import multihost_utils

    lengths = np.asarray(multihost_utils.process_allgather(np.int64(len(buf)))).reshape(-1)
    length = -(-int(lengths.max()) // 65536) * 65536
    fn, sharding = process_ring.ring_fn(n_proc, length)
    local = np.zeros((1, length), np.uint8)
    local[0, : len(buf)] = buf
    device = process_ring.process_devices()[pid]
    arr = jax.make_array_from_single_device_arrays((n_proc, length), sharding, [jax.device_put(local, device)])
    received = np.asarray(fn(arr).addressable_shards[0].data)[0]
    return received[: int(lengths[(pid - 1) % n_proc])].copy()


# ----------------------------------------------------------------------------- save


def _barrier(name: str, timeout_s: float) -> None:
    if jax.process_count() == 1:
        return
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


def _write(path: str, buf: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(memoryview(buf))


class Snapshotter:
    """Every `snap_cfg.every` steps: `save(step, state, data)`; keeps the last `snap_cfg.keep`
    complete snapshots. `seconds` / `count`: the time spent in saves (the cost per step is
    seconds / steps trained)."""

    def __init__(self, snap_cfg, workdir: str):
        self.every, self.keep = int(snap_cfg.every), int(snap_cfg.keep)
        self.timeout_s = max(float(snap_cfg.peer_timeout_s), 60.0)
        self.root = root(snap_cfg, workdir)
        self.pid, self.n_proc = jax.process_index(), jax.process_count()
        self.area = os.path.join(self.root, f"p{self.pid}")
        os.makedirs(self.area, exist_ok=True)
        self.seconds, self.count, self.nbytes = 0.0, 0, 0
        self.phases = dict.fromkeys(("host", "ring", "write", "barrier"), 0.0)  # seconds by phase

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state, data: dict | None) -> float:
        """Snapshot `state` (the step's TrainState, computed) and the loader state `data`. Returns
        the seconds it took (copy to host, ring send, write, barrier)."""
        start = time.perf_counter()
        meta = {"step": int(step), "process": self.pid, "processes": self.n_proc, "data": data}
        own = pack(pieces(state), meta)
        t_ring = time.perf_counter()
        replica = ring_send(own)
        t_write = time.perf_counter()
        final = os.path.join(self.area, str(step))
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        _write(os.path.join(tmp, "own.bin"), own)
        if self.n_proc > 1:
            _write(os.path.join(tmp, f"replica_of_p{(self.pid - 1) % self.n_proc}.bin"), replica)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        t_barrier = time.perf_counter()
        _barrier(f"jaxsys_snapshot_{step}", self.timeout_s)
        # past the barrier every process has written its step: each marks it complete in its own
        # directory (host-local directories: any survivor's marker names the step)
        marker = os.path.join(self.root, f"complete_{step}")
        with open(f"{marker}.tmp{self.pid}", "w") as f:
            json.dump({"step": int(step), "processes": self.n_proc}, f)
        os.replace(f"{marker}.tmp{self.pid}", marker)
        self._prune()
        seconds = time.perf_counter() - start
        for phase, a, b in (("host", start, t_ring), ("ring", t_ring, t_write), ("write", t_write, t_barrier)):
            self.phases[phase] += b - a
        self.phases["barrier"] += start + seconds - t_barrier
        self.seconds += seconds
        self.count += 1
        self.nbytes = len(own) + (len(replica) if self.n_proc > 1 else 0)
        return seconds

    def line(self) -> str:
        """One printed line: count, seconds, by phase, bytes per process."""
        phases = ", ".join(f"{k} {v:.3f} s" for k, v in self.phases.items())
        return (
            f"snapshots: {self.count} in {self.seconds:.3f} s ({phases}); "
            f"{self.nbytes / 2**20:.2f} MiB per process (own + replica)"
        )

    def _prune(self) -> None:
        """Drop this process's steps older than its last `keep` (any newer step than a complete
        one implies that one was marked: its ring send needed process 0 past the marker)."""
        steps = sorted(int(d) for d in os.listdir(self.area) if d.isdigit())
        for s in steps[: -self.keep]:
            shutil.rmtree(os.path.join(self.area, str(s)), ignore_errors=True)
        for s in complete_steps(self.root)[self.keep :]:
            with contextlib.suppress(FileNotFoundError):  # a shared directory: another process's prune
                os.remove(os.path.join(self.root, f"complete_{s}"))


# ----------------------------------------------------------------------------- restore


def complete_steps(root_dir: str) -> list[int]:
    """Steps marked complete under `root_dir`, newest first."""
    if not os.path.isdir(root_dir):
        return []
    names = (n[len("complete_") :] for n in os.listdir(root_dir) if n.startswith("complete_"))
    return sorted((int(s) for s in names if s.isdigit()), reverse=True)


def read(root_dir: str, step: int, required: bool = True) -> tuple[dict | None, dict, list[str]]:
    """(meta, {leaf name: {bounds: array}}, files read) of `step` from every area visible here:
    own buffers and peer replicas, each piece once. `required=False`: nothing visible is not an
    error (meta None; `restore` then gets the pieces from the other processes)."""
    by_leaf: dict = {}
    meta, files = None, []
    areas = os.listdir(root_dir) if os.path.isdir(root_dir) else []
    for area in sorted(d for d in areas if d.startswith("p") and d[1:].isdigit()):
        directory = os.path.join(root_dir, area, str(step))
        if not os.path.isdir(directory):
            continue
        for name in sorted(os.listdir(directory)):
            if not name.endswith(".bin"):
                continue
            path = os.path.join(directory, name)
            m, parts = unpack(np.fromfile(path, np.uint8))
            meta = meta or m
            files.append(os.path.relpath(path, root_dir))
            for leaf, bounds, a in parts:
                by_leaf.setdefault(leaf, {}).setdefault(tuple(bounds), a)
    if meta is None and required:
        raise SnapshotError(f"snapshot step {step} under {root_dir}: no process area holds it")
    return meta, by_leaf, files


def _sees_every_process(root_dir: str, step: int, meta: dict | None) -> bool:
    """Whether this process can read every saving process's pieces of `step` (its own buffer or
    its ring successor's replica of it), as on one machine with one shared directory."""
    if meta is None:
        return False
    n = int(meta["processes"])
    at = lambda q, name: os.path.isfile(os.path.join(root_dir, f"p{q % n}", str(step), name))
    return all(at(q, "own.bin") or at(q + 1, f"replica_of_p{q}.bin") for q in range(n))


def _needed(abstract_state) -> dict:
    """{leaf name: [bounds of each block this process's devices hold]}."""
    out = {}
    for path, want in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        blocks = want.sharding.addressable_devices_indices_map(want.shape).values()
        out[_name(path)] = [_bounds(index, want.shape) for index in blocks]
    return out


def _exchange(meta: dict | None, by_leaf: dict, files: list[str], abstract_state) -> tuple[dict, dict, list[str]]:
    """Ring all-gather of what each process read, each keeping the pieces its devices need: P - 1
    `ring_send` hops of one buffer (the pieces visible to the process it started from), so that a
    process whose host memory is gone (a replaced host) gets its own pieces back from its
    successor's replica, and the others theirs wherever they are."""
    needed = _needed(abstract_state)
    overlaps = lambda name, bounds: any(
        all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(bounds, want)) for want in needed.get(name, [])
    )
    visible = [(name, list(bounds), a) for name, parts in by_leaf.items() for bounds, a in parts.items()]
    buf = pack(visible, meta or {})
    kept = {name: {b: a for b, a in parts.items() if overlaps(name, b)} for name, parts in by_leaf.items()}
    n_proc, pid = jax.process_count(), jax.process_index()
    for hop in range(1, n_proc):
        buf = ring_send(buf)  # the buffer process (pid - hop) started with
        m, parts = unpack(buf)
        meta = meta or (m or None)
        got = 0
        for name, bounds, a in parts:
            if overlaps(name, bounds) and tuple(bounds) not in kept.setdefault(name, {}):
                kept[name][tuple(bounds)] = a.copy()
                got += 1
        if got:
            files.append(f"{got} pieces from process {(pid - hop) % n_proc}")
    if not meta:
        raise SnapshotError(
            "snapshot: no process holds it (every host's memory is gone): restart from the Orbax checkpoint"
        )
    return meta, kept, files


def _cut(name: str, parts: dict, index, shape, dtype) -> np.ndarray:
    """The block `index` of leaf `name`, assembled from saved pieces (disjoint, as replica 0 shards)."""
    want = _bounds(index, shape)
    out = np.empty([b - a for a, b in want], dtype)
    filled = 0
    for bounds, a in parts.items():
        inter = [(max(w0, p0), min(w1, p1)) for (w0, w1), (p0, p1) in zip(want, bounds)]
        if any(lo >= hi for lo, hi in inter):
            continue
        src = tuple(slice(lo - p0, hi - p0) for (lo, hi), (p0, _) in zip(inter, bounds))
        dst = tuple(slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(inter, want))
        out[dst] = a[src]
        filled += int(np.prod([hi - lo for lo, hi in inter]))
    if filled != out.size:
        raise SnapshotError(
            f"snapshot: {out.size - filled} of {out.size} elements of {name}{want} are in no visible area "
            "(the process holding them and its ring peer are both gone): restart from the Orbax checkpoint"
        )
    return out


def restore(root_dir: str, step: int, abstract_state):
    """(state, meta, files read): the snapshot at `step` in the shardings of `abstract_state`
    (`Program.abstract_state()`: any mesh). With several processes that do not all see every
    saving process's pieces (host-local directories), they exchange them first (`_exchange`)."""
    multi = jax.process_count() > 1
    meta, by_leaf, files = read(root_dir, step, required=not multi)
    if multi:
        from jax.experimental import multihost_utils

        sees = np.asarray(multihost_utils.process_allgather(np.int32(_sees_every_process(root_dir, step, meta))))
        if not sees.all():  # a collective decision: every process joins the ring or none does
            meta, by_leaf, files = _exchange(meta, by_leaf, files, abstract_state)
    assert meta is not None
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    leaves = []
    for path, want in flat:
        name = _name(path)
        if name not in by_leaf:
            raise SnapshotError(f"snapshot step {step} has no tensor {name}: it was saved from a different model")
        parts = by_leaf[name]
        dtype = np.dtype(want.dtype)
        for a in parts.values():
            if a.dtype != dtype:
                raise SnapshotError(f"snapshot step {step}: {name} was saved as {a.dtype}, the config wants {dtype}")
        leaves.append(
            jax.make_array_from_callback(
                want.shape, want.sharding, lambda idx, n=name, p=parts, w=want: _cut(n, p, idx, w.shape, dtype)
            )
        )
    return jax.tree_util.tree_unflatten(treedef, leaves), meta, files


def fingerprint(state) -> str:
    """A digest of the bits of every array of `state` on any mesh: per leaf, the sum mod 2^32 of its
    elements' bit patterns (one jitted reduction, exact in integers, so independent of the layout),
    hashed together. Equal states give equal digests; a flipped bit changes its leaf's sum."""
    import jax.numpy as jnp

    def bits(x):
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        return jnp.sum(jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32), dtype=jnp.uint32)

    sums = jax.jit(lambda leaves: [bits(x) for x in leaves])(jax.tree.leaves(state))
    # a full reduction comes back replicated: every process reads its own copy (all must call this)
    digest = hashlib.sha1(b"".join(np.asarray(v.addressable_data(0)).tobytes() for v in sums))
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------- watchdog


class Watchdog(threading.Thread):
    """Exit this process with a named error when a peer stops: every `interval` s, bump this
    process's counter in the coordination service's key-value store and read the others'. A peer
    whose counter has not moved for `timeout_s` is lost (one that wrote `done` finished and is not);
    the coordinator not answering is process 0 lost. The bound from the kill to the
    exit is timeout_s + 2 x interval (docs/fault_tolerance.md)."""

    def __init__(self, timeout_s: float, interval: float = 1.0, on_lost=None):
        super().__init__(name="jaxsys-watchdog", daemon=True)
        from jax._src import distributed

        self.client = distributed.global_state.client
        self.timeout_s, self.interval = float(timeout_s), float(interval)
        self.pid, self.n_proc = jax.process_index(), jax.process_count()
        self.stopped = threading.Event()
        self.on_lost = on_lost or _exit_peer_lost

    def run(self) -> None:
        beat = 0
        seen = {q: ("", time.monotonic()) for q in range(self.n_proc) if q != self.pid}
        while not self.stopped.wait(self.interval):
            beat += 1
            try:
                self.client.key_value_set(f"jaxsys/heartbeat/{self.pid}", str(beat), allow_overwrite=True)
                values = {q: self._get(q) for q in seen}
            except Exception as e:  # the coordination service (on process 0) is gone
                if self.stopped.is_set():
                    return
                self.on_lost(0, f"the coordinator does not answer ({type(e).__name__}: {str(e)[:200]})")
                return
            now = time.monotonic()
            for q, value in values.items():
                if value == "done":
                    seen[q] = ("done", now)
                elif value != seen[q][0]:
                    seen[q] = (value, now)
                elif now - seen[q][1] > self.timeout_s:
                    self.on_lost(q, f"no heartbeat for {now - seen[q][1]:.1f} s (timeout {self.timeout_s:g} s)")
                    return

    def _get(self, q: int) -> str:
        try:
            return self.client.key_value_try_get(f"jaxsys/heartbeat/{q}")
        except Exception as e:
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return ""  # not started beating yet
            raise

    def finish(self) -> None:
        """This process is done (peers must not count it as lost); stop beating."""
        self.stopped.set()
        try:
            self.client.key_value_set(f"jaxsys/heartbeat/{self.pid}", "done", allow_overwrite=True)
        except Exception:
            pass


def _exit_peer_lost(process: int, why: str) -> None:
    print(
        f"jaxsys: PeerLost: process {process} {why}; process {jax.process_index()} exits with code "
        f"{EXIT_PEER_LOST} so that the launcher can restart the job from the last snapshot",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_PEER_LOST)
