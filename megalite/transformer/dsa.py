"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2) on multi-latent attention: Megatron-Core's DSAttention
and DSAIndexer (--experimental-attention-variant dsa), its unfused reference path.

The lightning indexer, per token t; x: the layer's input, c: MLA's query latent after its norm (x itself
without --q-lora-rank); H = --dsa-indexer-n-heads, d = --dsa-indexer-head-dim:
  q_j(t) = R_t (W_qb c(t))_j  (H heads of d),   k(t) = R_t LayerNorm(W_k x(t))  (d, one key for all heads)
  w_j(t) = (W_w x(t))_j / sqrt(H d)
  I(t, s) = sum_j w_j(t) ReLU(q_j(t) . k(s))            (no ReLU with --no-dsa-indexer-scoring-relu)
R rotates the first qk_pos_emb_head_dim dims of each head (Megatron puts the rotary part first) by MLA's
frequencies and YaRN concentration, in the rotate-half layout (MLA's pairs: --dsa-indexer-rope-interleaved).
Megatron's Hadamard rotation of q and k (--dsa-indexer-rotate-activation, default on; it needs the
fast_hadamard_transform package) is orthogonal and applied to both: every q.k is unchanged, so it is skipped.
Selection: S(t) = top-k (--dsa-indexer-topk) of I(t, .) with the causal (or document) mask as -inf; -inf
picks are dropped, so topk >= t + 1 is MLA's dense causal attention. MLA attends to S(t) only (a mask).
Indexer loss (training, --dsa-indexer-loss-coeff > 0), with MLA's q_h, k_h and softmax scale:
  p(t, .) = sum_h softmax(q_h(t) k_h^T * scale, masked) / its sum,   P(t, .) = softmax(I(t, .), masked)
  loss = coeff * mean_t KL(p(t) || P(t))   (sum over t with --calculate-per-token-loss; both distributions
  restricted to S(t) with --dsa-indexer-use-sparse-loss).
