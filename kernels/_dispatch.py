"""Backend choice for every kernel: Triton on CUDA tensors, plain torch on CPU tensors.

`set_backend("triton")` forces Triton even on CPU tensors; that only works when
TRITON_INTERPRET=1 was set before `kernels` was imported (Triton reads it when the
kernels are decorated), which is how the CPU tests exercise the Triton code.

A named kernel's Triton path also passes a gate: kernels/choice.py registers it when the package is
imported (the self-check, then the measured choice against the fallback). The gate is registered rather
than imported so that this module, which every kernel imports, imports none of them back.
"""
import contextlib
import os
import threading

import torch

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:  # the kernel modules import triton themselves: megalite needs it installed
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_BACKENDS = ("auto", "triton", "torch")
_backend = "auto"
_gate = None  # gate(kernel, tensors, forced) -> bool; set by kernels.choice at package import
_pinned = threading.local()  # .on inside a self-check or a race: the path they asked for runs, ungated


def set_backend(name):
    """'auto' (Triton on CUDA tensors, torch otherwise), 'triton' or 'torch'."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"kernels backend must be one of {_BACKENDS}, got {name!r}")
    _backend = name


def get_backend():
    return _backend


@contextlib.contextmanager
def use_backend(name):
    old = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def set_gate(gate):
    """Install gate(kernel, tensors, forced) -> bool, asked before a named kernel's Triton path runs
    (forced: the backend was set to 'triton'). kernels/choice.py installs its own at import."""
    global _gate
    _gate = gate


@contextlib.contextmanager
def pinned(name):
    """Run exactly backend `name`, the gate not asked: the self-check and the race compare the two paths
    themselves, and a gate consulted from inside them would check or time again."""
    old = getattr(_pinned, "on", False)
    _pinned.on = True
    try:
        with use_backend(name):
            yield
    finally:
        _pinned.on = old


def use_triton(*tensors, kernel=None):
    """True when the Triton path should run for these tensors (None entries ignored). With `kernel`
    named, the gate must also let it (its self-check on this device passed; measured the faster)."""
    if _backend == "torch":
        return False
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    on_cuda = bool(ts) and all(t.is_cuda for t in ts)
    if _backend == "auto":
        if not (HAVE_TRITON and on_cuda and not INTERPRET):
            return False
    elif not HAVE_TRITON:
        raise RuntimeError("kernels backend 'triton' was forced but triton is not installed")
    elif not on_cuda and not INTERPRET:
        raise RuntimeError("kernels backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 "
                           "set before `kernels` is imported; use backend 'torch' or CUDA tensors")
    if kernel is None or _gate is None or getattr(_pinned, "on", False):
        return True
    return _gate(kernel, ts, _backend == "triton")


def num_warps(block):
    """Warps for a 1-D block of `block` elements: ~8 fp32 elements per thread, capped at 16."""
    return max(1, min(16, block // 256))


# Tests set this so every buffer a kernel should fully overwrite starts as NaN:
# an element a kernel forgets to write then fails the comparison.
POISON = False


def _poison(t):
    if POISON and t.is_floating_point():
        t.fill_(float("nan"))
    return t


def empty(shape, device, dtype):
    return _poison(torch.empty(shape, device=device, dtype=dtype))


def empty_like(t):
    return _poison(torch.empty_like(t, memory_format=torch.contiguous_format))

