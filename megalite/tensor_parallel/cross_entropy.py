"""Cross-entropy over logits whose vocabulary dimension is split across TP ranks.

Communication: one MAX all-reduce of the per-token local maxima, then ONE fused SUM
all-reduce of (sum of exp, target logit[, sum of logits for label smoothing]). Columns at
or above the real vocabulary size (padding) take no part in the softmax and get no gradient.
"""

import torch

from megalite import parallel_state as ps
from megalite.tensor_parallel.mappings import all_reduce_max_tp, all_reduce_sum_tp


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, vocab_size):
        per = logits.shape[-1]
        start = ps.get_tensor_model_parallel_rank() * per
        full = per * ps.get_tensor_model_parallel_world_size()
        vocab_size = full if vocab_size is None else vocab_size
        ctx.dtype = logits.dtype
        logits = logits.float()
        n_pad = max(0, min(per, start + per - vocab_size))  # padded columns on this rank
        if n_pad:
            logits = logits.clone()
            logits[..., per - n_pad:] = float("-inf")
        local_max = logits.max(dim=-1).values
        # A rank holding only padding has -inf max; keep it finite for the reduction.
        local_max = torch.nan_to_num(local_max, neginf=torch.finfo(torch.float32).min)
        all_reduce_max_tp(local_max)
        shifted = logits - local_max.unsqueeze(-1)
        in_range = (target >= start) & (target < start + per)
        local_t = (target - start).masked_fill(~in_range, 0)
        t_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        exp = shifted.exp()
        stats = [exp.sum(dim=-1), t_logit]
        if label_smoothing > 0:
            real = shifted[..., :per - n_pad] if n_pad else shifted
            stats.append(real.sum(dim=-1))
        stats = torch.stack(stats)
        all_reduce_sum_tp(stats)
        sum_exp, t_logit = stats[0], stats[1]
        log_z = sum_exp.log()
        loss = log_z - t_logit
        if label_smoothing > 0:
            # mean over the real vocabulary of -log p = log Z - mean(shifted logits)
            smooth = log_z - stats[2] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, reused by backward
        ctx.save_for_backward(exp, local_t, in_range)
        ctx.label_smoothing, ctx.vocab_size, ctx.n_pad = label_smoothing, vocab_size, n_pad
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, in_range = ctx.saved_tensors
        ls, n_pad = ctx.label_smoothing, ctx.n_pad
        grad = softmax  # d loss / d logits = softmax - (1-ls) onehot - ls/V (real columns)
        onehot_w = (1.0 - ls) * in_range.to(grad.dtype)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -onehot_w.unsqueeze(-1))
        if ls > 0:
            per = grad.shape[-1]
            grad[..., :per - n_pad].sub_(ls / ctx.vocab_size)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, vocab_size=None):
    """Per-token loss (fp32) of logits [..., V/TP] against global target ids [...].

    vocab_size: the real (unpadded) vocabulary; columns beyond it are ignored.
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, vocab_size)
