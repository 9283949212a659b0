"""Pallas kernels, one folder per op, each with a pure-JAX reference (installed as jaxsys.kernels)."""
