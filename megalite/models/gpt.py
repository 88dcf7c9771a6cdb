"""A GPT (decoder-only) model built from megalite's transformer and tensor-parallel layers.

forward(input_ids [b, s], labels [b, s] or None) returns the per-token loss [b, s] (fp32)
when labels are given, else this rank's vocabulary shard of the logits [b, s, V/TP].
With pipeline parallelism a stage is built with pre_process (embedding) and/or
post_process (final norm, output layer, loss); intermediate stages take their input
through set_input_tensor().
"""

import contextlib

import torch
from torch import nn

from megalite import mup, parallel_state as ps
from megalite.models.stage import set_up_stage
from megalite.moe.aux_losses import share_tracker
from megalite.distributed.cp_comm import cp_size, global_token_index
from megalite.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    get_rng_tracker,
    vocab_parallel_cross_entropy,
)
from megalite.tensor_parallel.init import replicated_init
from megalite.tensor_parallel.layers import init_normal, with_recipe
from megalite.transformer import TransformerBlock
from megalite.transformer.mtp import MTPBlock
from megalite.transformer.rope import config_inv_freq, rotary_cos_sin
from megalite.transformer.utils import param_seed
from megalite.transformer.yarn import mla_rotary_cos_sin


class GPTEmbedding(nn.Module):
    def __init__(self, config, padded_vocab, grid=None):
        super().__init__()
        c = config
        self.config, self.grid = c, ps.current_grid(grid)
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab, c.hidden_size, init_method=init_normal(c.embedding_std), real_vocab_size=c.vocab_size,
            init_seed=param_seed(c.seed, "embedding.word_embeddings"), reduce_scatter=c.sequence_parallel,
            params_dtype=c.params_dtype, grid=self.grid)
        self.word_embeddings.weight.is_embedding_or_output_parameter = True  # --decoupled-lr
        self.word_embeddings.weight.is_embedding_parameter = True  # muP's embedding class (base LR and eps)
        self.position_embeddings = None
        if c.position_embedding_type == "learned_absolute":
            shape = (c.max_position_embeddings, c.hidden_size)
            seed = param_seed(c.seed, "embedding.position_embeddings")
            self.position_embeddings = nn.Embedding(*shape, device=ps.get_device(), dtype=c.params_dtype)
            w, recipe = replicated_init(shape, init_normal(c.embedding_std), seed, ps.get_device())
            with torch.no_grad():
                with_recipe(self.position_embeddings.weight, recipe).copy_(w)
            self.position_embeddings.weight.is_embedding_parameter = True
            # Under SP each rank adds only its sequence slice: partial grads, summed over TP.
            self.position_embeddings.weight.sequence_parallel = c.sequence_parallel and self.grid.tp > 1

    def sequence_slice(self, ids):
        """ids [s, ...] -> this rank's sequence slice under SP (the rows its activations hold)."""
        if self.word_embeddings.reduce_scatter:
            return ids.chunk(self.grid.tp, dim=0)[self.grid.tp_rank]
        return ids

    def embed(self, input_ids, position_ids=None):
        """Word + position embeddings (times muP's embedding multiplier and --embedding-multiplier), [s(/TP under
        SP), b, h], before dropout."""
        x = self.word_embeddings(input_ids.t())  # [s(/TP under SP), b, h]
        if self.position_embeddings is not None:
            if position_ids is None:  # under CP: the global positions of this rank's tokens
                position_ids = global_token_index(input_ids.shape[1], input_ids.device, self.grid).unsqueeze(0)
            x = x + self.position_embeddings(self.sequence_slice(position_ids.t()))  # [s, b or 1]
        mult = mup.embedding_mult(self.config)
        x = x * mult if mult != 1.0 else x
        if self.config.embedding_multiplier != 1.0:  # (rounded to the activations' dtype first, as Gemma's normalizer)
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype, device=x.device)
        return x

    def dropout(self, x):
        sp = self.word_embeddings.reduce_scatter
        with get_rng_tracker().fork() if sp else contextlib.nullcontext():
            return nn.functional.dropout(x, p=self.config.hidden_dropout, training=self.training)

    def forward(self, input_ids, position_ids=None):
        return self.dropout(self.embed(input_ids, position_ids))


