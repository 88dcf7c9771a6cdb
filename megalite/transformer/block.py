"""This pipeline stage's run of transformer layers (+ the final norm on the last stage)."""

from torch import nn

from megalite.tensor_parallel import checkpoint
from megalite.transformer.layer import TransformerLayer
from megalite.transformer.norm import build_norm


class TransformerBlock(nn.Module):
    """Layers [layer_offset, layer_offset + num_layers) of the whole model, global numbering
    kept in parameter names (`layers.<i>` is local; `layer_number` is global)."""

    def __init__(self, config, num_layers=None, layer_offset=0, post_process=True, prefix="decoder"):
        super().__init__()
        self.config = config
        n = config.num_layers if num_layers is None else num_layers
        self.layer_offset = layer_offset
        self.layers = nn.ModuleList(
            TransformerLayer(config, layer_offset + i + 1, f"{prefix}.layers.{layer_offset + i}") for i in range(n))
        self.final_layernorm = build_norm(config, config.hidden_size) if post_process else None

    def _run(self, start, end):
        def run(x, rotary, attn_mask):
            for layer in self.layers[start:end]:
                x = layer(x, rotary, attn_mask)
            return x
        return run

    def forward(self, x, rotary=None, attn_mask=None):
        c, n = self.config, len(self.layers)
        if c.recompute_granularity == "full" and self.training:
            k = c.recompute_num_layers
            if c.recompute_method == "uniform":
                # Checkpoint chunks of k layers: only chunk inputs stay alive.
                for start in range(0, n, k):
                    x = checkpoint(self._run(start, min(start + k, n)), x, rotary, attn_mask)
            else:
                # "block": recompute the first k layers of this stage, keep the rest.
                for i in range(n):
                    x = checkpoint(self._run(i, i + 1), x, rotary, attn_mask) if i < k else \
                        self.layers[i](x, rotary, attn_mask)
        else:
            for layer in self.layers:
                x = layer(x, rotary, attn_mask)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x
