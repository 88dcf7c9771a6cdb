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

    def forward(self, x, rotary=None, attn_mask=None):
        for layer in self.layers:
            if self.config.recompute_granularity == "full" and self.training:
                x = checkpoint(layer, x, rotary, attn_mask)
            else:
                x = layer(x, rotary, attn_mask)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x
