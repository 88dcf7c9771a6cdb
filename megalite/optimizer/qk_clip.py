"""MuonClip (`--qk-clip`, Megatron's / Kimi K2's): after each optimizer step, every query group whose largest
attention logit of the step passed the threshold gets its q rows scaled by eta^alpha and its k rows by
eta^(1-alpha), eta = threshold / that logit, so the group's logits (q.k is bilinear; rope is a rotation)
shrink by eta and the largest lands on the threshold.

The maxima come from the attention forwards (transformer/max_logit.py: each rank's queries against whole
sequences, CP's keys gathered) and are combined over DP x CP here (each DP rank saw other samples, each CP
rank other queries); a TP rank holds whole heads, so TP needs nothing. The scaling is applied to the
optimizer's fp32 main weights (ZeRO: each rank to its pieces), then the model's weights take them as after
a step (publish_main_params: one copy, or ZeRO's all-gather) -- only on a step where some group was clipped,
decided over the whole world so that every rank issues the same collectives.
"""

import torch
import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.transformer.attention import SelfAttention


def _attention_layers(chunks):
    return [m for c in chunks for m in c.modules() if isinstance(m, SelfAttention)]


def _all_reduce_max(t, group=None):
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


@torch.no_grad()
def clip_qk(chunks, optimizer, threshold, alpha, clip=True):
    """Clip this step's over-threshold query groups (clip=False: only read the maxima); returns the step's
    largest logit over the world (-inf: none seen)."""
    layers = [a for a in _attention_layers(chunks) if a.max_logits is not None]
    dev = ps.get_device()
    clipped = torch.zeros(1, device=dev)
    scales, top = [], torch.full((1,), float("-inf"), device=dev)
    if layers:  # every layer's maxima in one all-reduce over DP x CP (its ranks hold the same layers)
        maxima = torch.cat([a.max_logits for a in layers])
        _all_reduce_max(maxima, ps.grid_of(chunks).dp_cp()[0])
        for attn, m in zip(layers, maxima.split([a.max_logits.numel() for a in layers])):
            attn.max_logits = None
            grouped = m.view(attn.groups_local, attn.q_per_group).amax(dim=1)
            top = torch.maximum(top, grouped.max().reshape(1))
            if clip:
                eta = (threshold / grouped).clamp(max=1.0)
                rows = torch.ones(attn.groups_local, attn.q_per_group + 2, attn.d, device=dev)
                rows[:, :attn.q_per_group] = eta.pow(alpha)[:, None, None]
                rows[:, attn.q_per_group] = eta.pow(1 - alpha)[:, None]
                scales.append((attn.linear_qkv.weight, rows.reshape(-1)))
                clipped = torch.maximum(clipped, (grouped > threshold).any().float().reshape(1))
    both = torch.cat([clipped, top])
    _all_reduce_max(both)  # one all-reduce: whether any rank clips, and the world's largest logit
    if both[0].item():
        _scale_rows(optimizer, scales)
        optimizer.publish_main_params()
    return both[1].item()


def _scale_rows(optimizer, scales):
    """main weights x the per-row factors of each weight (ZeRO: this rank's flat pieces of them)."""
    factor = {id(w): rows for w, rows in scales}
    pieces = getattr(optimizer, "pieces", None)
    for i, (p, main) in enumerate(zip(optimizer._held(), optimizer.main_params)):
        rows = factor.get(id(p))
        if rows is None:
            continue
        flat = rows.repeat_interleave(p.shape[1])
        start, end = (pieces[i].start, pieces[i].end) if pieces is not None else (0, p.numel())
        main.view(-1).mul_(flat[start:end])


def after_step(chunks, optimizer, stepped, clip):
    """The training loop's call: clip (clip: --qk-clip) after an update and keep the step's largest logit in
    optimizer.max_attention_logit (--log-max-attention-logit); after a skipped (fp16) step only forget the
    maxima."""
    c = optimizer.config
    optimizer.max_attention_logit = None
    if stepped:
        optimizer.max_attention_logit = clip_qk(chunks, optimizer, c.qk_clip_threshold, c.qk_clip_alpha, clip)
        return optimizer.max_attention_logit
    for attn in _attention_layers(chunks):
        attn.max_logits = None
    return None
