"""The top-k router of an MoE layer (Megatron-Core's TopKRouter) and its auxiliary losses.

logits = x W^T (in fp32, or --moe-router-dtype fp64) -> scores -> top-k:
- softmax: top-k of the logits, softmax over those k (--moe-router-pre-softmax: softmax over all
  experts, then top-k of the probabilities);
- sigmoid: sigmoid of the logits, top-k, normalised over the k when k > 1;
- --moe-router-topk-scaling-factor multiplies the k probabilities.
Auxiliary losses (Megatron's formulas), added to the training loss through the gradient only:
- aux_loss (Switch): coeff · E/(k·T²) · Σ_e (Σ_t p_te)(tokens to e), over this micro-batch's T tokens;
- seq_aux_loss: the same per sequence, averaged over the sequences;
- z-loss: coeff · mean_t logsumexp(logits_t)².
sinkhorn (Megatron's S-BASE routing): in training the k experts are the top-k of Sinkhorn-balanced
exp(logits) (rows and columns rescaled until every expert's column sums alike over the micro-batch),
their probabilities the plain scores (sigmoid for k = 1, else softmax), not renormalised; in
evaluation the top-k of the scores.
--moe-expert-capacity-factor then drops what exceeds each expert's capacity (drop_over_capacity).
--moe-router-enable-expert-bias (aux-loss-free balancing, DeepSeek-V3): the sigmoid top-k is chosen by
score + expert_bias (a parameter without gradient, fp32, checkpointed); each step's token counts
(int64, summed over the data-parallel ranks by megalite/distributed/finalize.py) move the bias by
±--moe-router-bias-update-rate towards the mean load.
Their gradients enter the backward scaled as the main loss is (AuxLossScaler: the loss scale over
the micro-batch count; per-token loss: the loss scale), and their values are recorded per layer for
the log line (the router's `aux_tracker`, moe/aux_losses.py).
"""

import math

import torch
from torch import nn

from megalite import mup, parallel_state as ps
from megalite.moe import decisions
from megalite.moe.aux_losses import AuxLossScaler, AuxLossTracker
from megalite.tensor_parallel.init import ConstantRecipe, init_normal, param_seed, replicated_init, with_recipe
from megalite.tensor_parallel.mappings import all_reduce_sum_tp_cp


def switch_aux_loss(probs, tokens_per_expert, total_tokens, topk, coeff):
    num_experts = probs.shape[-1]
    return (probs.sum(dim=0) * tokens_per_expert).sum() * (num_experts * coeff / (topk * total_tokens * total_tokens))


def z_loss(logits, coeff, total_tokens=None):
    """coeff · mean over the micro-batch's tokens of logsumexp²; total_tokens: the micro-batch's count
    when this rank holds a part of it (sequence parallelism: the TP ranks' parts sum to the mean)."""
    total = logits.shape[0] if total_tokens is None else total_tokens
    return torch.logsumexp(logits, dim=-1).square().sum() * (coeff / total)


