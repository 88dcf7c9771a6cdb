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

import torch

from . import _dispatch
from .workloads import workload

# every kernel with a check (the names use_triton's callers pass)
KERNELS = ("layer_norm", "rms_norm", "softmax", "bias_gelu", "swiglu", "rotary", "cross_entropy", "flash_attention",
           "adamw_step", "grouped_gemm", "fp8_cast", "fp8_blockwise")
EXACT = ("fp8_cast",)  # integer rounding written out: its fallback's bytes exactly
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
_mode = "cuda"
_verdicts = {}  # (kernel, device, dtype) -> None (trusted) or the reason it is not


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
    if _mode == "off" or (_mode == "cuda" and not t.is_cuda):
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
    try:
        with torch.enable_grad():  # the first use may come inside a Function's forward, or under no_grad
            with _dispatch.pinned("triton"):
                got = workload(kernel, device, dtype)()
            with _dispatch.pinned("torch"):
                want = workload(kernel, device, dtype)()
    except Exception as e:  # a build or launch that fails on this device
        return f"raised {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
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
