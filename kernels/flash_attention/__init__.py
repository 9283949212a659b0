"""Flash attention: a Pallas kernel (forward + FlashAttention-2 backward, custom_vjp) in a generic
variant (interpret mode on CPU, Triton on GPU) and a TPU (Mosaic) variant, chosen by the platform
lowered for, and its pure-JAX reference. See docs/kernels_flash_attention.md."""

from .kernel import flash_attention, flash_attention_backward, flash_attention_forward
from .reference import attention as reference_attention
from .reference import attention_backward as reference_attention_backward

__all__ = [
    "flash_attention",
    "flash_attention_forward",
    "flash_attention_backward",
    "reference_attention",
    "reference_attention_backward",
]
