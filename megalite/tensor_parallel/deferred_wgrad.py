"""A linear layer's weight gradient deferred (the split backward of zero-bubble pipelines, megalite/pipeline/
zero_bubble.py): the backward computes the input gradient (B) at once and hands the weight gradient's GEMM to a
store as a closure over what it reads (the layer's input and its output's gradient), run when the schedule says W.
The backward returns no gradient for the weight, so its accumulation does nothing at B (autograd skips an undefined
gradient, hooks included); W computes the gradient and the schedule accumulates it through autograd
(`torch.autograd.backward` on the parameters, megalite/pipeline/run.py), so the data-parallel wrapper's
post-accumulate hooks (main_grad, bucket readiness) fire at W, once per parameter, as after an ordinary backward.
The embedding's is deferred the same way (its dense gradient, the rows looked up summed)."""

import torch
import torch.nn.functional as F


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, param = ctx.saved_tensors

        def weight_gradient():  # (W: nobody waits for it; x and grad stay alive until then) -> (param, gradient)
            g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
            return param, g2.t().mm(x2).to(param.dtype)
        ctx.store.put(weight_gradient)
        grad_x = grad.matmul(param) if ctx.needs_input_grad[0] else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b, None  # (None for the weight: its AccumulateGrad does nothing at B)


def deferred_linear(x, weight, bias, store):
    """F.linear(x, weight, bias) whose weight gradient `store.put`s a closure returning (weight, its gradient) (the
    bias's comes at once: it is a sum, and accumulates at the same W, megalite/pipeline/run.py); store None (no
    split backward) or a frozen weight: F.linear."""
    if store is None or not weight.requires_grad:
        return F.linear(x, weight, bias)
    return _DeferredLinear.apply(x, weight, bias, store)


class _DeferredEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, store):
        ctx.save_for_backward(ids, weight)
        ctx.store = store
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        ids, param = ctx.saved_tensors

        def weight_gradient():  # the rows looked up, summed (a dense gradient, as F.embedding's backward gives)
            rows = grad.reshape(-1, grad.shape[-1]).to(param.dtype)
            return param, torch.zeros_like(param).index_add_(0, ids.reshape(-1), rows)
        ctx.store.put(weight_gradient)
        return None, None, None


def deferred_embedding(ids, weight, store):
    """F.embedding(ids, weight) whose weight gradient is deferred to `store` (as deferred_linear's; None: none)."""
    if store is None or not weight.requires_grad:
        return F.embedding(ids, weight)
    return _DeferredEmbedding.apply(ids, weight, store)
