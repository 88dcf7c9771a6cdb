"""An MoE layer in place of a transformer layer's MLP: route each token to its top-k experts,
run them, combine their outputs weighted by the router's probabilities. Every rank holds every
expert for now (expert-parallel size 1: the token dispatch is local)."""

from torch import nn

from megalite.moe.experts import SequentialExperts
from megalite.moe.router import TopKRouter


class MoELayer(nn.Module):
    def __init__(self, config, prefix, layer_number, mlp_class):
        super().__init__()
        self.config = config
        self.router = TopKRouter(config, prefix + ".router", layer_number)
        self.experts = SequentialExperts(config, prefix + ".experts", mlp_class)

    def forward(self, x):
        """x [s, b, h] -> (output [s, b, h], None): the MLP's (output, bias) contract."""
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        probs, routing_map = self.router(tokens, seq_length=s)
        return self.experts(tokens, probs, routing_map).view(s, b, h), None
