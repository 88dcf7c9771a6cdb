"""Tensor-parallel linear and embedding layers.

Initialisation never depends on the TP size, and each rank builds only its own shard: a
weight with a seed and an `init_normal` method is defined tile by tile from per-tile seeds
(see tensor_parallel/init.py), so a model built with TP=4 holds exactly the slices of the
TP=1 model's weights, which is what parity tests compare, at 1/4 of the start-up work.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite import parallel_state as ps
from megalite.tensor_parallel.init import (  # noqa: F401 (re-exported)
    BlockRecipe,
    ConstantRecipe,
    init_block,
    init_master,
    init_normal,
    replicated_init,
    with_recipe,
)
from megalite.tensor_parallel.fp8 import fp8_linear
from megalite.tensor_parallel.deferred_wgrad import deferred_embedding, deferred_linear
from megalite.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    linear_with_sequence_parallel_gather,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)


def shard_row_ranges(rows, tp, rank, chunks=1):
    """This rank's row ranges of a [rows, ...] weight sharded by rows. With chunks > 1 the rows
    are `chunks` stacked blocks (e.g. [gate; up] for SwiGLU) and the rank takes its slice of each."""
    block = rows // chunks
    per = block // tp
    return [(c * block + rank * per, c * block + (rank + 1) * per) for c in range(chunks)]


def shard_rows(master, tp, rank, chunks=1):
    """This rank's rows of a full `master` (same layout as shard_row_ranges)."""
    return torch.cat([master[a:b] for a, b in shard_row_ranges(master.shape[0], tp, rank, chunks)], dim=0)


def _set_tp_attrs(param, is_parallel, dim):
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim


def _tp(grid, expert):
    """(size, rank) a layer's weight is sharded over: the expert-TP group for MoE experts."""
    return grid.expert_tp() if expert else (grid.tp, grid.tp_rank)


