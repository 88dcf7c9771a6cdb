"""The experts of an MoE layer: E feed-forward blocks (megalite's MLP at --moe-ffn-hidden-size),
named and initialised by their global expert index (`experts.local_experts.<e>`, Megatron's
SequentialMLP names), so a checkpoint means the same expert whatever the layout. They run one
after the other on the tokens routed to them (Megatron's sequential path; on CPU also what
--moe-grouped-gemm runs)."""

import dataclasses

from torch import nn


class SequentialExperts(nn.Module):
    def __init__(self, config, prefix, mlp_class, first=0, count=None):
        """mlp_class: the transformer's feed-forward block (given by the layer, which owns it)."""
        super().__init__()
        c = dataclasses.replace(config, ffn_hidden_size=config.moe_ffn_hidden_size)
        count = config.num_moe_experts if count is None else count
        self.first = first
        self.local_experts = nn.ModuleList(mlp_class(c, f"{prefix}.local_experts.{first + i}") for i in range(count))

    def forward(self, tokens, probs, routing_map):
        """tokens [T, h], probs / routing_map [T, E] -> Σ_e p_te · expert_e(token t), [T, h]."""
        out = tokens.new_zeros(tokens.shape)
        for i, expert in enumerate(self.local_experts):
            # an expert with no tokens still runs (on zero rows): its weights get a (zero) gradient, so
            # every rank's gradient hooks fire and the data-parallel buckets reduce in the same order
            rows = routing_map[:, self.first + i].nonzero().squeeze(1)
            y, bias = expert(tokens[rows])
            if bias is not None:
                y = y + bias
            out = out.index_add(0, rows, y * probs[rows, self.first + i].unsqueeze(1).to(y.dtype))
        return out
