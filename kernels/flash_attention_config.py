"""Flash attention's launch configurations: the built-in table per chip class, a tuned table's entries, and the
tuning space benchmarks/tune_kernels.py searches (kernels/tuned.py).
"""
import torch
import triton

from . import tuned
from ._dispatch import INTERPRET

# (arch class, BLOCK_D, bytes per q/k/v element) -> (BLOCK_M, BLOCK_N, warps, stages) of the forward, the dK/dV
# and the dQ kernel; arch class 90 is Hopper (wgmma, TMA, 227 KB of shared memory per block), 80 everything else
# (and the interpreter). dK/dV's BLOCK_N is the key block it holds (its matmuls' M: 128 for wgmma's 64 rows per
# warpgroup at 8 warps), its BLOCK_M the query step; dQ holds BLOCK_M query rows. Chosen by building for sm_90
# and sm_80 (benchmarks/sm90_report.py, tests/kernels/gpu_compile.py): no spills under triton 3.6 and 3.9,
# shared memory within each chip's limit, and on sm_90 the steady-state loops within the report's budgets.
# A table tuned on a device (kernels/tuned.py, benchmarks/tune_kernels.py) overrides the plain entries.
_CONFIGS = {
    (90, 64, 2): ((128, 128, 8, 3), (64, 128, 8, 3), (128, 64, 8, 3)),
    (90, 128, 2): ((128, 128, 8, 2), (32, 128, 8, 2), (128, 64, 8, 2)),
    (90, 256, 2): ((64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 8, 2)),
    (90, 64, 4): ((64, 64, 4, 2), (32, 64, 4, 2), (64, 64, 4, 2)),  # fp32 (TF32): 64-row products, wgmma
    (90, 128, 4): ((64, 32, 4, 2), (16, 64, 4, 2), (64, 32, 4, 2)),
    (90, 256, 4): ((32, 32, 4, 2), (16, 32, 4, 2), (16, 32, 4, 2)),
    (80, 64, 2): ((128, 64, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3)),
    (80, 128, 2): ((128, 64, 8, 2), (32, 64, 8, 3), (64, 64, 8, 3)),
    (80, 256, 2): ((64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 8, 2)),
    (80, 64, 4): ((64, 64, 4, 2), (16, 32, 4, 2), (32, 64, 4, 2)),
    (80, 128, 4): ((64, 32, 4, 2), (32, 32, 4, 2), (32, 32, 4, 2)),
    (80, 256, 4): ((32, 32, 4, 2), (16, 32, 4, 2), (16, 32, 4, 2)),
}
# kernels that need other tiles for dropout (Philox's registers) or a head dim below its power-of-two block
# (masked head loads, no TMA): {kernel index: config}, dropout's first
_VARIANTS = {
    (90, 64, 2, "dropout"): {1: (32, 128, 8, 2)},
    (90, 128, 2, "dropout"): {0: (128, 64, 8, 2), 1: (16, 128, 8, 2), 2: (128, 32, 8, 2)},
    (90, 128, 2, "pad"): {1: (16, 128, 8, 2)},
    (80, 64, 2, "dropout"): {1: (16, 64, 4, 3), 2: (128, 32, 8, 3)},
    (80, 128, 2, "dropout"): {0: (128, 32, 8, 2)},
    (80, 128, 2, "pad"): {0: (128, 32, 8, 3)},
}
KERNELS = ("flash_attention.fwd", "flash_attention.dkdv", "flash_attention.dq")  # kernels/tuned.py's names
MAX_HEAD_DIM = 256


def arch(t):
    """Compute capability as 90 / 80 / ...; for meta tensors the target Triton builds for; 0 in the interpreter."""
    if t.is_cuda:
        major, minor = torch.cuda.get_device_capability(t.device)
        return 10 * major + minor
    if INTERPRET:
        return 0
    try:  # a build without a GPU (tests/kernels/gpu_compile.py): the target its driver reports
        return int(triton.runtime.driver.active.get_current_target().arch)
    except Exception:
        return 0


def default(cc, bd, dtype, kernel, dropout=False, pad=False):
    """The built-in (BLOCK_M, BLOCK_N, warps, stages) of one kernel on compute capability cc."""
    key = (90 if cc >= 90 else 80, max(64, bd), 4 if dtype == torch.float32 else 2)
    for tag, on in (("dropout", dropout), ("pad", pad)):
        if on and kernel in _VARIANTS.get(key + (tag,), {}):
            return _VARIANTS[key + (tag,)][kernel]
    return _CONFIGS[key][kernel]


def launch_config(t, kernel, dropout=False):
    """(BLOCK_M, BLOCK_N, warps, stages) of kernel 0 (fwd), 1 (dK/dV), 2 (dQ) for q-like tensor t: a tuned
    entry for this device where there is one (plain variant: no dropout, a power-of-two head dim), else the
    built-in table's."""
    d = t.shape[-1]
    bd = max(16, triton.next_power_of_2(d))
    bm, bn, warps, stages = default(arch(t), bd, t.dtype, kernel, dropout, d != bd)
    if dropout or d != bd:
        return bm, bn, warps, stages
    cfg = tuned.config(KERNELS[kernel], t.device, t.dtype, bd,
                       dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages))
    return cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]


# ---- the tuning space: Triton's tutorial 06 space, pruned for wgmma and shared memory -------------------------
# dK/dV's BLOCK_N is the key block (its products' M), BLOCK_M the query step: its space is read the other way.
PARAMS = (
    {"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)},
    {"BLOCK_M": (16, 32, 64), "BLOCK_N": (64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3)},
    {"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3)},
)
_SMEM = 232448  # bytes a block may ask for on sm_90


def valid(kernel):
    def valid(bucket, dtype, cfg):
        rows = cfg["BLOCK_N"] if kernel == 1 else cfg["BLOCK_M"]  # the products' M: 64 per warpgroup for wgmma
        streamed = cfg["BLOCK_M"] if kernel == 1 else cfg["BLOCK_N"]
        held = rows * bucket * (2 if kernel else 1)  # Q (fwd); K, V (dK/dV); Q, dO (dQ)
        smem = (held + cfg["num_stages"] * 2 * streamed * bucket) * dtype.itemsize
        return rows >= 64 * cfg["num_warps"] // 4 and smem <= _SMEM
    return valid


def default_for(kernel):
    def default_cfg(bucket, dtype):
        cc = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
        bm, bn, warps, stages = default(10 * cc[0] + cc[1], bucket, dtype, kernel)
        return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return default_cfg
