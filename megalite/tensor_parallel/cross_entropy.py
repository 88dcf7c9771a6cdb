"""Cross-entropy over logits whose vocabulary dimension is split across TP ranks.

The per-rank arithmetic is `kernels.cross_entropy` (Triton on CUDA, the same algorithm in
torch on CPU); this wrapper supplies the TP-group reductions. Communication: one MAX
all-reduce of the per-token maxima, then ONE fused SUM all-reduce of (sum of exp, target
logit[, sum of logits for label smoothing]). Columns at or above the real vocabulary size
(padding) take no part in the softmax and get no gradient.
"""

import contextlib
import functools

import kernels
from megalite import parallel_state as ps
from megalite.tensor_parallel.mappings import all_reduce_max_tp, all_reduce_sum_tp


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, vocab_size=None,
                                 inplace_backward=False, fused=True, grid=None):
    """Per-token loss (fp32) of logits [..., V/TP] against global target ids [...].

    vocab_size: the real (unpadded) vocabulary; columns beyond it are ignored.
    inplace_backward: write the gradient into the logits' storage (they must not be used
    after the loss), so no second logits-sized tensor is allocated.
    fused=False forces the torch path even on CUDA (--no-fused-kernels).
    Label smoothing follows torch.nn.functional.cross_entropy. grid: whose TP group splits the vocabulary.
    """
    grid = ps.current_grid(grid)
    per, tp = vocab_parallel_logits.shape[-1], grid.tp
    start = grid.tp_rank * per
    vocab_size = per * tp if vocab_size is None else vocab_size
    reduce_max, reduce_sum = (functools.partial(all_reduce_max_tp, grid=grid),
                              functools.partial(all_reduce_sum_tp, grid=grid)) if tp > 1 else (None, None)
    with contextlib.nullcontext() if fused else kernels.use_backend("torch"):
        return kernels.cross_entropy(vocab_parallel_logits, target, label_smoothing, vocab_start_index=start,
                                     vocab_size=vocab_size, allreduce_max=reduce_max, allreduce_sum=reduce_sum,
                                     inplace_backward=inplace_backward)
