"""FP8 cast with a scale, and the input's amax, in one pass (an FP8 GEMM operand's quantization:
megalite/tensor_parallel/fp8.py): q = fp8(clamp(x * scale, -top, top)), amax = max |x|.

torch's version is four passes (multiply, clamp, cast, and an amax for the delayed recipe's history); this
is one read of x and one byte written per element. The rounding to e4m3 / e5m2 is written out in integer
arithmetic on the fp32 bits (round to nearest, ties to even; subnormals; the sign of zero kept; NaN stays
NaN) rather than left to the hardware's cast: the same code then runs under the Triton interpreter, whose
float8 cast truncates (-1.98 -> -1.0 in e4m3, torch gives -2.0), so the kernel's every byte is tested on
CPU against torch's cast (tests/kernels/test_fp8_cast.py). The arithmetic is a few integer operations an
element: the kernel stays bound by memory.
"""
import torch
import triton
import triton.language as tl

from ._dispatch import use_triton

BLOCK = 2048
# (exponent bias, mantissa bits, largest finite value) of each format
FORMATS = {torch.float8_e4m3fn: (7, 3, 448.0), torch.float8_e5m2: (15, 2, 57344.0)}


@triton.jit
def _to_fp8_bits(v, BIAS: tl.constexpr, MBITS: tl.constexpr):
    """fp32 v (|v| at most the format's largest value, or NaN) -> the FP8 code in the low 8 bits (int32)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    e = (mag >> 23) - 127  # the unbiased exponent (fp32 zero and subnormals: -127)
    # a normal FP8 value: round the 23-bit mantissa to MBITS bits (nearest, ties to even; a carry moves the
    # exponent up), then re-bias the exponent
    drop: tl.constexpr = 23 - MBITS
    up = mag + ((1 << (drop - 1)) - 1) + ((mag >> drop) & 1)
    normal = (up >> drop) - ((127 - BIAS) << MBITS)
    # below the smallest normal (2^(1 - BIAS)): a multiple of 2^(1 - BIAS - MBITS), the 24-bit significand
    # shifted right with the same rounding (a result of 2^MBITS is the smallest normal's code)
    sig = tl.where(e > -127, (mag & 0x7FFFFF) | 0x800000, mag & 0x7FFFFF)
    shift = tl.minimum(23 - MBITS + (1 - BIAS) - e, 31)
    half = (tl.full(sig.shape, 1, tl.int32) << (shift - 1)) - 1
    sub = (sig + half + ((sig >> shift) & 1)) >> shift
    code = tl.where(e >= 1 - BIAS, normal, sub)
    code = tl.where(v != v, 0x7F, code)  # NaN
    return code | (sign << 7)


@triton.jit
def _fp8_cast(X, Q, SCALE, AMAX, N, TOP: tl.constexpr, BIAS: tl.constexpr, MBITS: tl.constexpr,
              WITH_AMAX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = offs < N
    x = tl.load(X + offs, mask=msk, other=0.0).to(tl.float32)
    v = x * tl.load(SCALE)
    v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -TOP), TOP))  # (saturate; a NaN kept as torch's clamp keeps it)
    tl.store(Q + offs, _to_fp8_bits(v, BIAS, MBITS).to(tl.uint8), mask=msk)
    if WITH_AMAX:
        tl.atomic_max(AMAX, tl.max(tl.abs(x), axis=0))


def _torch(x, scale, dtype, with_amax):
    top = torch.finfo(dtype).max
    q = (x.float() * scale).clamp(-top, top).to(dtype)
    if not with_amax:
        return q, None
    return q, x.detach().abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)


def fp8_cast(x, scale, dtype, with_amax=False):
    """(x * scale rounded to the FP8 `dtype`, saturated at its largest value: a tensor of x's shape; and, with_amax,
    max |x| as a 0-d fp32 tensor, else None). scale: a 0-d fp32 tensor on x's device."""
    if dtype not in FORMATS:
        raise ValueError(f"kernels.fp8_cast: dtype must be one of {list(FORMATS)}, got {dtype}")
    if not use_triton(x, kernel="fp8_cast"):
        return _torch(x, scale, dtype, with_amax)
    x = x.detach().contiguous()
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    bias, mbits, top = FORMATS[dtype]
    if x.numel():
        _fp8_cast[(triton.cdiv(x.numel(), BLOCK),)](x, q, scale.reshape(()).float().contiguous(), amax, x.numel(),
                                                    TOP=top, BIAS=bias, MBITS=mbits, WITH_AMAX=with_amax,
                                                    BLOCK=BLOCK, num_warps=8)
    return q.view(dtype), (amax if with_amax else None)
