"""A kernel is tried before it is trusted: the first time a process would run a Triton kernel on a
device, in a dtype, it runs it forward and backward on a small input against its torch fallback on
the same device. A kernel that raises (a build that fails for that device), returns a non-finite
value or disagrees beyond its dtype's bound is replaced by its fallback for the rest of the run,
with one line on stderr naming the kernel, the device and why. A GPU the kernels were never run on
(an A100, a 3090, a V100 beside an H100 in one cluster) is therefore not the first test of them.

Modes (`set_self_check`): "cuda" (the default: kernels on CUDA devices are checked), "always" (also
the Triton interpreter on CPU: the tests), "off" (megalite's --no-kernel-self-check).

The bound: 16 unit roundoffs of the narrowest format in the kernel's arithmetic (fp32 kernels may
multiply in TF32, 10-bit mantissas: 2**-11), relative to the largest magnitude of the fallback's
result. Both paths compute in fp32 and round once or a few times to the dtype, so a correct kernel
sits a few units below it; a wrong one (a lost term, a bad index, a wrong scale) is off by O(1).
"""
import sys
import threading

import torch

from . import _dispatch

# every kernel with a check (the names use_triton's callers pass)
KERNELS = ("layer_norm", "rms_norm", "softmax", "bias_gelu", "swiglu", "rotary", "cross_entropy", "flash_attention",
           "adamw_step", "grouped_gemm", "fp8_cast", "fp8_blockwise")
EXACT = ("fp8_cast",)  # integer rounding written out: its fallback's bytes exactly
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
_mode = "cuda"
_verdicts = {}  # (kernel, device, dtype) -> None (trusted) or the reason it is not
_checking = threading.local()


def set_self_check(mode):
    global _mode
    if mode not in ("cuda", "always", "off"):
        raise ValueError(f"kernels self-check mode must be 'cuda', 'always' or 'off', got {mode!r}")
    _mode = mode


def get_self_check():
    return _mode


def reset():
    """Forget every verdict (tests)."""
    _verdicts.clear()


def distrust(kernel, device, dtype, reason):
    """Record a kernel as replaced by its fallback on (device, dtype), as a failed check would."""
    _verdicts[(kernel, str(device), dtype)] = reason


def verdicts():
    """{(kernel, device, dtype): None if trusted, else why not} for every check made so far."""
    return dict(_verdicts)


def trusted(kernel, t):
    """May `kernel` run its Triton path on t's device in t's dtype? Checks it the first time."""
    if _mode == "off" or (_mode == "cuda" and not t.is_cuda) or getattr(_checking, "on", False):
        return True
    key = (kernel, str(t.device), t.dtype)
    if key not in _verdicts:
        _verdicts[key] = _check(kernel, t.device, t.dtype)
        if _verdicts[key] is not None:
            name = torch.cuda.get_device_name(t.device) if t.is_cuda else "Triton interpreter"
            sys.stderr.write(f"megalite kernels: {kernel} on {t.device} ({name}, {str(t.dtype)[6:]}) {_verdicts[key]}; "
                             f"using its torch fallback for the rest of the run\n")
    return _verdicts[key] is None


def _check(kernel, device, dtype):
    bound = 0.0 if kernel in EXACT else 16 * UNIT_ROUNDOFF.get(dtype, 2.0 ** -8)
    _checking.on = True
    try:
        with torch.enable_grad():  # the first use may come inside a Function's forward, or under no_grad
            got = _run(kernel, device, dtype, "triton")
            want = _run(kernel, device, dtype, "torch")
    except Exception as e:  # a build or launch that fails on this device
        return f"raised {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    finally:
        _checking.on = False
    for name, a, b in zip(_names(len(want)), got, want):
        a, b = a.double(), b.double()
        if not torch.isfinite(a).all():
            return f"returned a non-finite {name}"
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
        if err > bound:
            return f"disagrees with its fallback ({name}: relative error {err:.2e} > {bound:.2e})"
    return None


def _names(n):
    return ["output"] + [f"gradient {i}" for i in range(1, n)]


def _run(kernel, device, dtype, backend):
    """The kernel's output and the gradients of its inputs (or the updated state), on one backend."""
    import kernels  # the package: its ops are defined after this module is imported
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dt=dtype, grad=True):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt).requires_grad_(grad)
    with _dispatch.use_backend(backend):
        if kernel == "adamw_step":
            p, gr, m, v = (torch.randn(1000, generator=g).to(device) for _ in range(4))
            v = v.abs()
            kernels.adamw_step(p, gr, m, v, step=3, lr=1e-2, weight_decay=0.1)
            return [p, m, v]
        if kernel == "grouped_gemm":
            x, w = rnd(48, 64), rnd(3, 32, 64)
            from kernels.grouped_gemm import grouped_gemm
            return _with_grads(grouped_gemm(x, w, [16, 0, 32]), [x, w], g)
        if kernel == "fp8_cast":  # (held to its fallback byte for byte: EXACT)
            from kernels.fp8_cast import fp8_cast
            x = rnd(64, 96, grad=False) * 100
            return [q.float() for q in (fp8_cast(x, torch.tensor(2.5, device=device), f, with_amax=True)[0]
                                        for f in (torch.float8_e4m3fn, torch.float8_e5m2))] + \
                [fp8_cast(x, torch.tensor(1.0, device=device), torch.float8_e4m3fn, with_amax=True)[1]]
        if kernel == "fp8_blockwise":  # a weight-shaped product (128-column groups) and a weight gradient's (1)
            from kernels.fp8_blockwise import blockwise_mm
            a, b = rnd(64, 256, grad=False).to(torch.float8_e4m3fn), rnd(256, 192, grad=False).to(torch.float8_e5m2)
            sa, sb = rnd(64, 2, grad=False).abs(), rnd(2, 2, grad=False).abs()
            return [blockwise_mm(a, sa.float(), b, sb.float(), 128, torch.float32),
                    blockwise_mm(a, sa.float(), b, rnd(2, 192, grad=False).abs().float(), 1, torch.float32)]
        if kernel == "cross_entropy":
            x, t = rnd(16, 512), torch.randint(0, 512, (16,), generator=g).to(device)
            return _with_grads(kernels.cross_entropy(x * 1, t, inplace_backward=True), [x], g)
        if kernel == "flash_attention":
            q, k, v = rnd(1, 64, 4, 64), rnd(1, 64, 2, 64), rnd(1, 64, 2, 64)
            return _with_grads(kernels.flash_attention(q, k, v, causal=True), [q, k, v], g)
        if kernel == "rotary":
            x, ang = rnd(2, 16, 4, 64), torch.rand(16, 64, generator=g).to(device)
            return _with_grads(kernels.rotary(x * 1, ang.cos(), ang.sin()), [x], g)
        n = 256
        x, w, b = rnd(16, n), rnd(n), rnd(n)
        ops = {"layer_norm": lambda: kernels.layer_norm(x, w, b), "rms_norm": lambda: kernels.rms_norm(x, w),
               "bias_gelu": lambda: kernels.bias_gelu(x, b), "swiglu": lambda: kernels.swiglu(x),
               "softmax": lambda: kernels.softmax(x.view(1, 1, 16, n), scale=0.5, causal=True)}
        return _with_grads(ops[kernel](), [x, w, b], g)


def _with_grads(y, leaves, g):
    dy = torch.randn(y.shape, generator=g).to(device=y.device, dtype=y.dtype)
    grads = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    return [y.detach()] + [gr for gr in grads if gr is not None]
