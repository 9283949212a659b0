"""Quantized matmul (issue 18): pure-JAX references with the exact integer semantics (reference.py).
The Pallas kernels, the MARLIN-style repacking and the model integration are still to come."""
