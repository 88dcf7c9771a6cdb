"""A transformer layer: pre-norm x + attn(norm(x)), then + mlp(norm(x)) (GPT, default), or
post-norm norm(x + attn(x)), then norm(x + mlp(x)) (original BERT: layernorm_position "post")."""

import contextlib

import torch.nn.functional as F
from torch import nn

from megalite import parallel_state as ps
from megalite.moe.layer import MoELayer
from megalite.tensor_parallel import get_rng_tracker
from megalite.transformer.attention import SelfAttention
from megalite.transformer.mla import MLASelfAttention
from megalite.transformer.mlp import MLP
from megalite.transformer.norm import build_norm


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number, prefix, grid=None):
        super().__init__()
        self.config, self.grid = config, ps.current_grid(grid)
        grid = self.grid
        self.layer_number = layer_number  # global, 1-based (as Megatron), whatever the stage
        self.post_norm = config.layernorm_position == "post"
        if not self.post_norm:
            self.input_layernorm = build_norm(config, config.hidden_size, grid=grid)
        attention = MLASelfAttention if config.multi_latent_attention else SelfAttention
        self.self_attention = attention(config, prefix + ".self_attention", layer_number, grid=grid)
        if self.post_norm:
            self.post_attention_layernorm = build_norm(config, config.hidden_size, grid=grid)
        else:
            self.pre_mlp_layernorm = build_norm(config, config.hidden_size, grid=grid)
        self.mlp = MoELayer(config, prefix + ".mlp", layer_number, MLP, grid=grid) \
            if config.is_moe_layer(layer_number) else MLP(config, prefix + ".mlp", grid=grid)
        if self.post_norm:
            self.post_mlp_layernorm = build_norm(config, config.hidden_size, grid=grid)

    def _bias_dropout_add(self, out_bias, residual):
        out, bias = out_bias
        if bias is not None:
            out = out + bias
        # Replicated activations drop identically on all TP ranks (default stream);
        # sequence-parallel slices are distinct data, so they take the per-rank stream.
        sp = self.config.sequence_parallel and self.grid.tp > 1
        rng = get_rng_tracker().fork() if sp else contextlib.nullcontext()
        with rng:
            out = F.dropout(out, p=self.config.hidden_dropout, training=self.training)
        return residual + out

    def forward(self, x, rotary=None, attn_mask=None, inference_cache=None):
        if self.post_norm:
            x = self.post_attention_layernorm(
                self._bias_dropout_add(self.self_attention(x, rotary, attn_mask, inference_cache), x))
            return self.post_mlp_layernorm(self._bias_dropout_add(self.mlp(x), x))
        x = self._bias_dropout_add(self.self_attention(self.input_layernorm(x), rotary, attn_mask, inference_cache),
                                   x)
        return self._bias_dropout_add(self.mlp(self.pre_mlp_layernorm(x)), x)
