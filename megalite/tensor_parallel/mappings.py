"""Autograd communication primitives for the tensor-parallel region.

Activations inside the transformer are laid out [sequence, batch, hidden] (Megatron's
layout), so the sequence-parallel split is along dim 0 and contiguous; the tensor-parallel
split of features is along the last dim. Each primitive's backward is its forward's adjoint.
Each takes the grid whose TP group it spans (default: the global one, parallel_state.current_grid).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megalite import parallel_state as ps

_all_gather_tensor, _reduce_scatter_tensor = ps.all_gather_tensor, ps.reduce_scatter_tensor


def _tp(grid):
    return grid.tp, grid.tp_group


def _reduce(x, grid):
    """Sum over TP into a new tensor: the input may be shared (autograd hands the same
    gradient tensor to both branches of an add), so it is never modified in place."""
    n, group = _tp(grid)
    if n == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def _split_last(x, grid):
    n, _ = _tp(grid)
    if n == 1:
        return x
    if x.shape[-1] % n:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by tensor-parallel size {n}")
    return x.chunk(n, dim=-1)[grid.tp_rank].contiguous()


def _gather_last(x, grid):
    n, group = _tp(grid)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _split_first(x, grid):
    n, _ = _tp(grid)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tensor-parallel size {n} "
                         "(needed by --sequence-parallel)")
    return x.chunk(n, dim=0)[grid.tp_rank].contiguous()


def _gather_first(x, grid):
    n, group = _tp(grid)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_tensor(out, x, group=group)
    return out


def _reduce_scatter_first(x, grid):
    n, group = _tp(grid)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tensor-parallel size {n} "
                         "(needed by --sequence-parallel)")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_tensor(out, x, group=group)
    return out


def with_adjoint(op, adjoint, name):
    """An autograd.Function called `name` whose forward is op(x, over) and backward adjoint(grad, over); `over` (a
    grid, a process group) is its one other argument and gets no gradient. A pair of collectives is then declared
    in a line or two, here and in the modules of other groups' collectives. Built as a class statement would build
    it (its name, op's module), so its grad_fn reads the same."""
    def forward(ctx, x, over):
        ctx.over = over
        return op(x, over)

    def backward(ctx, grad):
        return adjoint(grad, ctx.over), None
    body = {"forward": staticmethod(forward), "backward": staticmethod(backward), "__module__": op.__module__}
    return type(torch.autograd.Function)(name, (torch.autograd.Function,), body)


def _identity(x, grid):
    return x


_Copy = with_adjoint(_identity, _reduce, "_Copy")
_ScatterLast = with_adjoint(_split_last, _gather_last, "_ScatterLast")
_GatherLast = with_adjoint(_gather_last, _split_last, "_GatherLast")
_ScatterFirst = with_adjoint(_split_first, _gather_first, "_ScatterFirst")
_ReduceScatterFirst = with_adjoint(_reduce_scatter_first, _gather_first, "_ReduceScatterFirst")


# These two take a flag besides the grid (in-place forward; the backward's sum or split): written out.
class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, inplace, grid):
        n, group = _tp(grid)
        if inplace and n > 1 and x.is_contiguous():  # a fresh GEMM output: no copy
            ctx.mark_dirty(x)
            dist.all_reduce(x, group=group)
            return x
        return _reduce(x, grid)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _GatherFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tensor_parallel_output_grad, grid):
        ctx.tp_out_grad, ctx.grid = tensor_parallel_output_grad, grid
        return _gather_first(x, grid)

    @staticmethod
    def backward(ctx, g):
        # If the consumer of the gathered tensor is itself tensor-parallel (e.g. a column
        # layer), each rank holds only a partial gradient: sum them while scattering.
        if ctx.tp_out_grad:
            return _reduce_scatter_first(g, ctx.grid), None, None
        return _split_first(g, ctx.grid), None, None


