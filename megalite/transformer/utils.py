"""Small helpers shared by the transformer modules."""

import contextlib
import math
import zlib

import kernels


def param_seed(seed, name):
    """A stable per-parameter init seed: the same weight whatever the topology."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def output_init_std(config):
    """Megatron's scaled init for layers that write into the residual stream."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


def kernel_backend(fused):
    """Context for the model's `kernels` calls: kernels dispatch themselves (Triton on CUDA,
    torch on CPU); --no-fused-kernels forces the torch path everywhere."""
    return contextlib.nullcontext() if fused else kernels.use_backend("torch")
