"""LayerNorm / RMSNorm through `kernels` (Triton on CUDA, torch's own ops on CPU)."""

import torch
from torch import nn

import kernels
from megalite.transformer.utils import kernel_backend


class LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=False, fused=True, dtype=torch.float32,
                 device=None):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
        for p in (self.weight, self.bias):
            p.sequence_parallel = sequence_parallel  # grads are partial under SP: summed over TP

    def forward(self, x):
        with kernel_backend(self.fused):
            return kernels.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=False, fused=True, dtype=torch.float32,
                 device=None):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x):
        with kernel_backend(self.fused):
            return kernels.rms_norm(x, self.weight, self.eps)


def build_norm(config, hidden_size, device=None):
    from megalite import parallel_state as ps
    device = device or ps.get_device()
    cls = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
    sp = config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1
    return cls(hidden_size, eps=config.layernorm_epsilon, sequence_parallel=sp,
               fused=config.fused_kernels, dtype=config.params_dtype, device=device)
