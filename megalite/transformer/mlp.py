"""The feed-forward block: h -> ffn (GeLU tanh or exact, squared ReLU, or SwiGLU with [gate | up]) -> h,
sharded over TP."""

from torch import nn

from megalite import mup
from megalite.moe.activation import activation
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.layers import init_normal
from megalite.transformer.utils import output_init_std, param_seed


class MLP(nn.Module):
    def __init__(self, config, prefix, expert=False, grid=None):
        """expert: an MoE expert (sharded over expert-TP; the token dispatcher communicates)."""
        super().__init__()
        c = config
        self.config = c
        fc1_out = c.ffn_hidden_size * (2 if c.swiglu else 1)
        self.linear_fc1 = ColumnParallelLinear(
            c.hidden_size, fc1_out, bias=c.add_bias_linear, init_method=init_normal(mup.hidden_std(c)),
            skip_bias_add=True, sequence_parallel=c.sequence_parallel,
            init_seed=param_seed(c.seed, prefix + ".linear_fc1"), shard_chunks=2 if c.swiglu else 1,
            params_dtype=c.params_dtype, expert=expert, grid=grid)
        self.linear_fc2 = RowParallelLinear(
            c.ffn_hidden_size, c.hidden_size, bias=c.add_bias_linear, input_is_parallel=True,
            init_method=init_normal(output_init_std(c)), skip_bias_add=True,
            sequence_parallel=c.sequence_parallel, init_seed=param_seed(c.seed, prefix + ".linear_fc2"),
            params_dtype=c.params_dtype, expert=expert, grid=grid)

    def forward(self, x):
        h, b = self.linear_fc1(x)
        return self.linear_fc2(activation(self.config, h, b))
