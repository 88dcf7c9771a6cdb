"""This pipeline stage's run of transformer layers (+ the final norm on the last stage)."""

from torch import nn

from megalite.tensor_parallel import checkpoint
from megalite.tensor_parallel.fp8 import Fp8Site
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.transformer.layer import TransformerLayer
from megalite.transformer.norm import build_norm


def fp8_layer(config, i):
    """Whether layer i (0-based, of the whole model) runs its GEMMs in FP8 (--first-last-layers-bf16: not the
    first / last few)."""
    c = config
    return not (c.first_last_layers_bf16 and (i < c.num_layers_at_start_in_bf16
                                              or i >= c.num_layers - c.num_layers_at_end_in_bf16))


def attach_fp8(layer, config):
    """Every tensor-parallel linear layer of a transformer layer (attention's, the MLP's, MoE experts') gets its FP8
    site."""
    c = config
    for m in layer.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m.fp8 = Fp8Site(c.fp8, c.fp8_recipe, c.fp8_margin,
                            c.fp8_amax_history_len, c.fp8_amax_compute_algo, c.fp8_wgrad,
                            row_parallel=isinstance(m, RowParallelLinear), grid=m.grid, expert=m.expert,
                            fused=c.fused_kernels)


class TransformerBlock(nn.Module):
    """Layers [layer_offset, layer_offset + num_layers) of the whole model. Parameter names
    keep the global layer index (`decoder.layers.<global i>.…`), so a state dict means the
    same thing whatever the pipeline split."""

    wgrad_store = None  # a split backward's (megalite/pipeline/wgrad.py attaches it): full recomputation's

    def __init__(self, config, num_layers=None, layer_offset=0, post_process=True, prefix="decoder", grid=None):
        super().__init__()
        self.config = config
        n = config.num_layers if num_layers is None else num_layers
        self.layer_offset = layer_offset
        self.layers = nn.ModuleDict(
            (str(layer_offset + i),
             TransformerLayer(config, layer_offset + i + 1, f"{prefix}.layers.{layer_offset + i}", grid))
            for i in range(n))
        self._stack = list(self.layers.values())  # in order, for slicing
        if config.fp8:
            for i, layer in self.layers.items():
                if fp8_layer(config, int(i)):
                    attach_fp8(layer, config)
        # Post-norm layers end normalised: no final norm then.
        self.final_layernorm = build_norm(config, config.hidden_size, grid=grid) \
            if post_process and config.layernorm_position == "pre" else None

    def _run(self, start, end):
        def run(x, rotary, attn_mask):
            for layer in self._stack[start:end]:
                x = layer(x, rotary, attn_mask)
            return x
        return run

    def forward(self, x, rotary=None, attn_mask=None, inference_cache=None):
        c, n = self.config, len(self._stack)
        if n == 0 and self.final_layernorm is None:
            # An empty stage of a pipeline layout: its output must be a new tensor, as the
            # schedule frees what it sent while the received input still awaits its gradient.
            return x.clone()
        if c.recompute_granularity == "full" and self.training:
            k = c.recompute_num_layers
            if c.recompute_method == "uniform":
                # Checkpoint chunks of k layers: only chunk inputs stay alive.
                for start in range(0, n, k):
                    x = checkpoint(self._run(start, min(start + k, n)), x, rotary, attn_mask,
                                   wgrad_store=self.wgrad_store)
            else:
                # "block": recompute the first k layers of this stage, keep the rest.
                for i in range(n):
                    x = checkpoint(self._run(i, i + 1), x, rotary, attn_mask, wgrad_store=self.wgrad_store) \
                        if i < k else self._stack[i](x, rotary, attn_mask)
        else:
            for layer in self._stack:
                x = layer(x, rotary, attn_mask, inference_cache)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x