def _divide(n, d, what):
    if n % d:
        raise ValueError(f"{what} {n} is not divisible by tensor-model-parallel size {d}")
    return n // d


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by columns (output features) across TP ranks.

    gather_output: all-gather Y so every rank has the full output.
    skip_bias_add: return (Y, b) so the caller can fuse the bias into the next op.
    sequence_parallel: the input is sequence-sharded; it is all-gathered here (again in backward: only this
    rank's rows are kept, as Megatron keeps them).
    shard_chunks: the output features are `shard_chunks` stacked blocks sharded blockwise.
    expert: an MoE expert's layer: sharded over expert-TP, and no communication here (the token
    dispatcher gathers the input rows and reduces the partial outputs, megalite/moe/dispatcher.py).
    """

    fp8 = None  # an Fp8Site: its GEMMs in FP8 (set by the transformer block, --fp8-format)
    wgrad_store = None  # a zero-bubble schedule's store: the weight gradient deferred (deferred_wgrad.py)

    def __init__(self, input_size, output_size, bias=True, gather_output=False, init_method=None,
                 skip_bias_add=False, sequence_parallel=False, init_seed=None, shard_chunks=1,
                 params_dtype=torch.float32, device=None, expert=False, grid=None):
        super().__init__()
        self.grid = grid = ps.current_grid(grid)
        tp, rank = _tp(grid, expert)
        self.expert = expert
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = _divide(output_size, tp * shard_chunks, "output size / chunks") * shard_chunks
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel and tp > 1
        device = device or ps.get_device()
        init_method = init_method or init_normal(0.02)
        rows = shard_row_ranges(output_size, tp, rank, shard_chunks)
        w = init_block((output_size, input_size), init_method, init_seed, rows, (0, input_size), device)
        self.weight = with_recipe(nn.Parameter(w.to(dtype=params_dtype)),
                                  BlockRecipe((output_size, input_size), init_method, init_seed, rows, (0, input_size)))
        _set_tp_attrs(self.weight, True, 0)
        self.weight.shard_chunks = shard_chunks
        self.weight.expert_parallel = expert
        if bias and expert:
            raise ValueError("MoE experts have no linear biases (--disable-bias-linear)")
        if bias:
            self.bias = with_recipe(nn.Parameter(torch.zeros(self.output_size_per_partition, device=device,
                                                             dtype=params_dtype)), ConstantRecipe(0))
            _set_tp_attrs(self.bias, True, 0)
            self.bias.shard_chunks = shard_chunks
        else:
            self.register_parameter("bias", None)

    def forward(self, x, weight=None):
        weight = self.weight if weight is None else weight
        if self.expert:
            y = fp8_linear(x, weight, self.fp8, self.wgrad_store) if self.fp8 is not None else \
                deferred_linear(x, weight, None, self.wgrad_store)
            return (y, None) if self.skip_bias_add else y
        bias = None if self.skip_bias_add else self.bias
        if self.fp8 is not None:  # FP8 GEMMs (tensor_parallel/fp8.py; the bias in the model's precision)
            x = gather_from_sequence_parallel_region(x, grid=self.grid) if self.sequence_parallel else \
                copy_to_tensor_model_parallel_region(x, grid=self.grid)
            y = fp8_linear(x, weight, self.fp8, self.wgrad_store)
            y = y if bias is None else y + bias
        elif self.sequence_parallel:  # (keeps only this rank's rows of x for backward)
            y = linear_with_sequence_parallel_gather(x, weight, bias, grid=self.grid)
        else:  # (a zero-bubble schedule's store: the weight gradient when the schedule says W)
            y = deferred_linear(copy_to_tensor_model_parallel_region(x, grid=self.grid), weight, bias,
                                self.wgrad_store)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, grid=self.grid)
        if self.skip_bias_add:
            return y, self.bias
        return y


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split by rows (input features) across TP ranks.

    input_is_parallel: X already arrives split along its last dim (from a column layer).
    sequence_parallel: the partial outputs are reduce-scattered along the sequence.
    expert: see ColumnParallelLinear (the output stays a partial sum over expert-TP).
    """

    fp8 = None  # an Fp8Site (see ColumnParallelLinear)
    wgrad_store = None  # (see ColumnParallelLinear)

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=True, init_method=None,
                 skip_bias_add=False, sequence_parallel=False, init_seed=None,
                 params_dtype=torch.float32, device=None, expert=False, grid=None):
        super().__init__()
        self.grid = grid = ps.current_grid(grid)
        tp, rank = _tp(grid, expert)
        self.expert = expert
        if bias and expert:
            raise ValueError("MoE experts have no linear biases (--disable-bias-linear)")
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = _divide(input_size, tp, "input size")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel and tp > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel needs input_is_parallel=True")
        device = device or ps.get_device()
        init_method = init_method or init_normal(0.02)
        per = self.input_size_per_partition
        cols = (rank * per, (rank + 1) * per)
        w = init_block((output_size, input_size), init_method, init_seed, [(0, output_size)], cols, device)
        self.weight = with_recipe(nn.Parameter(w.to(dtype=params_dtype)),
                                  BlockRecipe((output_size, input_size), init_method, init_seed, [(0, output_size)],
                                              cols))
        _set_tp_attrs(self.weight, True, 1)
        self.weight.expert_parallel = expert
        if bias:
            self.bias = with_recipe(nn.Parameter(torch.zeros(output_size, device=device, dtype=params_dtype)),
                                    ConstantRecipe(0))
            _set_tp_attrs(self.bias, False, -1)
            # Under SP the bias is added to this rank's sequence slice only: its gradient
            # is partial and must be summed over TP (see distributed.finalize_grads).
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x, batch_first=False):
        """x [s, b, k]; batch_first: x [b, s, k] (attention's output as it lies), the output still [s, b, h]: the
        GEMM reads x in place, so autograd keeps x itself rather than a second, [s, b]-ordered copy of it."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, grid=self.grid)
        y = fp8_linear(x, self.weight, self.fp8, self.wgrad_store) if self.fp8 is not None else \
            deferred_linear(x, self.weight, None, self.wgrad_store)
        if batch_first:
            y = y.transpose(0, 1).contiguous()
        if self.sequence_parallel and not self.expert:
            y = reduce_scatter_to_sequence_parallel_region(y, grid=self.grid)
        elif not self.expert:
            # (a fresh GEMM output, reduced in place; an FP8 GEMM's is a custom Function's, whose views autograd
            # does not let change in place)
            y = reduce_from_tensor_model_parallel_region(y, inplace=self.fp8 is None, grid=self.grid)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias


class DuplicatedLinear(nn.Module):
    """y = x W^T with W whole on every TP rank (Megatron's TELinear parallel_mode="duplicated"), initialised
    by the replicated recipe (the same values at every TP size). partial_grads: it reads this rank's
    sequence slice (sequence parallelism), so its gradient is a partial sum, marked `sequence_parallel`
    to be summed over TP."""

    def __init__(self, input_size, output_size, init_method, init_seed, params_dtype, partial_grads):
        super().__init__()
        w, recipe = replicated_init((output_size, input_size), init_method, init_seed, ps.get_device())
        self.weight = with_recipe(nn.Parameter(w.to(device=ps.get_device(), dtype=params_dtype)), recipe)
        self.weight.tensor_model_parallel = False
        self.weight.sequence_parallel = partial_grads

    def forward(self, x):
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across TP ranks.

    `num_embeddings` is the padded vocabulary (a multiple of TP); rows at or above
    `real_vocab_size` are padding, initialised to zero and never looked up.
    With `reduce_scatter` the partial lookups are reduce-scattered along dim 0 (the
    sequence, for sequence parallelism) instead of all-reduced.
    """

    wgrad_store = None  # (see ColumnParallelLinear)

    def __init__(self, num_embeddings, embedding_dim, init_method=None, real_vocab_size=None,
                 init_seed=None, reduce_scatter=False, params_dtype=torch.float32, device=None, grid=None):
        super().__init__()
        self.grid = grid = ps.current_grid(grid)
        tp, rank = grid.tp, grid.tp_rank
        per = _divide(num_embeddings, tp, "padded vocabulary size")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start_index, self.vocab_end_index = rank * per, (rank + 1) * per
        self.reduce_scatter = reduce_scatter and tp > 1
        real = real_vocab_size or num_embeddings
        init_method = init_method or init_normal(0.02)
        device = device or ps.get_device()
        rows = [(self.vocab_start_index, self.vocab_end_index)]
        if getattr(init_method, "std", None) is not None:
            recipe = BlockRecipe((num_embeddings, embedding_dim), init_normal(init_method.std, real), init_seed, rows,
                                 (0, embedding_dim))
            w = init_block(recipe.shape, recipe.init_method, init_seed, rows, (0, embedding_dim), device)
        else:  # a custom init: the real rows from the seed, zero padding
            def local(start, end, dev):
                master = torch.zeros(num_embeddings, embedding_dim)
                master[:real] = init_master((real, embedding_dim), init_method, init_seed)
                return master[self.vocab_start_index:self.vocab_end_index].reshape(-1)[start:end].to(dev)
            recipe = local
            w = torch.empty(per, embedding_dim, device=device) if torch.device(device).type == "meta" else \
                local(0, per * embedding_dim, device).view(per, embedding_dim)
        self.weight = with_recipe(nn.Parameter(w.to(dtype=params_dtype)), recipe)
        _set_tp_attrs(self.weight, True, 0)
        self.weight.real_vocab_size = real  # rows past it are padding (checkpoints store only real rows)

    def forward(self, ids):
        if self.grid.tp > 1:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
            out = deferred_embedding(local, self.weight, self.wgrad_store).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = deferred_embedding(ids, self.weight, self.wgrad_store)
        if self.reduce_scatter:
            return reduce_scatter_to_sequence_parallel_region(out, grid=self.grid)
        return reduce_from_tensor_model_parallel_region(out, inplace=True, grid=self.grid)  # fresh lookup


def padded_vocab_size(vocab_size, divisible_by, tp):
    """Megatron's padding: round up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
