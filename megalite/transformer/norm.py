"""LayerNorm / RMSNorm through `kernels` (Triton on CUDA, torch's own ops on CPU).

zero_centered (Megatron's --apply-layernorm-1p): the weight parameter holds gamma - 1, starts at 0
and the norm scales by 1 + weight, so weight decay pulls gamma towards 1, not 0."""

import torch
from torch import nn

import kernels
from megalite.tensor_parallel.init import ConstantRecipe, with_recipe
from megalite.transformer.utils import kernel_backend


class LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=False, fused=True, dtype=torch.float32,
                 device=None, zero_centered=False):
        super().__init__()
        self.eps, self.fused, self.zero_centered = eps, fused, zero_centered
        self.weight = with_recipe(nn.Parameter((torch.zeros if zero_centered else torch.ones)(
            hidden_size, dtype=dtype, device=device)), ConstantRecipe(0 if zero_centered else 1))
        self.bias = with_recipe(nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)), ConstantRecipe(0))
        for p in (self.weight, self.bias):
            p.sequence_parallel = sequence_parallel  # grads are partial under SP: summed over TP

    def forward(self, x):
        with kernel_backend(self.fused):
            return kernels.layer_norm(x, _gamma(self), self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=False, fused=True, dtype=torch.float32,
                 device=None, zero_centered=False):
        super().__init__()
        self.eps, self.fused, self.zero_centered = eps, fused, zero_centered
        self.weight = with_recipe(nn.Parameter((torch.zeros if zero_centered else torch.ones)(
            hidden_size, dtype=dtype, device=device)), ConstantRecipe(0 if zero_centered else 1))
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x):
        with kernel_backend(self.fused):
            return kernels.rms_norm(x, _gamma(self), self.eps)


def _gamma(norm):
    return norm.weight + 1 if norm.zero_centered else norm.weight


def build_norm(config, hidden_size, device=None, partial_grads=None, grid=None):
    """partial_grads: the norm sees only part of what its gradient sums over on each TP rank
    (default: the sequence slice under SP; q/k norms see this rank's heads): summed over TP of `grid`."""
    from megalite import parallel_state as ps
    device = device or ps.get_device()
    cls = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
    tp = ps.current_grid(grid).tp > 1
    partial = (config.sequence_parallel if partial_grads is None else partial_grads) and tp
    return cls(hidden_size, eps=config.layernorm_epsilon, sequence_parallel=partial,
               fused=config.fused_kernels, dtype=config.params_dtype, device=device,
               zero_centered=config.apply_layernorm_1p)
