"""Multi-token prediction (DeepSeek-V3's MTP; Megatron's --mtp-num-layers D, --mtp-loss-scaling-factor λ).

D modules follow the decoder on the last pipeline stage. Depth k (1..D) combines the previous depth's
hidden state h_{k-1} (h_0: the decoder's output after its final norm) with the embedding of the tokens k
places ahead, through one transformer layer of its own:
    h_k = final_layernorm_k(layer_k(eh_proj_k([enorm_k(emb(ids << k)); hnorm_k(h_{k-1})])))
and predicts the labels k places further on through the main model's (shared) output layer. `x << k`
moves a [b, s] tensor k tokens left along the whole sequence, zeros where nothing follows; the loss mask
moves with it, so the last k positions of every sequence count for nothing at depth k.

Loss: λ/D · Σ_k (masked CE sum at depth k) / (tokens left at depth k), the counts over the whole sequence
(summed over CP), so every layout computes the single process's value (Megatron divides by each CP
chunk's own count). With --calculate-per-token-loss each depth's sum is rescaled to the main loss's token
count (as Megatron), since the gradients are divided by that count. The loss enters the backward as the
MoE auxiliary losses do: AuxLossScaler on h_0 gives it the main loss's scale. Each depth's masked mean is
recorded for the log line ("mtp_k loss", megalite/training/auxiliary_losses.py).

Under CP one all-gather per micro-batch brings the first D tokens of every sequence chunk to the rank
holding the chunk before it; nothing else communicates beyond what the layers do. Generation and
evaluation skip the heads.
"""

import torch
from torch import nn

from megalite import parallel_state as ps
from megalite.distributed.cp_comm import all_gather_over_cp, cp_chunks, sum_over_cp
from megalite.moe.aux_losses import AuxLossScaler, AuxLossTracker
from megalite.tensor_parallel import ColumnParallelLinear, checkpoint
from megalite.tensor_parallel.layers import init_normal
from megalite.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megalite.transformer.block import attach_fp8, fp8_layer
from megalite.transformer.layer import TransformerLayer
from megalite.transformer.norm import build_norm
from megalite.transformer.utils import param_seed


class MTPLayer(nn.Module):
    """Depth k + 1 (k 0-based): Megatron's MultiTokenPredictionLayer, its parameter names included."""

    wgrad_store = None  # a split backward's (megalite/pipeline/wgrad.py attaches it): full recomputation's

    def __init__(self, config, k, grid):
        super().__init__()
        c, h = config, config.hidden_size
        self.config, self.grid = c, grid
        self.sp = c.sequence_parallel and grid.tp > 1
        self.enorm = build_norm(c, h, grid=grid)
        self.hnorm = build_norm(c, h, grid=grid)
        # [emb; h] -> h, sharded by output features; the whole output is gathered and, under SP, cut again
        self.eh_proj = ColumnParallelLinear(2 * h, h, bias=False, gather_output=True,
                                            init_method=init_normal(c.init_method_std),
                                            sequence_parallel=c.sequence_parallel,
                                            init_seed=param_seed(c.seed, f"mtp.layers.{k}.eh_proj"),
                                            params_dtype=c.params_dtype, grid=grid)
        # numbered after the decoder's layers (the MoE log, the routers' records); built as the decoder's last
        self.transformer_layer = TransformerLayer(c, c.num_layers + k + 1, f"mtp.layers.{k}.transformer_layer", grid)
        self.final_layernorm = build_norm(c, h, grid=grid)
        if c.fp8 and fp8_layer(c, c.num_layers + k):  # (its projection and layer's GEMMs, as the decoder's last)
            attach_fp8(self, c)

    def _forward(self, h, emb, rotary, attn_mask):
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        if self.sp:
            x = scatter_to_sequence_parallel_region(x, grid=self.grid)
        return self.final_layernorm(self.transformer_layer(x, rotary, attn_mask))

    def forward(self, h, emb, rotary=None, attn_mask=None):
        if self.config.recompute_granularity == "full" and self.training:
            return checkpoint(self._forward, h, emb, rotary, attn_mask, wgrad_store=self.wgrad_store)
        return self._forward(h, emb, rotary, attn_mask)


