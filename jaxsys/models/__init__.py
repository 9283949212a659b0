"""Per-shard model code. Models name the logical axes of their parameters and activations and
communicate only through `jaxsys.parallel`; with every mesh axis of size 1 they are plain models."""
