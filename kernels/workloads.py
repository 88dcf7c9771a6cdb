"""Each kernel's sample workload: its inputs at a size, and one call forward and backward as training runs it (one
update for AdamW, the casts and the FP8 product, which have no backward). The self-check (self_check.py) runs one
at its small size on both backends and compares the results; the race (choice.py) times one at the
representative size of a shape class (shape_class.py) on both backends.

`workload(kernel, device, dtype, size=None)` returns run(): each call runs the kernel once on whatever backend is
set and returns [output, gradients...] (or the updated state). The inputs are drawn from a generator seeded 0 at
the first call, not before, so a timer that never calls run (a stand-in) costs no allocation. Sizes, per kernel:
  rows kernels (layer_norm, rms_norm, bias_gelu, swiglu, cross_entropy, fp8_cast): (rows, last dim)
  softmax: (b, h, sq, sk); rotary: (b, s, h, d); flash_attention: (b, s, h, d, kv heads); adamw_step: (numel,)
  grouped_gemm, fp8_blockwise: their one small size (they are checked, never raced: shape_class.py)
"""
import torch

SMALL = {"layer_norm": (16, 256), "rms_norm": (16, 256), "bias_gelu": (16, 256), "swiglu": (16, 256),
         "softmax": (1, 1, 16, 256), "rotary": (2, 16, 4, 64), "flash_attention": (1, 64, 4, 64, 2),
         "cross_entropy": (16, 512), "adamw_step": (1000,), "fp8_cast": (64, 96), "grouped_gemm": (),
         "fp8_blockwise": ()}


def workload(kernel, device, dtype, size=None):
    """run() for `kernel` at `size` (default: SMALL's), on `device` in `dtype`; see the module docstring."""
    size = SMALL[kernel] if size is None else tuple(size)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dt=dtype, grad=True):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt).requires_grad_(grad)
    state = {}

    def run():
        if "op" not in state:
            state["op"] = _BUILD[kernel](rnd, g, device, size)
        op, leaves = state["op"]
        y = op()
        if leaves is None:  # an update or a cast: its results are what it wrote
            return y
        if "dy" not in state:
            state["dy"] = torch.randn(y.shape, generator=g).to(device=y.device, dtype=y.dtype)
        with torch.enable_grad():
            grads = torch.autograd.grad(y, leaves, state["dy"], allow_unused=True)
        return [y.detach()] + [gr for gr in grads if gr is not None]
    return run


def _rows(kernel):
    def build(rnd, g, device, size):
        from .bias_gelu import bias_gelu
        from .layer_norm import layer_norm
        from .rms_norm import rms_norm
        from .swiglu import swiglu
        rows, n = size
        x, w, b = rnd(rows, n), rnd(n), rnd(n)
        ops = {"layer_norm": lambda: layer_norm(x, w, b), "rms_norm": lambda: rms_norm(x, w),
               "bias_gelu": lambda: bias_gelu(x, b), "swiglu": lambda: swiglu(x)}
        return ops[kernel], [x, w, b]
    return build


def _softmax(rnd, g, device, size):
    from .softmax import softmax
    x = rnd(*size)
    return (lambda: softmax(x, scale=0.5, causal=True)), [x]


def _cross_entropy(rnd, g, device, size):
    from .cross_entropy import cross_entropy
    rows, v = size
    x, t = rnd(rows, v), torch.randint(0, v, (rows,), generator=g).to(device)
    # x * 1: the in-place backward writes the gradient into the logits, which must not be the leaf itself
    # (training's logits are a product's output); the copy costs both paths the same
    return (lambda: cross_entropy(x * 1, t, inplace_backward=True)), [x]


def _rotary(rnd, g, device, size):
    from .rotary import rotary
    b, s, h, d = size
    x, ang = rnd(b, s, h, d), torch.rand(s, d, generator=g).to(device)
    cos, sin = ang.cos(), ang.sin()
    return (lambda: rotary(x, cos, sin)), [x]


def _flash_attention(rnd, g, device, size):
    from .flash_attention import flash_attention
    b, s, h, d, hk = size
    q, k, v = rnd(b, s, h, d), rnd(b, s, hk, d), rnd(b, s, hk, d)
    return (lambda: flash_attention(q, k, v, causal=True)), [q, k, v]


def _adamw_step(rnd, g, device, size):
    from .adamw import adamw_step
    p, gr, m, v = (torch.randn(size[0], generator=g).to(device) for _ in range(4))
    v = v.abs()

    def op():
        adamw_step(p, gr, m, v, step=3, lr=1e-2, weight_decay=0.1)
        return [p, m, v]
    return op, None


def _grouped_gemm(rnd, g, device, size):
    from .grouped_gemm import grouped_gemm
    x, w = rnd(48, 64), rnd(3, 32, 64)
    return (lambda: grouped_gemm(x, w, [16, 0, 32])), [x, w]


def _fp8_cast(rnd, g, device, size):
    """Held to its fallback byte for byte (self_check.EXACT): both formats, and the amax of the unscaled cast."""
    from .fp8_cast import fp8_cast
    x = rnd(*size, grad=False) * 100
    return (lambda: [q.float() for q in (fp8_cast(x, torch.tensor(2.5, device=device), f, with_amax=True)[0]
                                         for f in (torch.float8_e4m3fn, torch.float8_e5m2))]
            + [fp8_cast(x, torch.tensor(1.0, device=device), torch.float8_e4m3fn, with_amax=True)[1]]), None


def _fp8_blockwise(rnd, g, device, size):
    """A weight-shaped product (128-column groups) and a weight gradient's (1)."""
    from .fp8_blockwise import blockwise_mm
    a, b = rnd(64, 256, grad=False).to(torch.float8_e4m3fn), rnd(256, 192, grad=False).to(torch.float8_e5m2)
    sa, sb = rnd(64, 2, grad=False).abs(), rnd(2, 2, grad=False).abs()
    sb1 = rnd(2, 192, grad=False).abs()
    return (lambda: [blockwise_mm(a, sa.float(), b, sb.float(), 128, torch.float32),
                     blockwise_mm(a, sa.float(), b, sb1.float(), 1, torch.float32)]), None


_BUILD = {**{k: _rows(k) for k in ("layer_norm", "rms_norm", "bias_gelu", "swiglu")}, "softmax": _softmax,
          "cross_entropy": _cross_entropy, "rotary": _rotary, "flash_attention": _flash_attention,
          "adamw_step": _adamw_step, "grouped_gemm": _grouped_gemm, "fp8_cast": _fp8_cast,
          "fp8_blockwise": _fp8_blockwise}
