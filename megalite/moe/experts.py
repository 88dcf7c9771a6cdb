"""The experts of an MoE layer held by this rank: L feed-forward blocks (megalite's MLP at
--moe-ffn-hidden-size), named and initialised by their global expert index
(`experts.local_experts.<e>`, Megatron's SequentialMLP names), so a checkpoint means the same
expert whatever the expert-parallel layout. Their parameters are marked `expert_parallel`: their
gradients reduce, and ZeRO shards them, over the expert-data-parallel group, not the dense one
(megalite/distributed/param_facts.py). They run one after the other on their rows (Megatron's
sequential path; on CPU also what --moe-grouped-gemm runs)."""

import dataclasses

import torch
from torch import nn


def expert_key(first, i):
    """The name of this rank's i-th expert: its global index."""
    return str(first + i)


class SequentialExperts(nn.Module):
    def __init__(self, config, prefix, mlp_class, first=0, count=None):
        """mlp_class: the transformer's feed-forward block (given by the layer, which owns it);
        first, count: the global indices of this rank's experts."""
        super().__init__()
        c = dataclasses.replace(config, ffn_hidden_size=config.moe_ffn_hidden_size)
        count = config.num_moe_experts if count is None else count
        self.first = first
        # keyed by global index: the parameters' names (checkpoint names) are the same at every EP size
        self.local_experts = nn.ModuleDict({expert_key(first, i): mlp_class(c, f"{prefix}.local_experts.{first + i}", expert=True)
                                            for i in range(count)})
        for p in self.parameters():
            p.expert_parallel = True

    def forward(self, rows, counts):
        """rows [N, h] sorted by local expert, counts[l] of them for expert l -> outputs [N, h]."""
        outs = []
        # an expert with no rows still runs (on zero rows): its weights get a (zero) gradient, so
        # every rank's gradient hooks fire and the data-parallel buckets reduce in the same order
        for expert, x in zip(self.local_experts.values(), torch.split(rows, counts)):
            y, bias = expert(x)
            outs.append(y if bias is None else y + bias)
        return torch.cat(outs)
