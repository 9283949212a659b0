"""Optimizers and what they need, one module per idea:

- `schedules`: the learning-rate schedule of `config.train` (warmup, then cosine, wsd or constant),
  shared by every optimizer below;
- `optimizer`: the optimizer a config names (`config.train.optimizer`): `make_optimizer` builds
  AdamW, GaLore's Adam in AdamW's chain, plain SGD, or zeroth-order training's stateless slot, and
  `state_pspecs` gives the PartitionSpecs of its state;
- `galore`: GaLore (Adam on low-rank projections of the gradient, on the sharded gradients; its
  communication is in `jaxsys.parallel.galore`), and the matrix view of a leaf it shares with Muon;
- `muon`: Muon (momentum orthogonalized by Newton-Schulz for the hidden matrices; its all-to-alls
  are in `jaxsys.parallel.muon`);
- `zo`: zeroth-order training, MeZO with ZO2's weight streaming (two forwards, no backward);
- `outer`: DiLoCo, Streaming DiLoCo and CO2 (`config.train.outer`): islands on the `data` axis, an
  outer Nesterov step on their averaged parameter deltas (its collective in `jaxsys.parallel.diloco`).

The imports run one way: `optimizer` uses `galore`, `muon`, `zo` and `schedules`; `muon` uses
`galore`; `zo` and `outer` use
`schedules`."""
