"""FP8 GEMMs for the tensor-parallel linear layers (--fp8-format, --fp8-recipe), on torch._scaled_mm (cuBLASLt's
FP8 GEMM on sm_89/sm_90); on CPU the fp32 product of the dequantized operands, which is what the GEMM computes
(scaled_mm: oneDNN's FP8 primitive, torch._scaled_mm's CPU path, costs about 1 ms a call however small, and some
instruction sets (AVX-512 without BF16) have none).

Each of a linear layer's three GEMMs — forward y = x w^T, input gradient dx = dy w, weight gradient dw = dy^T x —
multiplies FP8 operands: x and w in e4m3, dy in e4m3 (--fp8-format e4m3) or e5m2 (hybrid), each with one fp32
scale per tensor (its largest magnitude mapped to the format's largest value, less --fp8-margin powers of two),
the product rescaled and accumulated in fp32. The recipes differ in where the scale comes from:
  tensorwise: the tensor's own amax (current scaling, torchao's default);
  rowwise: one scale per row of each GEMM's operands along its contraction (torchao's rowwise: x per token, w
    per output feature in the forward; each gradient GEMM requantizes its operands from the unquantized tensors
    along its own contraction, so autograd keeps x and w in the model's precision);
  blockwise: DeepSeek-V3's: a scale per 1 x 128 tile of activations and gradients along each GEMM's contraction
    and per 128 x 128 block of the weight; on CPU (and, until megalite has a blockwise FP8 GEMM kernel, on CUDA)
    the GEMM is the fp32 product of the dequantized operands, which is what such a GEMM computes; a TP shard
    must hold whole blocks;
  delayed: the amax history of earlier iterations (--fp8-amax-history-len, --fp8-amax-compute-algo), as
    Transformer Engine's DelayedScaling; the history grows by one entry per iteration, the largest amax of all of
    its micro-batches, so the scales (and the function) do not depend on how a layout splits the batch. Before
    any history (the first iteration) a tensor is scaled by its own amax: TE starts from a scale of 1, which
    flushes small gradients to zero and makes the first step depend on the layout's loss divisor.
A layout computes the same function as one process because every amax is of the whole tensor (row-wise: of the
whole row): the TP ranks holding shards of one agree on its maximum (mappings.max_over_tensor_model_parallel_region)
before quantizing, and the CP ranks on an activation's or gradient's (each holds part of every sequence). Row-wise
and blockwise scales along the tokens (their weight-gradient GEMMs') would have to be cut as CP cuts the sequence:
those two recipes are refused with CP. The layers' biases, the embeddings, the output
layer, norms, attention's softmax and the optimizer stay in the model's precision, as in Megatron."""

import contextlib

import torch

import kernels
from kernels.fp8_blockwise import blockwise_mm
from kernels.fp8_cast import fp8_cast
from megalite.tensor_parallel.mappings import max_over_context_parallel_region, max_over_tensor_model_parallel_region

