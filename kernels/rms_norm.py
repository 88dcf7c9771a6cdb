"""RMSNorm over the last dim (Llama / Megatron RMSNorm); shares the Triton kernel with LayerNorm."""
import torch

from ._dispatch import use_triton
from .layer_norm import _NormFn


def _rms_norm_torch(x, weight, eps):
    if hasattr(torch.nn.functional, "rms_norm"):  # torch >= 2.4: what torch.nn.RMSNorm runs
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rms_norm(x, weight, eps=1e-5):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim; weight [N]."""
    if use_triton(x, weight, kernel="rms_norm"):
        return _NormFn.apply(x, weight, None, eps, True)
    return _rms_norm_torch(x, weight, eps)
