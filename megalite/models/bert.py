"""A BERT (bidirectional encoder) built from megalite's transformer and tensor-parallel layers.

forward(input_ids [b, s], padding_mask [b, s] (1 = token, 0 = padding), tokentype_ids [b, s],
lm_labels [b, s] or None, loss_mask [b, s] or None):
  with lm_labels: (per-token MLM loss [n] fp32 over the n masked positions (loss_mask, or
  lm_labels >= 0), in (batch, sequence) order; binary-head logits [b, 2] or None);
  without: (this rank's vocabulary shard of the MLM logits [b, s, V/TP]; binary logits or None).

Embeddings: word (vocab-parallel) + learned positions + token types, then LayerNorm in the
post-norm layout (original BERT; `layernorm_position="pre"` gives Megatron's pre-norm encoder
with a final norm instead). The MLM head (dense -> GeLU -> LayerNorm -> output projection tied
to the word embedding, with its own vocab-parallel bias) runs on the masked positions only,
through vocab_parallel_cross_entropy. Pooler (first token -> dense -> tanh) + binary head
for sentence order (SOP) or next sentence (NSP).

Under TP the head sees the full hidden state on every TP rank (all-gathered from the sequence
shards under SP; its backward then keeps this rank's slice, because everything after the
gather is replicated and its gradient is whole on every rank: the output projection's input
goes through copy_to_tensor_model_parallel_region). Pipeline stages: embeddings on the first,
heads on the last; the last stage's copy of the word embedding is synchronised as for GPT.
"""

import torch
from torch import nn

from megalite import parallel_state as ps
from megalite.config import ConfigError
from megalite.models.gpt import GPTEmbedding
from megalite.models.stage import set_up_stage
from megalite.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from megalite.tensor_parallel.init import replicated_init
from megalite.tensor_parallel.layers import ConstantRecipe, init_normal, with_recipe
from megalite.transformer import TransformerBlock
from megalite.transformer.norm import LayerNorm, build_norm
from megalite.transformer.utils import param_seed


def check_bert_config(c):
    """What makes a model a BERT, refused in one line naming the flag: by the command line's checks (on the parsed
    flags, megalite/cli/validate.py) and by BertModel for a model built from a config directly (the same names)."""
    if c.untie_embeddings_and_output_weights:
        raise ConfigError("BERT ties its MLM output layer to the word embeddings; remove "
                          "--untie-embeddings-and-output-weights")
    if c.position_embedding_type != "learned_absolute":
        raise ConfigError(f"BERT uses learned absolute positions; remove --position-embedding-type "
                          f"{c.position_embedding_type}")


def _replicated_linear(c, n_in, n_out, name):
    """A plain nn.Linear (the same full weight on every rank), topology-independent init."""
    lin = nn.Linear(n_in, n_out, device=ps.get_device(), dtype=c.params_dtype)
    w, recipe = replicated_init((n_out, n_in), init_normal(c.init_method_std), param_seed(c.seed, name),
                                ps.get_device())
    with torch.no_grad():
        with_recipe(lin.weight, recipe).copy_(w)
        with_recipe(lin.bias, ConstantRecipe(0)).zero_()
    return lin


class BertEmbedding(GPTEmbedding):
    """Word + position + token-type embeddings (+ LayerNorm when post-norm), then dropout."""

    def __init__(self, config, padded_vocab, grid=None):
        super().__init__(config, padded_vocab, grid)
        c = config
        sp = c.sequence_parallel and self.grid.tp > 1
        self.tokentype_embeddings = None
        if c.num_tokentypes > 0:
            shape, seed = (c.num_tokentypes, c.hidden_size), param_seed(c.seed, "embedding.tokentype_embeddings")
            self.tokentype_embeddings = nn.Embedding(*shape, device=ps.get_device(), dtype=c.params_dtype)
            w, recipe = replicated_init(shape, init_normal(c.embedding_std), seed, ps.get_device())
            with torch.no_grad():
                with_recipe(self.tokentype_embeddings.weight, recipe).copy_(w)
            self.tokentype_embeddings.weight.sequence_parallel = sp  # partial grads under SP, summed over TP
        self.layernorm = build_norm(c, c.hidden_size, grid=self.grid) if c.layernorm_position == "post" else None

    def forward(self, input_ids, position_ids=None, tokentype_ids=None):
        x = self.embed(input_ids, position_ids)
        if self.tokentype_embeddings is not None:
            if tokentype_ids is None:
                tokentype_ids = torch.zeros_like(input_ids)
            x = x + self.tokentype_embeddings(self.sequence_slice(tokentype_ids.t()))
        if self.layernorm is not None:
            x = self.layernorm(x)
        return self.dropout(x)