class GPTModel(nn.Module):
    """grid: the layout this rank's model is built for (parallel_state.Grid; default the global one); vp_stage: which
    of this rank's virtual pipeline chunks it is (interleaving; its layers follow from it)."""

    def __init__(self, config, pre_process=True, post_process=True, num_layers=None, layer_offset=None, grid=None,
                 vp_stage=None):
        super().__init__()
        c = config
        num_layers, layer_offset = set_up_stage(self, c, pre_process, post_process, num_layers, layer_offset, grid,
                                                vp_stage)
        grid = self.grid
        self.share_embeddings_and_output_weights = not c.untie_embeddings_and_output_weights
        self.input_on_every_stage = c.reset_attention_mask  # every stage's attention needs the document mask
        self.mtp_process = post_process and bool(c.mtp_num_layers)  # multi-token prediction: the last stage
        # The word embedding has a copy on the first and the last stage (their gradients summed) when the
        # output layer is tied to it or when MTP looks tokens up on the last stage.
        self.shares_embedding_across_stages = self.share_embeddings_and_output_weights or bool(c.mtp_num_layers)
        if pre_process or self.mtp_process:
            self.embedding = GPTEmbedding(c, self.padded_vocab_size, grid)
            if not pre_process:  # MTP's copy on the last stage, initialised as the first stage's
                self.embedding.word_embeddings.weight.shared_embedding = True
        self.decoder = TransformerBlock(c, num_layers=num_layers, layer_offset=layer_offset,
                                        post_process=post_process, grid=grid)
        self.mtp = MTPBlock(c, grid) if self.mtp_process else None
        self.aux_tracker = share_tracker([self])  # the routers', DSA's and MTP's recorded losses (the log line's)
        if post_process:
            std = c.embedding_std if self.share_embeddings_and_output_weights else c.init_method_std
            self.output_layer = ColumnParallelLinear(
                c.hidden_size, self.padded_vocab_size, bias=False,
                init_method=init_normal(std, real_rows=c.vocab_size),  # zero padding rows
                sequence_parallel=c.sequence_parallel,
                init_seed=param_seed(c.seed, "embedding.word_embeddings" if self.share_embeddings_and_output_weights
                                     else "output_layer"),
                params_dtype=c.params_dtype, grid=grid)
            self.output_layer.weight.real_vocab_size = c.vocab_size
            self.output_layer.weight.is_embedding_or_output_parameter = True  # --decoupled-lr
            self.output_layer.weight.is_embedding_parameter = True  # muP's embedding class (untied or tied copy)
            if self.share_embeddings_and_output_weights:
                if pre_process or self.mtp_process:
                    # One parameter used twice; the output layer's own copy is dropped.
                    del self.output_layer.weight
                    self.output_layer.weight = None
                else:
                    # Last stage's copy of the word embeddings (initialised identically);
                    # its gradient is all-reduced with the first stage's every step.
                    self.output_layer.weight.shared_embedding = True

    def _rotary_tables(self, seq, device):
        """cos/sin for this sequence length, computed once (not on every micro-batch)."""
        key = (seq, device)
        if getattr(self, "_rotary_key", None) != key:
            c = self.config
            rot = int(c.kv_channels * c.rotary_percent)  # Megatron's rotary dim
            self._rotary = mla_rotary_cos_sin(c, seq, device) if c.multi_latent_attention else \
                rotary_cos_sin(seq, rot, c.rotary_base, device, interleaved=c.rotary_interleaved,
                               inv_freq=config_inv_freq(c, rot, device))
            self._rotary_key = key
        return self._rotary

    def set_input_tensor(self, tensor):
        """Pipeline stages after the first receive their input here instead of input_ids."""
        self.input_tensor = tensor

    def shared_embedding_or_output_weight(self):
        if self.pre_process or self.mtp_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def forward(self, input_ids, position_ids=None, labels=None, inference_cache=None, attention_mask=None,
                loss_mask=None):
        """inference_cache (megalite.transformer.kv_cache.KVCache): input_ids are the tokens after those
        already cached (generation); positions continue from there. attention_mask [b, 1, s, s]
        bool, True = masked out (Megatron's --reset-attention-mask); default causal. loss_mask [b, s]: the
        tokens multi-token prediction's loss counts (default all); the main loss is masked by the caller."""
        c = self.config
        offset = inference_cache.offset if inference_cache is not None else 0
        if self.pre_process:
            if offset and position_ids is None:
                position_ids = torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device)[None]
            x = self.embedding(input_ids, position_ids)
        else:
            x = self.input_tensor
        rotary = None
        if c.position_embedding_type == "rope" or c.multi_latent_attention:  # MLA: its own rotary, whatever the type
            sp = c.sequence_parallel and self.grid.tp > 1
            seq = x.shape[0] * (self.grid.tp if sp else 1)
            if inference_cache is None and cp_size(self.grid) > 1:  # the rows of this rank's tokens
                idx = global_token_index(seq, x.device, self.grid)
                rotary = tuple(t[idx] for t in self._rotary_tables(seq * self.grid.cp, x.device))
            elif inference_cache is None:
                rotary = self._rotary_tables(seq, x.device)
            else:  # one table for the whole generation, sliced at this step's positions
                full = self._rotary_tables(max(c.max_position_embeddings, offset + seq), x.device)
                rotary = tuple(t[offset:offset + seq] for t in full)
        x = self.decoder(x, rotary, attention_mask, inference_cache)
        if inference_cache is not None:
            inference_cache.offset += x.shape[0]
        if not self.post_process:
            return x
        if self.mtp is not None and labels is not None and self.training:  # generation and evaluation skip MTP
            if position_ids is None and self.embedding.position_embeddings is not None:  # MTP moves the positions too
                position_ids = global_token_index(input_ids.shape[1], input_ids.device, self.grid).unsqueeze(0)
            x = self.mtp(x, input_ids, position_ids, labels, loss_mask, rotary, attention_mask, self.embedding,
                         lambda h, lab: self._per_token_loss(self._logits(h), lab))
        logits = self._logits(x)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self._per_token_loss(logits, labels)

    def _logits(self, x):
        """[s, b, V/TP] through the output layer (the word embedding where tied on this stage)."""
        weight = None
        if self.share_embeddings_and_output_weights and (self.pre_process or self.mtp_process):
            weight = self.embedding.word_embeddings.weight
        logits = self.output_layer(x, weight=weight)
        mult = mup.output_mult(self.config)
        return logits * mult if mult != 1.0 else logits

    def _per_token_loss(self, logits, labels):
        """[b, s] fp32 cross-entropy of logits [s, b, V/TP] against labels [b, s]."""
        c = self.config
        # In-place gradient saves a logits-sized buffer; on GPUs that memory matters.
        loss = vocab_parallel_cross_entropy(logits, labels.t(), vocab_size=c.vocab_size,
                                            inplace_backward=logits.is_cuda, fused=c.fused_kernels, grid=self.grid)
        return loss.transpose(0, 1).contiguous()
