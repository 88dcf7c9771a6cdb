"""Fused AdamW over flat fp32 buffers (fits the distributed optimizer's contiguous shards).

adamw_step(params, grads, exp_avg, exp_avg_sq, *, step, lr=1e-3, beta1=0.9, beta2=0.999,
           eps=1e-8, weight_decay=1e-2, grad_scale=1.0, model_params=None)
  params, exp_avg, exp_avg_sq: fp32, same numel, contiguous; updated in place.
  grads: same numel, fp32/bf16/fp16 (multiplied by grad_scale first, e.g. 1/loss_scale).
  step: this update's 1-based count (torch's state["step"] after its increment).
  model_params: optional same-numel buffer (bf16/fp16/fp32) that receives the new params,
  cast, in the same pass.
Semantics are torch.optim.AdamW's (decoupled weight decay, bias correction, eps added after
the bias-corrected sqrt); the torch fallback runs the very ops of its single-tensor path.
"""

import torch
import triton
import triton.language as tl

from ._dispatch import use_triton

BLOCK = 1024


@triton.jit
def _adamw_kernel(P, G, M, V, OUT, numel, decay, beta1, beta2, eps, step_size, bc2_sqrt, grad_scale,
                  HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = offs < numel
    p = tl.load(P + offs, mask=msk, other=0.0)
    g = tl.load(G + offs, mask=msk, other=0.0).to(tl.float32) * grad_scale
    m = tl.load(M + offs, mask=msk, other=0.0)
    v = tl.load(V + offs, mask=msk, other=0.0)
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)  # torch: exp_avg.lerp_(grad, 1 - beta1)
    v = v * beta2 + (1.0 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    tl.store(P + offs, p, mask=msk)
    tl.store(M + offs, m, mask=msk)
    tl.store(V + offs, v, mask=msk)
    if HAS_OUT:
        tl.store(OUT + offs, p.to(OUT.dtype.element_ty), mask=msk)


def adamw_step(params, grads, exp_avg, exp_avg_sq, *, step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=1e-2, grad_scale=1.0, model_params=None):
    """One AdamW update in place; see the module docstring."""
    n = params.numel()
    for name, t in (("grads", grads), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("model_params", model_params)):
        if t is not None and (t.numel() != n or not t.is_contiguous()):
            raise ValueError(f"kernels.adamw_step: {name} must be contiguous with {n} elements "
                             f"(got {t.numel()}, contiguous={t.is_contiguous()})")
    for name, t in (("params", params), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"kernels.adamw_step: {name} must be contiguous fp32, got {t.dtype}")
    if step < 1:
        raise ValueError(f"kernels.adamw_step: step is 1-based, got {step}")
    bc1 = 1 - beta1 ** step
    bc2_sqrt = (1 - beta2 ** step) ** 0.5  # as torch: pow and math.sqrt differ in the last bit for some steps
    step_size = lr / bc1
    if use_triton(params, grads, exp_avg, exp_avg_sq, model_params, kernel="adamw_step"):
        if n:
            _adamw_kernel[(triton.cdiv(n, BLOCK),)](
                params, grads, exp_avg, exp_avg_sq, model_params if model_params is not None else params, n,
                1.0 - lr * weight_decay, beta1, beta2, eps, step_size, bc2_sqrt, grad_scale,
                HAS_OUT=model_params is not None, BLOCK=BLOCK, num_warps=4)
        return
    # torch.optim.AdamW single-tensor path, op for op. On a CPU the ops run chunk by chunk: each
    # op streams its operands, and a chunk's stay in cache across the six ops (a whole flat
    # buffer would go through memory once per op: measured 2x slower). Elementwise: same values.
    chunk = n if params.is_cuda else _CPU_CHUNK
    for start in range(0, n, chunk):
        sl = slice(start, start + chunk)
        _torch_update(params[sl], grads[sl], exp_avg[sl], exp_avg_sq[sl],
                      None if model_params is None else model_params[sl], lr, beta1, beta2, eps, weight_decay,
                      grad_scale, step_size, bc2_sqrt)


_CPU_CHUNK = 1 << 16


def _torch_update(params, grads, exp_avg, exp_avg_sq, model_params, lr, beta1, beta2, eps, weight_decay, grad_scale,
                  step_size, bc2_sqrt):
    g = grads if grad_scale == 1.0 else grads * grad_scale
    if g.dtype != torch.float32:
        g = g.float()
    if weight_decay != 0:
        params.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    params.addcdiv_(exp_avg, denom, value=-step_size)
    if model_params is not None:
        model_params.copy_(params)