class BertLMHead(nn.Module):
    """dense -> GeLU -> LayerNorm (replicated; applied to the gathered masked positions)."""

    def __init__(self, config):
        super().__init__()
        c = config
        self.config = c
        self.dense = _replicated_linear(c, c.hidden_size, c.hidden_size, "lm_head.dense")
        # Not sequence-parallel: its input is whole on every TP rank, and so are its grads.
        self.layernorm = LayerNorm(c.hidden_size, eps=c.layernorm_epsilon, fused=c.fused_kernels,
                                   dtype=c.params_dtype, device=ps.get_device())

    def forward(self, x):
        x = nn.functional.gelu(self.dense(x), approximate="none" if self.config.gelu == "exact" else "tanh")
        return self.layernorm(x)


class BertModel(nn.Module):
    input_on_every_stage = True  # every pipeline stage needs the padding mask: all read the data

    def __init__(self, config, pre_process=True, post_process=True, num_layers=None, layer_offset=None, grid=None,
                 vp_stage=None):
        super().__init__()
        c = config
        num_layers, layer_offset = set_up_stage(self, c, pre_process, post_process, num_layers, layer_offset, grid,
                                                vp_stage, check=check_bert_config)
        grid = self.grid
        self.share_embeddings_and_output_weights = self.shares_embedding_across_stages = True
        if pre_process:
            self.embedding = BertEmbedding(c, self.padded_vocab_size, grid)
        self.encoder = TransformerBlock(c, num_layers=num_layers, layer_offset=layer_offset,
                                        post_process=post_process, prefix="encoder", grid=grid)
        if post_process:
            self.lm_head = BertLMHead(c)
            # The tied projection (x @ E^T) with the head's own bias; input replicated (no SP gather here).
            self.output_layer = ColumnParallelLinear(
                c.hidden_size, self.padded_vocab_size, bias=True,
                init_method=init_normal(c.embedding_std, real_rows=c.vocab_size), sequence_parallel=False,
                init_seed=param_seed(c.seed, "embedding.word_embeddings"), params_dtype=c.params_dtype, grid=grid)
            self.output_layer.weight.real_vocab_size = c.vocab_size
            self.output_layer.weight.is_embedding_or_output_parameter = True  # --decoupled-lr
            self.output_layer.bias.real_vocab_size = c.vocab_size
            if pre_process:
                del self.output_layer.weight  # one parameter used twice
                self.output_layer.weight = None
            else:
                self.output_layer.weight.shared_embedding = True  # grads summed with the first stage's
            if c.bert_binary_head:
                self.pooler = _replicated_linear(c, c.hidden_size, c.hidden_size, "pooler.dense")
                self.binary_head = _replicated_linear(c, c.hidden_size, 2, "binary_head")

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def shared_embedding_or_output_weight(self):
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def forward(self, input_ids, padding_mask=None, tokentype_ids=None, lm_labels=None, loss_mask=None,
                position_ids=None):
        c = self.config
        attn_mask = None
        if padding_mask is not None:  # [b, 1, 1, s], True = a padding key nobody attends to
            attn_mask = (padding_mask == 0)[:, None, None, :]
        x = self.embedding(input_ids, position_ids, tokentype_ids) if self.pre_process else self.input_tensor
        x = self.encoder(x, None, attn_mask)
        if not self.post_process:
            return x
        if c.sequence_parallel and self.grid.tp > 1:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, grid=self.grid)
        x = x.transpose(0, 1)  # [b, s, h], whole on every TP rank
        binary_logits = None
        if c.bert_binary_head:
            binary_logits = self.binary_head(torch.tanh(self.pooler(x[:, 0])))
        weight = self.embedding.word_embeddings.weight if self.pre_process else None
        if lm_labels is None:
            return self.output_layer(self.lm_head(x), weight=weight), binary_logits
        chosen = (loss_mask != 0) if loss_mask is not None else (lm_labels >= 0)
        logits = self.output_layer(self.lm_head(x[chosen]), weight=weight)  # [n, V/TP]
        loss = vocab_parallel_cross_entropy(logits, lm_labels[chosen], vocab_size=c.vocab_size,
                                            inplace_backward=logits.is_cuda, fused=c.fused_kernels, grid=self.grid)
        return loss, binary_logits
