"""Paged attention for decoding (PagedAttention, vLLM): one query per sequence attends to its KV
cache, stored as pages of a shared pool addressed through a page table. reference.py defines the
semantics (and a contiguous-cache attention to cross-check it); kernel.py holds the Pallas kernel
(generic variant: interpret mode on CPU, Triton on GPU) and kernel_tpu.py its Mosaic variant.
docs/kernels_paged_attention.md."""