FORMATS = {"e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn), "hybrid": (torch.float8_e4m3fn, torch.float8_e5m2)}
RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
BLOCK = 128  # DeepSeek-V3's: 1 x 128 tiles of activations and gradients, 128 x 128 of weights


def _scale(dtype, amax, margin):
    amax = amax.float()
    return torch.where(amax > 0, torch.finfo(dtype).max / amax / (2.0 ** margin), torch.ones_like(amax))


def scaled(t, dtype, amax, margin):
    """(t in FP8 `dtype`, the fp32 factor that undoes its scale): t x scale, saturated at the format's largest."""
    top, scale = torch.finfo(dtype).max, _scale(dtype, amax, margin)
    if scale.dim() == 0:  # one scale: one fused pass on CUDA (kernels/fp8_cast.py; on CPU these same torch ops)
        return fp8_cast(t, scale, dtype)[0], scale.reciprocal()
    return (t.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


def scale_inverse(dtype, amax, margin):
    """The factor scaled() returns for this amax."""
    return _scale(dtype, amax, margin).reciprocal()


class Fp8Site:
    """One linear layer's FP8 scaling: its recipe and, delayed, the amax histories of its x, w and dy.
    row_parallel: x is the TP shard of the layer's input (its amax is reduced over TP); else dy is."""

    def __init__(self, fmt, recipe, margin=0, history_len=1, algo="most_recent", wgrad=True, row_parallel=False,
                 grid=None, expert=False, fused=True):
        if fmt not in FORMATS or recipe not in RECIPES:
            raise ValueError(f"FP8 format {fmt!r} / recipe {recipe!r}: megalite has formats {', '.join(FORMATS)} and "
                             f"recipes {', '.join(RECIPES)}")
        self.forward_dtype, self.grad_dtype = FORMATS[fmt]
        self.recipe, self.margin, self.algo, self.wgrad = recipe, margin, algo, wgrad
        self.row_parallel, self.grid = row_parallel, grid
        # an MoE expert's layer: sharded over expert-TP; its rows are one micro-batch's (megalite/moe/experts.py)
        self.expert, self.fused = expert, fused  # fused: the cast kernel on CUDA (kernels/fp8_cast.py)
        self.history = {k: torch.zeros(history_len) for k in ("x", "w", "dy")}  # newest first
        self.pending = {k: torch.zeros(()) for k in ("x", "w", "dy")}  # this iteration's largest amax so far
        self.positive = {k: [] for k in ("x", "w", "dy")}  # (on the host) each history entry > 0, newest first
        # the histories hold the single process's amaxes, whatever the layout: this layout's gradients are grad_units
        # times that process's (each DP rank divides its loss by its own micro-batches; set by training/setup.py)
        self.grad_units = 1

    def amax(self, which, t):
        """The whole tensor's amax (reduced over TP where this rank holds a shard of it)."""
        # (an expert may get no rows of a micro-batch: nothing to scale)
        mine = t.detach().abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)
        return self._whole(which, mine)

    def _whole(self, which, a):
        """This rank's amax of its part of a tensor -> the whole tensor's."""
        a = a.reshape(1)
        if which == "w" or self.expert:  # (an expert's rows are whole: the dispatcher gathered them)
            if which == "w" or (which == "x") == self.row_parallel:
                a = max_over_tensor_model_parallel_region(a, grid=self.grid, expert=self.expert)
            return a.reshape(())
        # (CP shares every sequence's tokens out: an activation's and gradient's are split; one collective)
        return max_over_context_parallel_region(a, grid=self.grid,
                                                and_tensor=(which == "x") == self.row_parallel).reshape(())

    def kernels(self):
        """The context of this site's casts: the fused kernel on CUDA, or torch's ops (--no-fused-kernels)."""
        return contextlib.nullcontext() if self.fused else kernels.use_backend("torch")

    def quantize(self, which, t):
        with self.kernels():
            return self._quantize(which, t)

    def _quantize(self, which, t):
        dtype = self.grad_dtype if which == "dy" else self.forward_dtype
        if which == "w" and getattr(t, "fp8_weight", None) is not None:  # --fp8-param-gather: quantized at the step
            wq, inverse, now = t.fp8_weight  # (distributed/fp8_gather.py)
            if self.recipe == "delayed":
                self.pending["w"] = torch.maximum(self.pending["w"].to(now.device), now)
            return wq, inverse
        if self.recipe == "tensorwise":
            return scaled(t, dtype, self.amax(which, t), self.margin)
        if self.history[which].device != t.device:  # (kept where the tensors are: no host sync per GEMM)
            self.history[which], self.pending[which] = self.history[which].to(t.device), self.pending[which].to(
                t.device)
        if any(self.positive[which][:None if self.algo == "max" else 1]):
            h = self.history[which]
            known = (h.max() if self.algo == "max" else h[0]) * (self.grad_units if which == "dy" else 1)
            # the scale from the history: cast and amax in one pass (kernels/fp8_cast.py)
            q, mine = fp8_cast(t, _scale(dtype, known, self.margin), dtype, with_amax=True)
            self.pending[which] = torch.maximum(self.pending[which], self._whole(which, mine))
            return q, scale_inverse(dtype, known, self.margin)
        # no history yet (the first iteration): the tensor's own amax, not TE's scale of 1, which would flush most
        # gradients to zero and make the first step depend on the layout
        now = self.amax(which, t)
        self.pending[which] = torch.maximum(self.pending[which], now)
        return scaled(t, dtype, now, self.margin)

    def roll(self, amaxes, positive):
        """Delayed: this iteration's largest amaxes (x, w, dy) join the histories, newest first (positive: whether
        each is > 0, read once an iteration, so a GEMM knows without a host read whether its history scales it)."""
        for k, a, p in zip(("x", "w", "dy"), amaxes, positive):
            h, a = self.history[k], a / self.grad_units if k == "dy" else a
            self.history[k] = torch.cat([a.reshape(1).to(h.device), h[:-1]])
            self.pending[k] = torch.zeros((), device=h.device)
            self.positive[k] = [p] + self.positive[k][:h.numel() - 1]

    def state_dict(self):
        return {k: v.cpu().tolist() for k, v in self.history.items()}

    def load_state_dict(self, sd):
        for k, v in sd.items():
            self.history[k] = torch.tensor(v, dtype=torch.float32, device=self.history[k].device)
            self.positive[k] = [a > 0 for a in v]


def set_gradient_units(modules, units):
    """Every FP8 site of `modules`: this layout's gradients are `units` times the single process's."""
    for m in modules:
        if getattr(m, "fp8", None) is not None:
            m.fp8.grad_units = units


def iteration_amaxes(modules, reduce_max, reduce_max_experts=None):
    """After an iteration's backward, on every rank: [(the delayed sites of `modules`, in their one order; their
    pending amaxes (x, w, dy each) reduced by reduce_max over the ranks that ran the iteration's other micro-batches,
    one collective; MoE experts' by reduce_max_experts, over the ranks holding the same experts)]. roll() takes them
    into the histories (fault-tolerant replicas reduce them over the quorum first, and roll only a committed step)."""
    sites = [m.fp8 for m in modules if getattr(m, "fp8", None) is not None and m.fp8.recipe == "delayed"]
    out = []
    for expert, reduce in ((False, reduce_max), (True, reduce_max_experts)):
        mine = [s for s in sites if s.expert == expert]
        if mine:
            device = mine[0].pending["x"].device  # (where the GEMMs ran)
            out.append((mine, reduce(torch.stack([s.pending[k].reshape(()).to(device) for s in mine
                                                  for k in ("x", "w", "dy")]))))
    return out


def roll(amaxes):
    """iteration_amaxes' values into their sites' histories."""
    for sites, got in amaxes:
        positive = (got > 0).tolist()  # (one host read an iteration)
        for i, s in enumerate(sites):
            s.roll(got[3 * i:3 * i + 3], positive[3 * i:3 * i + 3])


def discard(modules):
    """An iteration that did not commit (a fault-tolerant replica failed): its amaxes forgotten (it runs again)."""
    for m in modules:
        if getattr(m, "fp8", None) is not None:
            m.fp8.pending = {k: torch.zeros_like(v) for k, v in m.fp8.pending.items()}


def along(t, dim, dtype, margin, sharded, grid):
    """Row-wise scaling: t in FP8 with one scale per slice along `dim` (the amax over the other dimension, reduced
    over TP where this rank holds a shard of that dimension); the undo factors broadcast as t's slices."""
    a = t.detach().abs().amax(dim=1 - dim, keepdim=True).float() if t.shape[1 - dim] else \
        t.new_zeros([1, t.shape[1]] if dim else [t.shape[0], 1], dtype=torch.float32)  # (an expert without rows)
    if sharded:
        a = max_over_tensor_model_parallel_region(a.contiguous(), grid=grid)
    return scaled(t, dtype, a, margin)


def _rowwise_forward(site, x2, weight):
    k_sharded = site.row_parallel  # (a row-parallel layer's K is split over TP)
    xq, sx = along(x2, 0, site.forward_dtype, site.margin, k_sharded, site.grid)  # [M, 1]
    wq, sw = along(weight, 0, site.forward_dtype, site.margin, k_sharded, site.grid)  # [N, 1]
    return scaled_mm(xq, wq.t(), sx, sw.t(), x2.dtype)


def _rowwise_dgrad(site, dy2, weight, dtype):
    n_sharded, g, m = not site.row_parallel, site.grid, site.margin  # (a column-parallel layer's N is split)
    dyq, sdy = along(dy2, 0, site.grad_dtype, m, n_sharded, g)  # dx = dy w: contraction over N
    wq, sw = along(weight, 1, site.forward_dtype, m, n_sharded, g)  # [1, K]
    return scaled_mm(dyq, _column_major(wq), sdy, sw, dtype)


def _rowwise_wgrad(site, dy2, x2):
    g, m = site.grid, site.margin
    dytq, sdyt = along(dy2.t(), 0, site.grad_dtype, m, False, g)  # dw = dy^T x: contraction over M (whole here)
    dytq = dytq.contiguous()  # (cuBLASLt's A is row-major; dy^T's rows come strided)
    xq, sx = along(x2, 1, site.forward_dtype, m, False, g)  # [1, K]
    return scaled_mm(dytq, _column_major(xq), sdyt, sx, torch.float32)


def quantized_blocks(t, rows, cols, dtype, margin):
    """t [R, C] rounded to FP8 with one scale per rows x cols block (the last ones partial): (q [R, C], the fp32
    factors that undo the scales [ceil(R / rows), ceil(C / cols)])."""
    r, c = t.shape
    pr, pc = -(-r // rows) * rows, -(-c // cols) * cols
    padded = torch.zeros(pr, pc, dtype=torch.float32, device=t.device)
    padded[:r, :c] = t
    b = padded.reshape(pr // rows, rows, pc // cols, cols)
    q, undo = scaled(b, dtype, b.abs().amax(dim=(1, 3), keepdim=True), margin)
    return q.reshape(pr, pc)[:r, :c], undo.reshape(pr // rows, pc // cols)


def blocks(t, rows, cols, dtype, margin):
    """quantized_blocks' t dequantized: the fp32 values a blockwise-scaled FP8 GEMM multiplies."""
    q, undo = quantized_blocks(t, rows, cols, dtype, margin)
    r, c = t.shape
    return (q.float() * undo.repeat_interleave(rows, 0)[:r].repeat_interleave(cols, 1)[:, :c])


def _whole_blocks(site, t, dim):
    """A TP shard of dimension `dim` must hold whole blocks, or its blocks are not the single process's."""
    if getattr(site.grid, "tp", 1) > 1 and t.shape[dim] % BLOCK:
        raise ValueError(f"--fp8-recipe blockwise: a tensor-parallel shard of {t.shape[dim]} features is not a "
                         f"whole number of {BLOCK}-wide blocks; pick sizes whose TP shards are multiples of {BLOCK}")


def _blockwise_forward(site, x2, weight):
    _whole_blocks(site, weight, 1 if site.row_parallel else 0)
    fd, m = site.forward_dtype, site.margin
    xq, sx = quantized_blocks(x2, 1, BLOCK, fd, m)  # x: 1 x 128 tiles along K
    wq, sw = quantized_blocks(weight, BLOCK, BLOCK, fd, m)  # w [N, K]: 128 x 128 blocks
    return blockwise_mm(xq, sx, wq.t(), sw.t(), BLOCK, x2.dtype)


def _blockwise_dgrad(site, dy2, weight, dtype):
    fd, gd, m = site.forward_dtype, site.grad_dtype, site.margin
    wq, sw = quantized_blocks(weight, BLOCK, BLOCK, fd, m)  # (square blocks: the same for both contractions)
    dyq, sdy = quantized_blocks(dy2, 1, BLOCK, gd, m)  # dx = dy w: tiles along N
    return blockwise_mm(dyq, sdy, wq, sw, BLOCK, dtype)


def _blockwise_wgrad(site, dy2, x2):
    fd, gd, m = site.forward_dtype, site.grad_dtype, site.margin
    # dw = dy^T x: tiles along M (the tokens) of both; x's tiles run down its columns (one factor a column)
    dytq, sdyt = quantized_blocks(dy2.t(), 1, BLOCK, gd, m)
    xtq, sxt = quantized_blocks(x2.t(), 1, BLOCK, fd, m)
    return blockwise_mm(dytq, sdyt, xtq.t(), sxt.t(), 1, torch.float32)


# recipe -> (its input gradient's GEMM, its weight gradient's), each quantizing from the unquantized operands
_REQUANTIZED = {"rowwise": (_rowwise_dgrad, _rowwise_wgrad), "blockwise": (_blockwise_dgrad, _blockwise_wgrad)}


def _mm(a, b_t, scale_a, scale_b, out_dtype):
    """a [m, k] (row-major) x b_t [k, n] (column-major) in FP8, rescaled: [m, n] in out_dtype."""
    return scaled_mm(a, b_t, scale_a.reshape(()).float(), scale_b.reshape(()).float(), out_dtype)


def scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """(a scale_a) @ (b scale_b) in out_dtype, FP8 a [m, k] and b [k, n] (column-major) with fp32 scales (0-d, or
    [m, 1] and [1, n]): torch._scaled_mm on CUDA; on CPU the fp32 GEMM of the dequantized operands."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def _column_major(t):
    return t.t().contiguous().t()


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, site, store):
        shape, out_dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1])
        ctx.site, ctx.store, ctx.shape, ctx.dtypes = site, store, shape, (x.dtype, weight.dtype)
        if site.recipe in _REQUANTIZED:  # (each GEMM requantizes from the unquantized operands)
            ctx.save_for_backward(x2, weight)
            fwd = _rowwise_forward if site.recipe == "rowwise" else _blockwise_forward
            with site.kernels():  # (blockwise: its GEMM kernel on CUDA)
                return fwd(site, x2, weight).reshape(*shape[:-1], weight.shape[0])
        xq, sx = site.quantize("x", x2)
        wq, sw = site.quantize("w", weight)
        y = _mm(xq, wq.t(), sx, sw, out_dtype)
        ctx.save_for_backward(xq if site.wgrad else x2, sx, wq, sw, weight)
        return y.reshape(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        site = ctx.site
        dy2 = dy.reshape(-1, dy.shape[-1])
        if site.recipe in _REQUANTIZED:
            x2, weight = ctx.saved_tensors
            dgrad, wgrad = _REQUANTIZED[site.recipe]
            with site.kernels():
                dx = dgrad(site, dy2, weight, ctx.dtypes[0])

            def weight_gradient():
                if not site.wgrad:  # --no-fp8-wgrad: the weight gradient in the model's precision
                    return dy2.t().float() @ x2.float()
                with site.kernels():
                    return wgrad(site, dy2, x2)
        else:
            saved, sx, wq, sw, weight = ctx.saved_tensors
            dyq, sdy = site.quantize("dy", dy2)  # (its amax taken here, at B, with dx's)
            dx = _mm(dyq, _column_major(wq), sdy, sw, ctx.dtypes[0])

            def weight_gradient():
                if not site.wgrad:
                    return dy2.t().float() @ saved.float()
                return _mm(dyq.t().contiguous(), _column_major(saved), sdy, sx, torch.float32)
        dx = dx.reshape(ctx.shape)
        if ctx.store is None:
            return dx, weight_gradient().to(ctx.dtypes[1]), None, None
        # a split backward (tensor_parallel/deferred_wgrad.py): the weight gradient's GEMM when the schedule says W
        ctx.store.put(lambda: (weight, weight_gradient().to(ctx.dtypes[1])))
        return dx, None, None, None


def fp8_linear(x, weight, site, store=None):
    """x w^T with every GEMM (forward and both gradients) in FP8 as `site` says; no bias. store: a split backward's
    (deferred_linear's), which gets the weight gradient's GEMM; None or a frozen weight: computed at once."""
    return _Fp8Linear.apply(x, weight, site, store if weight.requires_grad else None)
