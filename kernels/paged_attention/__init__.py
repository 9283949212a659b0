"""Paged attention over a KV cache stored as pages of a shared pool addressed through a page table
(PagedAttention, vLLM). reference.py defines the one-query (decode) semantics (and a contiguous-cache
attention to cross-check it); kernel.py holds its Pallas kernel (generic variant: interpret mode on
CPU, Triton on GPU) and kernel_tpu.py its Mosaic variant; kernel_quant.py / quant.py the KIVI-quantized
cache. ragged.py (with ragged_tpu.py) is ragged paged attention: a step's query blocks grouped by
sequence (decodes and prefill chunks mixed), causal inside each chunk, each page read once per
query block. docs/kernels_paged_attention.md."""

from jaxsys.kernels.paged_attention.ragged import (
    ragged_paged_attention,
    ragged_paged_attention_quant,
    ragged_paged_attention_quant_reference,
    ragged_paged_attention_reference,
)

__all__ = [
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_quant",
    "ragged_paged_attention_quant_reference",
]