Detached, as Megatron: x and c enter the indexer detached (it learns from its loss only), MLA's q, k enter
p detached, the top-k indices carry no gradient. The loss reaches the backward through MLA's attention
output (AuxLossScaler: scaled as the main loss, like MoE's aux losses) and is recorded as "indexer loss".
TP: the indexer weights are replicated; under SP the indexer gathers x and c over the sequence and every
TP rank computes the whole indexer, so its gradients are whole on every rank (not summed over TP; Megatron
averages these identical copies); p sums the heads of every TP rank (an all-reduce of the probabilities).
"""

import torch
import torch.nn.functional as F
from torch import nn

from megalite.moe import decisions
from megalite import parallel_state as ps
from megalite.moe.aux_losses import AuxLossScaler, AuxLossTracker
from megalite.tensor_parallel import (
    DuplicatedLinear,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megalite.tensor_parallel.init import init_normal, param_seed
from megalite.transformer.norm import LayerNorm
from megalite.transformer.rope import apply_rotary

EPS = 1e-10  # Megatron's INDEXER_LOSS_EPS


def index_scores(q, k, w, relu=True):
    """q [b, s, H, d], k [b, t, d], w [b, s, H] -> I [b, s, t] in fp32."""
    scores = torch.einsum("bshd,btd->bsht", q.float(), k.float())
    if relu:
        scores = scores.relu()
    return (scores * w.float().unsqueeze(-1)).sum(dim=2)


def select_topk(scores, masked, topk):
    """scores [b, s, t], masked bool [b, s, t] (True: not attendable) -> selected bool [b, s, t]."""
    scores = scores.detach().masked_fill(masked, float("-inf"))
    vals, idx = decisions.topk(scores, min(topk, scores.shape[-1]), -1, "dsa top-k")
    return torch.zeros_like(masked).scatter_(-1, idx, vals != float("-inf"))


def indexer_loss(scores, q, k, softmax_scale, masked, selected, coeff, sparse=False, per_token=False, grid=None):
    """KL(MLA's head-summed attention || the indexer's softmax) * coeff. scores [b, s, t] (with grad);
    q, k [b, s, heads, dq] (this TP rank's heads, detached here); masked / selected bool [b, s, t]."""
    invalid = masked | ~selected if sparse else masked
    with torch.no_grad():
        att = torch.einsum("bshd,bthd->bhst", q.detach().float(), k.detach().float()) * softmax_scale
        att = att.masked_fill(invalid.unsqueeze(1), float("-inf")).softmax(dim=-1).sum(dim=1)
        grid = ps.current_grid(grid)
        if grid.tp > 1:  # every TP rank's heads
            att = reduce_from_tensor_model_parallel_region(att.contiguous(), grid=grid)
        target = att / att.sum(dim=-1, keepdim=True).clamp_min(EPS)
    logp = scores.masked_fill(invalid, float("-inf")).log_softmax(dim=-1)
    kl = (target * (target.clamp_min(EPS).log() - logp)).masked_fill(invalid, 0.0).sum(dim=-1)
    return coeff * (kl.sum() if per_token else kl.mean())


def _replicated(config, inp, out, name):
    """The indexer's weights read the gathered sequence: a whole gradient on every TP rank."""
    c = config
    return DuplicatedLinear(inp, out, init_normal(c.init_method_std), param_seed(c.seed, name), c.params_dtype,
                            partial_grads=False)


class DSAIndexer(nn.Module):
    def __init__(self, config, prefix, grid=None):
        super().__init__()
        c = self.config = config
        self.grid = ps.current_grid(grid)
        self.heads, self.dim = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
        self.linear_wq_b = _replicated(c, c.q_lora_rank or c.hidden_size, self.heads * self.dim,
                                       prefix + ".linear_wq_b")
        self.linear_wk = _replicated(c, c.hidden_size, self.dim, prefix + ".linear_wk")
        eps = c.dsa_indexer_k_norm_epsilon if c.dsa_indexer_k_norm_epsilon is not None else c.layernorm_epsilon
        self.k_norm = LayerNorm(self.dim, eps=eps, fused=c.fused_kernels, dtype=c.params_dtype,
                                device=ps.get_device(), zero_centered=c.apply_layernorm_1p)
        self.linear_weights_proj = _replicated(c, c.hidden_size, self.heads, prefix + ".linear_weights_proj")

    def _rope(self, t, rotary):
        if rotary is None:
            return t
        cos, sin = rotary  # MLA's tables: interleaved layout [s, rot]
        inter = self.config.dsa_indexer_rope_interleaved
        if not inter:  # the same frequencies, rotating halves
            cos, sin = (torch.cat([x[:, 0::2], x[:, 0::2]], dim=-1) for x in (cos, sin))
        return apply_rotary(t, cos, sin, self.config.fused_kernels, interleaved=inter)

    def forward(self, x, qr, rotary):
        """x [s(/TP), b, h], qr [s(/TP), b, q latent] (both detached) -> q [b, s, H, d], k [b, s, d], w [b, s, H]."""
        c = self.config
        if c.sequence_parallel and self.grid.tp > 1:
            x, qr = (gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False, grid=self.grid)
                     for t in (x, qr))
        x, qr = x.transpose(0, 1), qr.transpose(0, 1)
        b, s = x.shape[:2]
        q = self._rope(self.linear_wq_b(qr).view(b, s, self.heads, self.dim), rotary)
        k = self.linear_wk(x)
        if c.dsa_indexer_k_norm_fp32:
            n = self.k_norm
            gamma = n.weight + 1 if n.zero_centered else n.weight
            k = F.layer_norm(k.float(), (self.dim,), gamma.float(), n.bias.float(), n.eps).to(k.dtype)
        else:
            k = self.k_norm(k)
        k = self._rope(k.unsqueeze(2), rotary).squeeze(2)
        w = self.linear_weights_proj(x) * (self.heads * self.dim) ** -0.5
        return q, k, w


class DSAttention(nn.Module):
    """The indexer of one MLA layer and what it gives MLA's core attention: a mask and the indexer loss."""

    def __init__(self, config, prefix, layer_number, softmax_scale, grid=None):
        super().__init__()
        self.config, self.layer_number, self.softmax_scale = config, layer_number, softmax_scale
        self.indexer = DSAIndexer(config, prefix + ".indexer", grid)
        self.grid = self.indexer.grid
        self.aux_tracker = AuxLossTracker()  # its own until the model's chunks share one (moe/aux_losses.py)

    def forward(self, x, qr, q, k, rotary, attn_mask=None):
        """x, qr: the layer's input and query latent [s(/TP), b, .]; q, k: MLA's [b, s, heads, dq];
        attn_mask: None (causal) or bool [b, 1, s, s] (True: masked) -> (bool mask [b, 1, s, s] for core
        attention, indexer loss or None)."""
        c = self.config
        coeff = c.dsa_indexer_loss_coeff or 0.0
        with_loss = self.training and torch.is_grad_enabled() and coeff > 0
        with torch.enable_grad() if with_loss else torch.no_grad():
            iq, ik, iw = self.indexer(x.detach(), qr.detach(), rotary)
            scores = index_scores(iq, ik, iw, c.dsa_indexer_scoring_relu)
        b, s, t = scores.shape
        if attn_mask is None:
            masked = torch.ones(s, t, dtype=torch.bool, device=scores.device).triu(1).expand(b, s, t)
        else:
            masked = attn_mask[:, 0].expand(b, s, t)
        selected = select_topk(scores, masked, c.dsa_indexer_topk)
        loss = None
        if with_loss:
            loss = indexer_loss(scores, q, k, self.softmax_scale, masked, selected, coeff,
                                c.dsa_indexer_use_sparse_loss, c.calculate_per_token_loss, self.grid)
            self.aux_tracker.record("indexer loss", self.layer_number, loss)
        return (~selected).unsqueeze(1), loss

    def attach(self, ctx, loss):
        """ctx unchanged; the loss's gradient (the main loss's scale) joins the backward through it."""
        return ctx if loss is None else AuxLossScaler.apply(ctx, loss, self.aux_tracker)