def choose_experts(scores, topk, groups=None, group_topk=None):
    """torch.topk(scores, topk, 1) -> (values, indices); group-limited (DeepSeek-V3, Megatron's
    group_limited_topk): the E experts form `groups` groups of consecutive indices, a group scores the sum of
    its best topk // group_topk experts, each token keeps its best `group_topk` groups and takes its top-k
    among their experts."""
    if not groups:
        return decisions.topk(scores, topk, 1, "routing")
    t, e = scores.shape
    per_group = scores.view(t, groups, e // groups)
    group_scores = per_group.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen = decisions.topk(group_scores, group_topk, 1, "routing groups").indices
    keep = torch.zeros(t, groups, dtype=torch.bool, device=scores.device).scatter(1, chosen, True)
    masked = scores.masked_fill(~keep.repeat_interleave(e // groups, dim=1), float("-inf"))
    return decisions.topk(masked, topk, 1, "routing")


def topk_routing(logits, topk, score_function="softmax", pre_softmax=False, scaling_factor=None, expert_bias=None,
                 groups=None, group_topk=None):
    """(probs [T, E], zero outside each token's k experts; routing map [T, E] bool). expert_bias
    (sigmoid): the k experts are chosen by score + bias, their probabilities are the scores. groups,
    group_topk: group-limited routing (choose_experts), on whatever the k experts are chosen by."""
    def choose(values):
        return choose_experts(values, topk, groups, group_topk)
    if expert_bias is not None:
        scores = torch.sigmoid(logits)
        idx = choose(scores + expert_bias.to(scores.dtype)).indices
        top = scores.gather(1, idx)
        probs = top / (top.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else top
    elif score_function == "softmax":
        if pre_softmax:
            probs, idx = choose(torch.softmax(logits, dim=-1))
        else:
            top, idx = choose(logits)
            probs = torch.softmax(top, dim=-1)
    else:
        top, idx = choose(torch.sigmoid(logits))
        probs = top / (top.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else top
    if scaling_factor:
        probs = probs * scaling_factor
    dense = torch.zeros_like(logits).scatter(1, idx, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return dense, routing_map


def sinkhorn(cost, tol=1e-4, tp=1, grid=None):
    """Megatron's Sinkhorn balancing of exp(cost) [T, E] (no gradient): d0 (per token) and d1 (per
    expert) alternate until d1 moves by less than tol on average; returns d1 · exp(cost) · d0. tp > 1:
    this rank holds 1/tp of the micro-batch's tokens (sequence and context parallelism): the column sums
    and the token count are the micro-batch's (summed over TP x CP), so every layout balances the same
    tokens."""
    cost = torch.exp(cost)
    tokens = cost.shape[0] * tp
    d0 = torch.ones(cost.shape[0], device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.shape[1], device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:  # (a host read per round, as Megatron's)
        d0 = (1 / tokens) / (torch.sum(d1 * cost, 1) + eps)
        cols = torch.sum(d0.unsqueeze(1) * cost, 0)
        if tp > 1:
            cols = all_reduce_sum_tp_cp(cols, grid=grid)
        d1 = (1 / d1.shape[0]) / (cols + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_routing(logits, topk, training, tp=1, grid=None):
    """(probs [T, E], routing map [T, E]) of Megatron's sinkhorn load balancing."""
    scores = torch.sigmoid(logits) if topk == 1 else torch.softmax(logits, dim=-1)
    with torch.no_grad():
        idx = decisions.topk(sinkhorn(logits.float(), tp=tp, grid=grid) if training else scores, topk, 1,
                             "sinkhorn routing").indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return scores * routing_map, routing_map


def drop_over_capacity(probs, routing_map, topk, capacity_factor, policy="probs", pad_to_capacity=False):
    """Megatron's token dropping: each expert takes at most ceil(T·k/E · factor) tokens, those
    with its largest probabilities ("probs") or the first ones in token order ("position");
    pad_to_capacity: every expert takes exactly that many (the added ones with probability 0)."""
    num_tokens, num_experts = probs.shape
    capacity = math.ceil(num_tokens * topk / num_experts * capacity_factor)
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    elif policy == "probs":
        # among the expert's own tokens (the others are dropped whatever their order)
        idx = decisions.topk(probs, capacity, 0, "capacity", routing_map).indices
        keep = torch.zeros_like(routing_map).scatter(0, idx, True)
    else:  # the first `capacity` tokens of each expert, then (padding) the first of the others
        rank = torch.cumsum(routing_map.long(), dim=0)
        keep = routing_map & (rank <= capacity)
        if pad_to_capacity:
            others = torch.cumsum((~routing_map).long(), dim=0)
            keep = keep | (~routing_map & (others <= capacity - keep.sum(0, keepdim=True)))
    final = keep if pad_to_capacity else routing_map & keep
    return probs * final, final


def _scores_for_aux(logits, score_function):
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    s = torch.sigmoid(logits)
    return s / (s.sum(dim=-1, keepdim=True) + 1e-20)


class TopKRouter(nn.Module):
    def __init__(self, config, prefix, layer_number, grid=None):
        super().__init__()
        c = self.config = config
        self.grid = ps.current_grid(grid)
        self.layer_number, self.name = layer_number, prefix
        self.aux_tracker = AuxLossTracker()  # its own until the model's chunks share one (moe/aux_losses.py)
        # replicated over TP (its input is whole on every rank); Megatron keeps it in the model's dtype
        w, recipe = replicated_init((c.num_moe_experts, c.hidden_size), init_normal(mup.hidden_std(c)),
                                    param_seed(c.seed, prefix + ".weight"), ps.get_device())
        self.weight = with_recipe(nn.Parameter(w.to(device=ps.get_device(), dtype=c.params_dtype)), recipe)
        self.weight.use_muon = False  # --optimizer muon: the router goes to the scalar optimizer
        # under sequence parallelism each TP rank routes its own tokens: partial gradients, summed over TP
        self.weight.sequence_parallel = c.sequence_parallel and self.grid.tp > 1
        # the ranks that share a micro-batch's tokens (TP under SP, and CP): the losses' token sums span them
        self.tp = (self.grid.tp if c.sequence_parallel else 1) * self.grid.cp
        self.dtype = torch.float64 if c.moe_router_dtype == "fp64" else torch.float32
        self.expert_bias, self.local_tokens_per_expert = None, None
        if c.moe_router_enable_expert_bias:  # aux-loss-free balancing: learnt by counting, not by gradient
            bias = torch.zeros(c.num_moe_experts, dtype=torch.float32, device=ps.get_device())
            self.expert_bias = with_recipe(nn.Parameter(bias, requires_grad=False), ConstantRecipe(0.0))

    def update_expert_bias(self, tokens_per_expert):
        """After a step's backward, with this step's token counts summed over the batch (every micro-batch
        of every data-parallel rank): bias += rate · sign(mean count - count) (Megatron's formula)."""
        self.last_tokens_per_expert = tokens_per_expert
        with torch.no_grad():
            counts = tokens_per_expert.double()
            self.expert_bias.add_(torch.sign(counts.mean() - counts).float() * self.config.moe_router_bias_update_rate)
        if self.local_tokens_per_expert is not None:
            self.local_tokens_per_expert.zero_()

    def _count(self, routing_map):
        """Tokens per expert, in forwards that will have a backward: a recompute's first (no-grad)
        forward and evaluation do not count, so each training token counts once."""
        if self.expert_bias is None or not torch.is_grad_enabled():
            return
        if self.local_tokens_per_expert is None:
            self.local_tokens_per_expert = torch.zeros(routing_map.shape[1], dtype=torch.int64,
                                                       device=routing_map.device)
        self.local_tokens_per_expert += routing_map.sum(dim=0)

    def forward(self, x, seq_length=None):
        """x [T, h] (T = s·b tokens, sequence-major) -> (probs [T, E], routing map [T, E])."""
        c = self.config
        logits = torch.nn.functional.linear(x.to(self.dtype), self.weight.to(self.dtype))
        tp = self.tp  # the losses are of the whole micro-batch: this rank's tokens are 1/tp of it (TP x CP)
        if c.moe_z_loss_coeff and torch.is_grad_enabled():  # not in evaluation, nor twice under recompute
            zl = z_loss(logits, c.moe_z_loss_coeff, x.shape[0] * tp)
            self.aux_tracker.record("z_loss", self.layer_number, zl / c.moe_z_loss_coeff)
            logits = AuxLossScaler.apply(logits, zl, self.aux_tracker)
        kind = c.moe_router_load_balancing_type
        with decisions.about(self.name, x):  # each token's choice, told by its input (tests replay ties)
            if kind == "sinkhorn":
                probs, routing_map = sinkhorn_routing(logits, c.moe_router_topk, self.training, tp, self.grid)
            else:
                probs, routing_map = topk_routing(logits, c.moe_router_topk, c.moe_router_score_function,
                                                  c.moe_router_pre_softmax, c.moe_router_topk_scaling_factor,
                                                  self.expert_bias, c.moe_router_num_groups,
                                                  c.moe_router_group_topk)
        if kind in ("aux_loss", "seq_aux_loss") and c.moe_aux_loss_coeff > 0 and torch.is_grad_enabled():
            scores = _scores_for_aux(logits, c.moe_router_score_function)
            # token counts of the whole micro-batch (summed over TP under SP and over CP); the probabilities
            # stay this rank's, so the TP x CP ranks' losses (and gradients) sum to the micro-batch's
            if kind == "aux_loss":
                counts = routing_map.sum(dim=0).to(scores.dtype)
                if tp > 1:
                    counts = all_reduce_sum_tp_cp(counts, grid=self.grid)
                aux = switch_aux_loss(scores, counts, x.shape[0] * tp, c.moe_router_topk, c.moe_aux_loss_coeff)
            else:  # per sequence: tokens are [s, b] flattened, so sequence j is every b-th row from j
                b = x.shape[0] // seq_length
                seq_scores = scores.view(seq_length, b, -1).transpose(0, 1)
                counts = routing_map.view(seq_length, b, -1).sum(dim=0).to(scores.dtype)  # [b, E]
                if tp > 1:
                    counts = all_reduce_sum_tp_cp(counts, grid=self.grid)
                aux = sum(switch_aux_loss(seq_scores[j], counts[j], seq_length * tp, c.moe_router_topk,
                                          c.moe_aux_loss_coeff) for j in range(b)) / b
            self.aux_tracker.record("load_balancing_loss", self.layer_number, aux / c.moe_aux_loss_coeff)
            probs = AuxLossScaler.apply(probs, aux, self.aux_tracker)
        if c.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_over_capacity(probs, routing_map, c.moe_router_topk,
                                                    c.moe_expert_capacity_factor, c.moe_token_drop_policy,
                                                    c.moe_pad_expert_input_to_capacity)
        self._count(routing_map)
        return probs, routing_map
