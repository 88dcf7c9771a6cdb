"""An MoE layer in place of a transformer layer's MLP: route each token to its top-k experts,
run them, combine their outputs weighted by the router's probabilities, and add the shared
expert's output (--moe-shared-expert-intermediate-size; with --moe-shared-expert-gate scaled by
sigmoid(x · g), as Qwen2-MoE). The experts are split over the expert-parallel group and the
tokens reach them through a dispatcher (dispatcher.py, --moe-token-dispatcher-type)."""

import dataclasses

import torch
from torch import nn

from megalite import mup, parallel_state as ps
from megalite.moe.dispatcher import TokenDispatcher
from megalite.moe.experts import SequentialExperts
from megalite.moe.router import TopKRouter
from megalite.tensor_parallel.init import init_normal, param_seed, replicated_init, with_recipe


class MoELayer(nn.Module):
    def __init__(self, config, prefix, layer_number, mlp_class, grid=None):
        super().__init__()
        self.config = config
        grid = ps.current_grid(grid)
        self.router = TopKRouter(config, prefix + ".router", layer_number, grid)
        self.dispatcher = TokenDispatcher(config.num_moe_experts, config.moe_token_dispatcher_type, grid)
        self.experts = SequentialExperts(config, prefix + ".experts", mlp_class, self.dispatcher.first,
                                         self.dispatcher.count, grid)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            shared = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
            self.shared_experts = mlp_class(shared, prefix + ".shared_experts", grid=grid)
            if config.moe_shared_expert_gate:
                w, recipe = replicated_init((1, config.hidden_size), init_normal(mup.hidden_std(config)),
                                            param_seed(config.seed, prefix + ".shared_experts.gate_weight"),
                                            ps.get_device())
                self.shared_experts.gate_weight = with_recipe(
                    nn.Parameter(w.to(device=ps.get_device(), dtype=config.params_dtype)), recipe)
                # applied to this rank's tokens under sequence parallelism: partial gradients, summed over TP
                self.shared_experts.gate_weight.sequence_parallel = self.router.weight.sequence_parallel

    def forward(self, x):
        """x [s, b, h] -> (output [s, b, h], None): the MLP's (output, bias) contract."""
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        probs, routing_map = self.router(tokens, seq_length=s)
        rows, counts = self.dispatcher.dispatch(tokens, probs, routing_map)
        sources = self.dispatcher.sources() if self.experts.in_fp8() else None  # (FP8: each micro-batch's rows apart)
        out = self.dispatcher.combine(self.experts(rows, counts, sources=sources))
        if self.shared_experts is not None:  # a dense MLP: sequence-parallel as the others
            y = self.shared_experts(x)[0].reshape(s * b, h)
            gate = getattr(self.shared_experts, "gate_weight", None)
            if gate is not None:
                y = y * torch.sigmoid(nn.functional.linear(tokens, gate))
            out = out + y
        return out.view(s, b, h), None
