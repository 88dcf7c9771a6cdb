"""Fused Triton kernels (each an autograd.Function) with plain-torch fallbacks.

Dispatch: Triton for CUDA tensors, torch for CPU tensors; `set_backend` / `use_backend`
force one path ("triton" on CPU needs TRITON_INTERPRET=1 set before import). On CUDA a kernel's
Triton path runs once it has passed its self-check (self_check.py) and, per shape class, been
measured faster than its fallback (choice.py: `set_kernel_choice`, `choice.decide`, `choice.summary`).
Depends on torch and triton only.
"""
from ._dispatch import get_backend, set_backend, use_backend, use_triton
from .layer_norm import layer_norm
from .rms_norm import rms_norm
from .softmax import softmax
from .bias_gelu import bias_gelu
from .swiglu import swiglu
from .rotary import rotary
from .cross_entropy import cross_entropy
from .flash_attention import flash_attention, flash_attention_block, flash_attention_block_backward
from .adamw import adamw_step
from .self_check import set_self_check
from . import choice  # installs use_triton's gate (the self-check, then the measured choice)
from .choice import get_kernel_choice, set_kernel_choice
# not re-exported: `kernels.grouped_gemm` stays the module (benchmarks/moe.py imports it as one)

__all__ = ["layer_norm", "rms_norm", "softmax", "bias_gelu", "swiglu", "rotary", "cross_entropy",
           "flash_attention", "flash_attention_block", "flash_attention_block_backward", "adamw_step", "set_backend",
           "get_backend", "use_backend", "use_triton", "set_self_check", "set_kernel_choice", "get_kernel_choice"]
