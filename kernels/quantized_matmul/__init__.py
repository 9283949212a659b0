"""Quantized matmul: pure-JAX references with the exact integer semantics and the 4-bit
layouts (reference.py), Pallas kernels for W8A16 / W4A16 / W8A8 (kernel.py: Triton on GPU, Mosaic
on TPU, interpret mode on CPU) and a GPU benchmark (bench.py). docs/kernels_quantized_matmul.md."""
