"""A kernel's shape class: what the race (choice.py) decides once and applies to every call of that kind.

A class is (kernel, dtype, device, bucket), the bucket taken from the shape of the first tensor a kernel passes to
use_triton, so no kernel's call site has to say more than it does. Sizes that a model fixes (hidden size, vocab
shard, heads, head dim) are kept exact; sizes that vary with the batch (rows, sequence, batch) are rounded down
to a power of two, so a run meets few classes and the representative input (the bucket itself) is never larger
than the calls it stands for. Buckets, by kernel:
  layer_norm, rms_norm, bias_gelu, swiglu, cross_entropy, fp8_cast: (rows, last dim), rows = all leading dims
      (a [s, b, h] input and its [s*b, h] view are one class: cross_entropy asks with both)
  softmax [b, h, sq, sk]: (b*h, sq, sk); rotary [b, s, h, d]: (b*s, h, d)
  flash_attention q [b, s, h, d]: (b, s, h, d), timed causal with as many kv heads as query heads (use_triton
      sees q alone at some call sites)
  adamw_step: one class (an elementwise update's speed ratio does not depend on its length past a few MB),
      timed at ADAMW_NUMEL
  grouped_gemm, fp8_blockwise, and flash_attention with a query that is not [b, s, h, d]: no class (None); the
      self-check alone decides. Ring attention's blocks ask as flash_attention_block, never raced (choice.py's
      SELF_CHECK_ONLY: their fallback is an explicit fp32 path, not the SDPA the race times).
"""
import math
from typing import NamedTuple

import torch

ADAMW_NUMEL = 1 << 24


class ShapeClass(NamedTuple):
    kernel: str
    dtype: torch.dtype
    device: str  # str(torch.device): "cuda:0"
    bucket: tuple

    def label(self):
        """The class in a cache key or a summary: 'rms_norm bfloat16 8192x4096'."""
        return f"{self.kernel} {str(self.dtype)[6:]} {'x'.join(map(str, self.bucket)) or '-'}"


def _pow2(n):
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def _rows(s):
    return (_pow2(math.prod(s[:-1])), s[-1]) if len(s) >= 1 else None


def _four(f):
    return lambda s: f(*s) if len(s) == 4 else None


_BUCKET = {**{k: _rows for k in ("layer_norm", "rms_norm", "bias_gelu", "swiglu", "cross_entropy", "fp8_cast")},
           "softmax": _four(lambda b, h, sq, sk: (_pow2(b * h), _pow2(sq), sk)),
           "rotary": _four(lambda b, s, h, d: (_pow2(b * s), h, d)),
           "flash_attention": _four(lambda b, s, h, d: (_pow2(b), _pow2(s), h, d)),
           "adamw_step": lambda s: ()}

# the bucket -> the size workloads.workload takes (see its docstring)
_SIZE = {"softmax": lambda bh, sq, sk: (bh, 1, sq, sk), "rotary": lambda bs, h, d: (1, bs, h, d),
         "flash_attention": lambda b, s, h, d: (b, s, h, d, h), "adamw_step": lambda: (ADAMW_NUMEL,)}


def of(kernel, shape, dtype, device):
    """The class of `kernel` called with a first tensor of this shape, dtype and device; None: never raced."""
    bucket = _BUCKET[kernel](tuple(shape)) if kernel in _BUCKET else None
    return None if bucket is None else ShapeClass(kernel, dtype, str(torch.device(device)), bucket)


def size(cls):
    """The representative size of a class, as workloads.workload takes it."""
    return _SIZE[cls.kernel](*cls.bucket) if cls.kernel in _SIZE else cls.bucket
