"""The optimizer of a config (`config.train.optimizer`): AdamW, GaLore's Adam in AdamW's chain
(galore.py), Muon with Adam for the other leaves in the same chain (muon.py), or zeroth-order
training's stateless slot (zo.py), each with the learning rate of
schedules.py; and the PartitionSpecs of the optimizer state. Clipping by global norm is done by the
train step with `jaxsys.parallel.zero.global_norm`, which is correct when gradients are sharded."""

from __future__ import annotations

import jax
import optax
from jax.sharding import PartitionSpec as P

from jaxsys.models.params import ParamSpec
from jaxsys.optim import galore, muon, zo
from jaxsys.optim.schedules import schedule


def make_optimizer(t, specs, grad_pspecs=None, mesh_sizes=None) -> optax.GradientTransformation:
    """AdamW with weight decay on the leaves whose ParamSpec says so (not norms); with
    `t.optimizer == "galore"` the same chain with GaLore's Adam in place of Adam; "sgd": plain SGD
    with AdamW's decoupled weight decay (no momentum); with "zo" the
    stateless slot of zeroth-order training (`zo.optimizer`). GaLore needs the
    gradients' PartitionSpecs as the update sees them (`Program.grad_pspecs`; None: unsharded)
    and the mesh's axis sizes, and raises ConfigError for a bad `t.galore` before anything
    compiles."""
    if t.optimizer == "zo":  # MeZO: no state; zo.local_step makes the update from two forwards
        return zo.optimizer()
    mask = jax.tree.map(lambda s: s.decay, specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    if t.optimizer == "sgd":  # linear in the gradient: DiLoCo's H=1 limit is then data parallelism
        return optax.chain(optax.add_decayed_weights(t.weight_decay, mask), optax.scale_by_learning_rate(schedule(t)))
    if t.optimizer == "muon":  # optax.adamw's chain, Muon's direction for the chosen matrices
        plans = muon.plan(t.muon, specs, grad_pspecs, mesh_sizes)
        mu = t.muon
        directions = {
            "muon": muon.scale_by_muon(
                plans,
                float(mu.beta),
                int(mu.ns_steps),
                bool(mu.nesterov),
                float(mu.consistent_rms),
                mesh_sizes=mesh_sizes if grad_pspecs is not None else None,
            ),
            "adam": optax.scale_by_adam(b1=t.b1, b2=t.b2, eps=t.eps),
        }
        return optax.chain(
            optax.multi_transform(directions, muon.labels(plans)),
            optax.add_decayed_weights(t.weight_decay, mask),
            optax.scale_by_learning_rate(schedule(t)),
        )
    if t.optimizer == "galore":  # optax.adamw's chain, GaLore's Adam first
        g = t.galore
        return optax.chain(
            galore.scale_by_galore_adam(
                galore.plan(g, specs, grad_pspecs, mesh_sizes),
                b1=t.b1,
                b2=t.b2,
                eps=t.eps,
                scale=float(g.scale),
                update_every=int(g.update_every),
            ),
            optax.add_decayed_weights(t.weight_decay, mask),
            optax.scale_by_learning_rate(schedule(t)),
        )
    return optax.adamw(schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=mask)


def state_pspecs(t, specs, grad_pspecs, optimizer=None, mesh_sizes=None):
    """PartitionSpecs of the optimizer state of `t.optimizer` (`optimizer`: the one
    `make_optimizer` made, else made here). AdamW: every copy of the parameter tree in it (the
    moments) gets the gradients' specs `grad_pspecs`, other leaves (step counts) P(). GaLore: its
    state is not parameter-shaped, so it gets `galore.state_pspecs` of its plans, the rest of the
    chain (the schedule's count) P(). Muon: optax.multi_transform's moments are the parameter tree
    with the other partition's leaves masked; they get the gradients' specs, masked alike."""
    optimizer = optimizer or make_optimizer(t, specs, grad_pspecs, mesh_sizes)
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, "float32"), specs, is_leaf=lambda x: isinstance(x, ParamSpec)
    )
    state = jax.eval_shape(optimizer.init, abstract)
    if t.optimizer == "galore":
        own = galore.state_pspecs(galore.plan(t.galore, specs, grad_pspecs, mesh_sizes))
        return jax.tree.map(lambda node: own if galore.is_state(node) else P(), state, is_leaf=galore.is_state)
    if t.optimizer == "muon":  # each partition's moments: the parameter tree with the other leaves masked
        labels = muon.labels(muon.plan(t.muon, specs, grad_pspecs, mesh_sizes))
        is_p = lambda x: isinstance(x, P)
        pspecs = grad_pspecs if grad_pspecs is not None else jax.tree.map(lambda _: P(), abstract)
        masked = {
            jax.tree.structure(tree, is_leaf=is_p): tree
            for tree in (
                jax.tree.map(lambda lab, spec, want=want: spec if lab == want else optax.MaskedNode(), labels, pspecs)
                for want in ("muon", "adam")
            )
        }
        moments = lambda node: not isinstance(node, jax.ShapeDtypeStruct) and jax.tree.structure(node) in masked
        return jax.tree.map(
            lambda node: masked[jax.tree.structure(node)] if moments(node) else P(), state, is_leaf=moments
        )
    return optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        state,
        grad_pspecs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
