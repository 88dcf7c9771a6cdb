"""The MLP's activation of fc1's output, shared by the dense MLP (transformer/mlp.py) and the MoE experts'
grouped path (moe/experts.py), and the context that picks the kernels' backend. A leaf below both packages:
megalite.transformer imports megalite.moe, never the other way."""

import contextlib

import torch.nn.functional as F

import kernels


def kernel_backend(fused):
    """Context for the model's `kernels` calls: kernels dispatch themselves (Triton on CUDA,
    torch on CPU); --no-fused-kernels forces the torch path everywhere."""
    return contextlib.nullcontext() if fused else kernels.use_backend("torch")


def bias_gelu(x, bias, fused):
    if bias is None:  # the kernel's gain is fusing the bias add
        return F.gelu(x, approximate="tanh")
    with kernel_backend(fused):
        return kernels.bias_gelu(x, bias)


def swiglu(x, bias, fused):
    if bias is not None:
        x = x + bias
    with kernel_backend(fused):
        return kernels.swiglu(x)


def activation(c, h, b=None):
    """The MLP's activation of fc1's output h and bias b (or None): SwiGLU or GeGLU, squared ReLU, erf or tanh
    GeLU."""
    if c.swiglu and getattr(c, "geglu", False):  # (Gemma's GeGLU: torch's ops, no fused kernel)
        gate, up = (h if b is None else h + b).chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    if c.swiglu:
        return swiglu(h, b, c.fused_kernels)
    if c.squared_relu:  # Megatron's squared_relu, after the bias
        return F.relu(h if b is None else h + b).pow(2)
    if c.gelu == "exact":  # erf GeLU (BERT); the fused kernel is the tanh approximation
        return F.gelu(h if b is None else h + b)
    return bias_gelu(h, b, c.fused_kernels)
