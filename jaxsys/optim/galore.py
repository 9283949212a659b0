"""GaLore (Zhao et al. 2024): Adam on low-rank projections of the gradient, inside the sharded step.

For a weight leaf seen as a batch of m x n matrices (m = the `embed` dimension, n = the product of
the other non-batch dimensions; `chunks`, `layers` and `experts` are batch dimensions), every K
optimizer steps (step 0 included) the gradient G of each matrix is decomposed, G = U S V^T, and the
top-r singular vectors of the smaller side become its projection:

    m <= n ("left"):  P = U[:, :r]  [m, r];  R = P^T G  [r, n];  update = alpha P N(R)
    m >  n ("right"): Q = V[:, :r]  [n, r];  R = G Q    [m, r];  update = alpha N(R) Q^T

N is Adam with bias correction (optax.scale_by_adam) on R: the moments live in the projected space.
The moments are kept across projection refreshes, as in the official implementation. The side is
the official `std` rule's: PyTorch stores a linear layer as [out, in], jaxsys as [in, out], and
projecting the right side when rows >= columns there picks the same subspace as left when m <= n
here. The chain around it
(`optimizer.make_optimizer`) adds decoupled weight decay and the learning rate, so the whole is AdamW on
projected gradients. Leaves that are not chosen get plain Adam (the same optax code as AdamW).

Sharding (inside the train step's shard_map, on local shards): G's rows are split over `row_axes`
(the mesh axes of the embed dimension in the gradient's PartitionSpec: `fsdp`, and `data` where
ZeRO slices it), its columns over `col_axes`, and the batch dimensions over theirs (`pipe`,
ZeRO's `data`, `expert`). A refresh all-gathers each local G over its row and column axes only, so
every device runs the SVD of the matrices of its own batch slice (devices that hold the same slice
compute the same SVD), then keeps its own block of rows of P (or of columns' rows of Q). The
projection is a local matmul summed over the axes of the contracted side (`sum_axes`: rows for
left, columns for right): a reduce-scatter along r when r divides over them, so that the moments'
r dimension is split there too (`rank_axes`) and Adam's output N is all-gathered back for the
projection back; an all-reduce otherwise (the moments then replicated there). The projection back
is local. So P lives sharded like G's rows, Q like G's columns, and the moments like G's other side
and along r. The collectives are jaxsys/parallel/galore.py's; docs/galore.md gives their bytes.

Two choices beyond the paper (docs/galore.md):
  * full rank (r == min(m, n)): the projection would span the whole space, and any orthonormal
    basis would do, but Adam is not rotation invariant, so the SVD basis would not give AdamW. Such
    leaves use the identity basis (no projection, no SVD, no stored P): Adam on G itself, times
    alpha. With alpha = 1 they are exactly AdamW.
  * each singular vector is signed so that its entry of largest magnitude is positive. Within one
    projection period Adam is sign-equivariant (a flipped basis vector flips its moments and its
    update together), so this changes nothing there; across a refresh it makes the basis, and so
    the meaning of the kept moments, a deterministic function of G, the same on every layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxsys.config import ConfigError
from jaxsys.models.params import ParamSpec, is_spec
from jaxsys.parallel import galore as comm

ROW_AXIS = "embed"  # the logical axis whose dimension is the matrix rows
BATCH_AXES = ("chunks", "layers", "experts")  # logical axes of the stacked (batch) dimensions


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """What GaLore does with one parameter leaf (global shape, gradient PartitionSpec entries)."""

    name: str  # "layers/wq"
    shape: tuple[int, ...]
    spec: tuple[tuple[str, ...], ...]  # per dimension: the mesh axes of the gradient's spec
    side: str = "adam"  # adam: not chosen; full: r == min(m, n); left: P^T G; right: G Q
    rank: int = 0
    row_dim: int = -1
    batch_dims: tuple[int, ...] = ()
    col_dims: tuple[int, ...] = ()
    rank_axes: tuple[str, ...] = ()  # the moments' r dimension is split over these (`sum_axes`)

    @property
    def projected(self) -> bool:
        return self.side in ("left", "right")

    @property
    def m(self) -> int:
        return self.shape[self.row_dim]

    @property
    def n(self) -> int:
        return math.prod(self.shape[d] for d in self.col_dims)

    @property
    def row_axes(self) -> tuple[str, ...]:
        return self.spec[self.row_dim]

    @property
    def col_axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.col_dims for a in self.spec[d])

    @property
    def sum_axes(self) -> tuple[str, ...]:
        """The axes that split the side the projection contracts: R is summed over them."""
        return self.row_axes if self.side == "left" else self.col_axes if self.side == "right" else ()

    # -- the state of this leaf: global shapes and, per dimension, the mesh axes it is split over
    def _dims(self, dims: Sequence[int]):
        return [self.shape[d] for d in dims], [self.spec[d] for d in dims]

    def moment_shape(self) -> tuple[int, ...]:
        if not self.projected:
            return self.shape
        b, _ = self._dims(self.batch_dims)
        if self.side == "left":
            return (*b, self.rank, *self._dims(self.col_dims)[0])
        return (*b, self.m, self.rank)

    def moment_entries(self) -> tuple[tuple[str, ...], ...]:
        if not self.projected:
            return self.spec
        _, b = self._dims(self.batch_dims)
        if self.side == "left":
            return (*b, self.rank_axes, *self._dims(self.col_dims)[1])
        return (*b, self.row_axes, self.rank_axes)

    def projector_shape(self) -> tuple[int, ...]:
        b, _ = self._dims(self.batch_dims)
        if self.side == "left":
            return (*b, self.m, self.rank)
        return (*b, *self._dims(self.col_dims)[0], self.rank)

    def projector_entries(self) -> tuple[tuple[str, ...], ...]:
        _, b = self._dims(self.batch_dims)
        if self.side == "left":
            return (*b, self.row_axes, ())
        return (*b, *self._dims(self.col_dims)[1], ())

    def moment_spec(self) -> P:
        return _pspec(self.moment_entries())

    def projector_spec(self) -> P:
        return _pspec(self.projector_entries())

    def state_elements(self, mesh_sizes: dict[str, int] | None = None) -> int:
        """Elements of this leaf's state (two moments, and the projection when projected): global,
        or on one device of a mesh of `mesh_sizes` (each dimension divided by the sizes of its axes)."""

        def count(shape, entries):
            if mesh_sizes is None:
                return math.prod(shape)
            return math.prod(d // math.prod(mesh_sizes.get(a, 1) for a in axes) for d, axes in zip(shape, entries))

        total = 2 * count(self.moment_shape(), self.moment_entries())
        if self.projected:
            total += count(self.projector_shape(), self.projector_entries())
        return total


def _pspec(entries) -> P:
    out = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in entries]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _entries(pspec: P, ndim: int) -> tuple[tuple[str, ...], ...]:
    entries = list(pspec) + [None] * (ndim - len(pspec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def _key_name(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def parse_leaves(leaves: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in str(leaves).split(",") if name.strip())


def matrix_plans(leaves: str, key: str, specs, grad_pspecs=None, mesh_sizes=None) -> Any:
    """A LeafPlan per parameter leaf (the ParamSpec pytree's structure): side "full" with the matrix
    view (rows: the `embed` dimension; batch: `chunks` / `layers` / `experts`; columns: the rest)
    for the leaves named in `leaves` (comma-separated keys, the last name on a leaf's path), "adam"
    for the others; each with the mesh axes of its gradient's PartitionSpec (None: unsharded; then
    `mesh_sizes` is not needed). The view GaLore projects and Muon orthogonalizes. Raises
    ConfigError naming `key` (the config key of the list) for a name no leaf has and a named leaf
    without an `embed` axis or columns."""
    names = parse_leaves(leaves)
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    if grad_pspecs is None:
        pspecs = [P()] * len(flat)
    else:
        pspecs = jax.tree.leaves(grad_pspecs, is_leaf=lambda x: isinstance(x, P))
    found, plans = set(), []
    for (path, spec), pspec in zip(flat, pspecs):
        assert isinstance(spec, ParamSpec), spec
        name = "/".join(_key_name(k) for k in path)
        entries = _entries(pspec, len(spec.shape))
        if mesh_sizes is None and any(entries):
            raise ValueError(f"matrix_plans: {name} is sharded ({pspec}); pass the mesh's axis sizes")
        leaf = _key_name(path[-1])
        if leaf not in names:
            plans.append(LeafPlan(name, tuple(spec.shape), entries))
            continue
        found.add(leaf)
        if ROW_AXIS not in spec.axes:
            raise ConfigError(
                f"{key} names {leaf!r}, but the leaf {name} (axes "
                f"{spec.axes}) has no {ROW_AXIS!r} axis to take as the matrix rows; "
                "remove it from the list"
            )
        row = spec.axes.index(ROW_AXIS)
        batch = tuple(d for d, a in enumerate(spec.axes) if a in BATCH_AXES)
        cols = tuple(d for d in range(len(spec.shape)) if d != row and d not in batch)
        if not cols:
            raise ConfigError(
                f"{key} names {leaf!r}, but the leaf {name} (axes "
                f"{spec.axes}) is a vector per layer, not a matrix: remove it from the list"
            )
        plans.append(LeafPlan(name, tuple(spec.shape), entries, "full", 0, row, batch, cols))
    missing = [n for n in names if n not in found]
    if missing:
        every = sorted({_key_name(p[-1]) for p, _ in flat})
        raise ConfigError(f"{key} names {missing}, which this model does not have; its leaves are {every}")
    return jax.tree.unflatten(treedef, plans)


def plan(g, specs, grad_pspecs=None, mesh_sizes=None) -> Any:
    """A LeafPlan per parameter leaf (the ParamSpec pytree's structure) from `config.train.galore`
    (`g`: rank, leaves), the gradients' PartitionSpecs (None: unsharded) and the mesh's axis sizes
    (needed with sharded `grad_pspecs`): `matrix_plans`' view of the leaves in `g.leaves`, with
    GaLore's side. Its moments' r dimension is split over the axes R is summed over when r
    divides by their size (`rank_axes`), else they are replicated there. Raises ConfigError for a
    name no leaf has, a chosen leaf without an `embed` axis or columns, and a rank above min(m, n)
    of a chosen leaf."""
    rank = int(g.rank)

    def refine(pl: LeafPlan) -> LeafPlan:
        if pl.side == "adam":
            return pl
        name, m, n = pl.name, pl.m, pl.n
        leaf = name.split("/")[-1]
        if rank > min(m, n):
            raise ConfigError(
                f"config.train.galore.rank={rank} is larger than min(m, n) = {min(m, n)} of the leaf "
                f"{name}, an {m} x {n} matrix ({ROW_AXIS} x the rest) per layer: lower the rank to at "
                f"most {min(m, n)} or remove {leaf!r} from config.train.galore.leaves"
            )
        side = "full" if rank == min(m, n) else "left" if m <= n else "right"
        pl = dataclasses.replace(pl, side=side, rank=rank)
        split = math.prod(mesh_sizes[a] for a in pl.sum_axes) if pl.sum_axes else 1
        return dataclasses.replace(pl, rank_axes=pl.sum_axes if split > 1 and rank % split == 0 else ())

    plans = matrix_plans(g.leaves, "config.train.galore.leaves", specs, grad_pspecs, mesh_sizes)
    return jax.tree.map(refine, plans, is_leaf=lambda x: isinstance(x, LeafPlan))


def _plans(plans) -> list[LeafPlan]:
    return jax.tree.leaves(plans, is_leaf=lambda x: isinstance(x, LeafPlan))


# ----------------------------------------------------------------------------- state


class GaloreState(NamedTuple):
    adam: optax.ScaleByAdamState  # count, and moments shaped like the projected gradients
    proj: Any  # nested dict {path...: P [.., m, r] or Q [.., *cols, r]} of the projected leaves only


def _nest(names: Sequence[str], values: Sequence) -> dict:
    out: dict = {}
    for name, value in zip(names, values):
        *parents, last = name.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def _unnest(tree: dict, names: Sequence[str]) -> list:
    out = []
    for name in names:
        node = tree
        for p in name.split("/"):
            node = node[p]
        out.append(node)
    return out


def state_pspecs(plans) -> GaloreState:
    """PartitionSpecs of the GaloreState of `plans`: moments as `LeafPlan.moment_spec` (the
    gradient's for unprojected leaves), projections as `projector_spec`, the count replicated."""
    flat = _plans(plans)
    treedef = jax.tree.structure(plans, is_leaf=lambda x: isinstance(x, LeafPlan))
    moments = jax.tree.unflatten(treedef, [pl.moment_spec() for pl in flat])
    projected = [pl for pl in flat if pl.projected]
    proj = _nest([pl.name for pl in projected], [pl.projector_spec() for pl in projected])
    return GaloreState(optax.ScaleByAdamState(P(), moments, moments), proj)


def state_bytes(plans, itemsize: int = 4, mesh_sizes: dict[str, int] | None = None) -> int:
    """The formula: bytes of the moments and projections of `plans` (the int32 step count left out,
    as `cost_model.zero_memory` leaves AdamW's out). Per m x n matrix: 2 m n for Adam leaves and full
    rank, m r + 2 r n (left, m <= n) or n r + 2 m r (right, m > n) for projected ones. Global, or per
    device of a mesh with `mesh_sizes` ({axis: size}; each state dimension divided by its axes)."""
    return itemsize * sum(pl.state_elements(mesh_sizes) for pl in _plans(plans))


# ----------------------------------------------------------------------------- the transformation


def to_matrices(x, pl: LeafPlan):
    """A local leaf block -> [b, m_local, n_local] (batch dims flattened, then rows, then columns)."""
    perm = (*pl.batch_dims, pl.row_dim, *pl.col_dims)
    x = jnp.transpose(x, perm)
    b = math.prod(x.shape[: len(pl.batch_dims)])
    return x.reshape(b, x.shape[len(pl.batch_dims)], -1)


def from_matrices(x, pl: LeafPlan, local_shape):
    """[b, m_local, n_local] -> the local leaf block of `local_shape`."""
    perm = (*pl.batch_dims, pl.row_dim, *pl.col_dims)
    x = x.reshape(tuple(local_shape[d] for d in perm))
    return jnp.transpose(x, tuple(perm.index(d) for d in range(len(perm))))


def _signed(vectors):
    """Each column of [b, k, r] signed so that its entry of largest magnitude is positive."""
    idx = jnp.argmax(jnp.abs(vectors), axis=-2, keepdims=True)
    sign = jnp.sign(jnp.take_along_axis(vectors, idx, axis=-2))
    return vectors * jnp.where(sign == 0, 1.0, sign).astype(vectors.dtype)


def whole_matrices(g, pl: LeafPlan):
    """[b, m, n] fp32: the whole matrices of this device's batch slice of a leaf, from its local
    block, all-gathered over the row axes and each column dimension's axes."""
    full = comm.gather(g, pl.row_dim, pl.row_axes)
    for d in pl.col_dims:
        full = comm.gather(full, d, pl.spec[d])
    return to_matrices(full, pl).astype(jnp.float32)


def own_matrix_block(mat, pl: LeafPlan, local_shape):
    """The inverse of `whole_matrices` for a result of the same shape [b, m, n]: this device's
    block of the leaf (a slice over the row and column axes, no communication), `local_shape`."""
    nb = len(pl.batch_dims)
    perm = (*pl.batch_dims, pl.row_dim, *pl.col_dims)
    whole = mat.reshape(*(local_shape[d] for d in pl.batch_dims), pl.m, *(pl.shape[d] for d in pl.col_dims))
    whole = comm.own_block(whole, nb, pl.row_axes, local_shape[pl.row_dim])
    for i, d in enumerate(pl.col_dims):
        whole = comm.own_block(whole, nb + 1 + i, pl.spec[d], local_shape[d])
    return jnp.transpose(whole, tuple(perm.index(d) for d in range(len(perm))))


def _projector(g, pl: LeafPlan, dtype):
    """The new local projection of one leaf from its local gradient block: all-gather over the
    row and column axes, batched SVD, top-r vectors of the smaller side, this device's block."""
    mat = whole_matrices(g, pl)  # [b, m, n], global rows and columns
    u, _, vt = jnp.linalg.svd(mat, full_matrices=False)
    nb = len(pl.batch_dims)
    batch_local = tuple(g.shape[d] for d in pl.batch_dims)
    if pl.side == "left":
        p = _signed(u[..., : pl.rank])  # [b, m, r]
        p = comm.own_block(p, 1, pl.row_axes, g.shape[pl.row_dim])
        return p.reshape(*batch_local, p.shape[1], pl.rank).astype(dtype)
    q = _signed(jnp.swapaxes(vt[..., : pl.rank, :], -1, -2))  # [b, n, r]
    q = q.reshape(*batch_local, *(pl.shape[d] for d in pl.col_dims), pl.rank)
    for i, d in enumerate(pl.col_dims):
        q = comm.own_block(q, nb + i, pl.spec[d], g.shape[d])
    return q.astype(dtype)


_HIGHEST = lax.Precision.HIGHEST


def _project(g, proj, pl: LeafPlan):
    """R, the projected local gradient, shaped like the leaf's local moments: the local matmul,
    summed over `sum_axes`; a reduce-scatter along r when the moments are split there."""
    mat = to_matrices(g, pl)
    batch_local = tuple(g.shape[d] for d in pl.batch_dims)
    if pl.side == "left":
        p = proj.reshape(mat.shape[0], mat.shape[1], pl.rank)
        r, rank_dim = jnp.einsum("bmr,bmn->brn", p, mat, precision=_HIGHEST), 1
    else:
        q = proj.reshape(mat.shape[0], mat.shape[2], pl.rank)
        r, rank_dim = jnp.einsum("bmn,bnr->bmr", mat, q, precision=_HIGHEST), 2
    r = comm.sum_projected(r, rank_dim, pl.sum_axes, pl.rank_axes)
    if pl.side == "left":
        return r.reshape(*batch_local, r.shape[1], *(g.shape[d] for d in pl.col_dims))
    return r.reshape(*batch_local, mat.shape[1], r.shape[2])


def _project_back(n, proj, pl: LeafPlan, local_shape, scale: float):
    """alpha P N (left) or alpha N Q^T (right), as the local leaf block: N all-gathered along r
    first when the moments are split there; the matmul itself is local."""
    b = math.prod(local_shape[d] for d in pl.batch_dims)
    m_local = local_shape[pl.row_dim]
    if pl.side == "left":
        n = comm.gather(n.reshape(b, -1, math.prod(local_shape[d] for d in pl.col_dims)), 1, pl.rank_axes)
        p = proj.reshape(b, m_local, pl.rank)
        out = jnp.einsum("bmr,brn->bmn", p, n, precision=_HIGHEST)
    else:
        n = comm.gather(n.reshape(b, m_local, -1), 2, pl.rank_axes)
        q = proj.reshape(b, -1, pl.rank)
        out = jnp.einsum("bmr,bnr->bmn", n, q, precision=_HIGHEST)
    return from_matrices(out * scale, pl, local_shape)


def scale_by_galore_adam(
    plans, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, scale: float = 0.25, update_every: int = 200
) -> optax.GradientTransformation:
    """GaLore's Adam (module docstring) for the leaves that `plans` (from `plan`) project, plain
    Adam (optax.scale_by_adam) for the rest. `update` runs on local shards inside the train step's
    shard_map (or on whole arrays when nothing is sharded). Chain it with weight decay and the
    learning rate, as `optimizer.make_optimizer` does."""
    flat = _plans(plans)
    treedef = jax.tree.structure(plans, is_leaf=lambda x: isinstance(x, LeafPlan))
    projected = [i for i, pl in enumerate(flat) if pl.projected]
    names = [flat[i].name for i in projected]
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)

    def zeros(dtypes) -> GaloreState:
        moments = jax.tree.unflatten(treedef, [jnp.zeros(pl.moment_shape(), dt) for pl, dt in zip(flat, dtypes)])
        proj = _nest(names, [jnp.zeros(flat[i].projector_shape(), dtypes[i]) for i in projected])
        return GaloreState(adam.init(moments), proj)

    def init(params):
        # The state follows from the plans; the params give only the dtypes. optax.tree_map_params
        # calls init with a placeholder object instead of params: it gets the abstract state
        # (nothing allocated) in which no leaf is a parameter tree, so such maps treat the whole
        # GaloreState as non-parameter state (its PartitionSpecs come from `state_pspecs`).
        if jax.tree.structure(params) != treedef:
            return jax.eval_shape(lambda: zeros([jnp.float32] * len(flat)))
        return zeros([x.dtype for x in treedef.flatten_up_to(params)])

    def update(updates, state, params=None):
        del params
        grads = treedef.flatten_up_to(updates)
        projs = _unnest(state.proj, names)
        if projected:

            def refresh(gs, _):
                return [_projector(g, flat[i], p.dtype) for g, i, p in zip(gs, projected, projs)]

            def keep(_, ps):
                return list(ps)

            gs = [grads[i] for i in projected]
            projs = lax.cond(state.adam.count % update_every == 0, refresh, keep, gs, projs)
        by_leaf = dict(zip(projected, projs))
        reduced = [_project(g, by_leaf[i], pl) if pl.projected else g for i, (g, pl) in enumerate(zip(grads, flat))]
        normed, adam_state = adam.update(jax.tree.unflatten(treedef, reduced), state.adam)
        normed = treedef.flatten_up_to(normed)
        out = []
        for i, (n, g, pl) in enumerate(zip(normed, grads, flat)):
            if pl.projected:
                out.append(_project_back(n, by_leaf[i], pl, g.shape, scale).astype(g.dtype))
            elif pl.side == "full" and scale != 1.0:
                out.append((n * scale).astype(g.dtype))
            else:
                out.append(n)
        return jax.tree.unflatten(treedef, out), GaloreState(adam_state, _nest(names, projs))

    return optax.GradientTransformation(init, update)


def is_state(x) -> bool:
    return isinstance(x, GaloreState)