class _GatherLinear(torch.autograd.Function):
    """Y = all_gather(X) A^T + b keeping only this rank's rows of X for backward, as Megatron's sequence
    parallelism does (saving the gathered input keeps t x the bytes: at TP 8 it nearly doubles a layer's
    activations). Backward gathers the rows again behind the input-gradient GEMM, which does not need them, and
    reduce-scatters that gradient behind the weight-gradient GEMM. The GEMMs are autograd's linear's (its bits);
    under autocast both operands are cast first, as autocast's linear casts them."""

    @staticmethod
    def forward(ctx, x, weight, bias, grid):
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        need_x, need_w = ctx.needs_input_grad[:2]
        ctx.grid, ctx.has_bias, ctx.x_shape = grid, bias is not None, x.shape
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)  # what each gradient reads
        with torch.autocast(device, enabled=False):
            return F.linear(_gather_first(x, grid), weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        n, group = _tp(ctx.grid)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        rows = (ctx.x_shape[0] * n,) + tuple(ctx.x_shape[1:-1])
        total, gathering, scattering = x, None, None
        if n > 1 and need_w:
            x = x.contiguous()
            total = torch.empty(rows + (x.shape[-1],), dtype=x.dtype, device=x.device)
            gathering = _all_gather_tensor(total, x, group=group, async_op=True)
        g2 = g.reshape(-1, g.shape[-1])
        grad_x = grad_w = None
        if need_x:  # addmm's mat1 gradient: this rank's partial sum for every row
            partial = g2.mm(weight).view(rows + (weight.shape[1],))
        if gathering is not None:
            gathering.wait()
        if need_x and n > 1:
            grad_x = torch.empty((ctx.x_shape[0],) + tuple(partial.shape[1:]), dtype=partial.dtype,
                                 device=partial.device)
            scattering = _reduce_scatter_tensor(grad_x, partial, group=group, async_op=True)
        elif need_x:
            grad_x = partial
        if need_w:
            grad_w = g2.t().mm(total.reshape(-1, total.shape[-1]))  # (autograd's for a transposed mat2)
        grad_b = g2.sum(0) if ctx.has_bias and need_b else None
        if scattering is not None:
            scattering.wait()
        return grad_x, grad_w, grad_b, None


def linear_with_sequence_parallel_gather(x, weight, bias=None, grid=None):
    """F.linear of x all-gathered along the sequence (dim 0) over TP; backward reduce-scatters the input's
    gradient. Only x's own rows stay saved for backward (_GatherLinear)."""
    return _GatherLinear.apply(x, weight, bias, ps.current_grid(grid))


def copy_to_tensor_model_parallel_region(x, grid=None):
    """Identity forward; all-reduce of the gradient over TP backward."""
    return _Copy.apply(x, ps.current_grid(grid))


def reduce_from_tensor_model_parallel_region(x, inplace=False, grid=None):
    """All-reduce over TP forward; identity backward. inplace=True: x is a fresh tensor nobody
    else reads (a GEMM's output) and is reduced in its own storage instead of a copy."""
    return _Reduce.apply(x, inplace, ps.current_grid(grid))


def scatter_to_tensor_model_parallel_region(x, grid=None):
    """Keep this rank's slice of the last dim forward; all-gather backward."""
    return _ScatterLast.apply(x, ps.current_grid(grid))


def gather_from_tensor_model_parallel_region(x, grid=None):
    """All-gather along the last dim forward; keep this rank's slice backward."""
    return _GatherLast.apply(x, ps.current_grid(grid))


def scatter_to_sequence_parallel_region(x, grid=None):
    """Keep this rank's slice of the sequence (dim 0) forward; all-gather backward."""
    return _ScatterFirst.apply(x, ps.current_grid(grid))


def gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, grid=None):
    """All-gather along the sequence (dim 0) forward; reduce-scatter (or split) backward."""
    return _GatherFirst.apply(x, tensor_parallel_output_grad, ps.current_grid(grid))


def reduce_scatter_to_sequence_parallel_region(x, grid=None):
    """Reduce-scatter along the sequence (dim 0) forward; all-gather backward."""
    return _ReduceScatterFirst.apply(x, ps.current_grid(grid))


def all_reduce_max_tp(x, grid=None):
    """In-place max over the TP group (no autograd; used by the vocab-parallel loss)."""
    n, group = _tp(ps.current_grid(grid))
    if n > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def all_reduce_sum_tp_cp(x, grid=None):
    """In-place sum over TP x CP: the ranks that share one micro-batch's tokens under SP and CP (no autograd)."""
    g = ps.current_grid(grid)
    if g.tp * g.cp > 1:
        dist.all_reduce(x, group=g.tp_cp_group if g.cp > 1 else g.tp_group)
    return x


def all_reduce_sum_tp(x, grid=None):
    """In-place sum over the TP group (no autograd)."""
    n, group = _tp(ps.current_grid(grid))
    if n > 1:
        dist.all_reduce(x, group=group)
    return x


def max_over_context_parallel_region(x, grid=None, and_tensor=False):
    """In place: x becomes its elementwise maximum over the CP group (an FP8 scale's amax of an activation or
    gradient whose tokens the CP ranks share out); and_tensor: over TP x CP in one collective (such a tensor that
    the TP ranks hold shards of too)."""
    grid = ps.current_grid(grid)
    cp = getattr(grid, "cp", 1)  # (a layer's test grid may name TP alone)
    if cp == 1:
        return max_over_tensor_model_parallel_region(x, grid=grid) if and_tensor else x
    group = grid.tp_cp_group if and_tensor and grid.tp > 1 else grid.cp_group
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def max_over_tensor_model_parallel_region(x, grid=None, expert=False):
    """In place: x becomes its elementwise maximum over the TP group (an FP8 scale's amax of a tensor whose
    shards the TP ranks hold, so every rank quantizes with the whole tensor's scale); expert: over the group an MoE
    expert's weights are sharded over (expert-TP)."""
    grid = ps.current_grid(grid)
    if (grid.expert_tp()[0] if expert else grid.tp) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=grid.expert_tp_group() if expert else grid.tp_group)
    return x
