"""The largest attention logit per query head (MuonClip, --qk-clip): max over this rank's queries of
q.k / sqrt(d) against every key its query may see (causal), in fp32, outside autograd. Under context
parallelism the keys of the other CP ranks are gathered (queries stay local), so the maximum covers
whole sequences; the data-parallel and CP maxima are combined after the step (optimizer/qk_clip.py)."""

import math

import torch

from megalite import parallel_state as ps
from megalite.distributed.cp_comm import all_gather_over_cp, cp_size, global_token_index, local_token_index

CHUNK = 256  # query rows per score block: the scores of one block are [b, heads, CHUNK, keys]


@torch.no_grad()
def max_logits(q, k, grid=None):
    """q [b, s, heads, d], k [b, s, groups, d] (GQA: heads / groups queries per key) -> [heads] fp32."""
    q, k = q.detach().float(), k.detach().float()
    if grid is None and ps.model_parallel_is_initialized():  # (the global grid, as the parallel layers' default;
        grid = ps.current_grid()                              # before any grid: one process, no CP)
    b, s, h, d = q.shape
    qpos = torch.arange(s, device=q.device) if grid is None else global_token_index(s, q.device, grid)
    kpos = qpos
    if grid is not None and cp_size(grid) > 1:
        k = all_gather_over_cp(k.contiguous(), 1, grid)
        kpos = torch.cat([local_token_index(s, r, grid.cp, q.device) for r in range(grid.cp)])
    k = k.repeat_interleave(h // k.shape[2], dim=2)
    best = torch.full((h,), float("-inf"), device=q.device)
    for i in range(0, s, CHUNK):
        scores = torch.einsum("bshd,bthd->bhst", q[:, i:i + CHUNK], k) / math.sqrt(d)
        scores = scores.masked_fill(qpos[i:i + CHUNK, None] < kpos[None, :], float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best