class MTPBlock(nn.Module):
    def __init__(self, config, grid):
        super().__init__()
        self.config, self.grid = config, grid
        self.layers = nn.ModuleList(MTPLayer(config, k, grid) for k in range(config.mtp_num_layers))
        self.aux_tracker = AuxLossTracker()  # its own until the model's chunks share one (moe/aux_losses.py)

    def forward(self, h0, input_ids, position_ids, labels, loss_mask, rotary, attn_mask, embedding, loss_fn):
        """h_0 with the MTP loss attached (its gradient joins the backward through h_0). embedding(ids,
        positions) -> the model's embedding output; loss_fn(h, labels) -> per-token loss [b, s] through the
        shared output layer."""
        c, d = self.config, len(self.layers)
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        moving = [input_ids, labels, mask] + ([] if position_ids is None else [position_ids.expand_as(labels)])
        shifted = shift_left(moving, d, self.grid)
        sums, counts, h = [], [], h0
        for k, layer in enumerate(self.layers):
            ids, lab, m = shifted[k][:3]
            pos = shifted[k][3] if position_ids is not None else None
            h = layer(h, embedding(ids, pos), rotary, attn_mask)
            sums.append((loss_fn(h, lab) * m).sum())
            counts.append(m.sum())
        # the whole sequence's tokens
        counts = sum_over_cp(torch.stack(counts + [mask.sum()]).detach(), ps.current_grid(self.grid))
        whole = counts[-1]
        total = 0.0
        for k, (s, n) in enumerate(zip(sums, counts[:-1])):
            mean = s / n.clamp(min=1.0)  # a micro-batch with no token left at this depth adds 0
            self.aux_tracker.record("mtp loss", k + 1, mean)  # this CP rank's part of the depth's mean
            total = total + (mean * whole if c.calculate_per_token_loss else mean)
        return AuxLossScaler.apply(h0, total * (c.mtp_loss_scaling_factor / d), self.aux_tracker)


def shift_left(tensors, depth, grid):
    """[[t << k for t in tensors] for k = 1..depth] of [b, s_local] tensors: each moved k tokens left along
    the whole sequence, zeros where no token follows. Under CP a rank holds two chunks of the sequence
    (cp_comm's layout); the tokens that move into a chunk's end come from the next chunk's start, which one
    all-gather of every chunk's first `depth` tokens provides."""
    cp = grid.cp
    if cp == 1:
        chunks, ids, n = [tensors], [0], 1
    else:
        chunks = [list(p) for p in zip(*(t.chunk(2, dim=1) for t in tensors))]
        ids, n = list(cp_chunks(grid.cp_rank, cp)), 2 * cp
    if chunks[0][0].shape[1] < depth:
        raise ValueError(f"multi-token prediction: {depth} layers need at least {depth} tokens per sequence chunk, "
                         f"got {chunks[0][0].shape[1]}")
    if cp > 1:  # heads[j]: chunk j's first `depth` tokens, every tensor stacked (float64 holds token ids exactly)
        mine = torch.stack([torch.stack([t[:, :depth].double() for t in ch]) for ch in chunks])
        gathered = all_gather_over_cp(mine.unsqueeze(0), 0, grid=ps.current_grid(grid))  # [cp, 2, n_tensors, b, depth]
        heads = [None] * n
        for r in range(cp):
            for i, j in enumerate(cp_chunks(r, cp)):
                heads[j] = gathered[r, i]
    out = []
    for k in range(1, depth + 1):
        parts = []
        for ch, j in zip(chunks, ids):
            moved = []
            for i, t in enumerate(ch):
                follow = heads[j + 1][i, :, :k].to(t.dtype) if j + 1 < n else t.new_zeros(t.shape[0], k)
                moved.append(torch.cat([t[:, k:], follow], dim=1))
            parts.append(moved)
        out.append([torch.cat(p, dim=1) for p in zip(*parts)] if len(parts) > 1 else parts[0])
    return out
