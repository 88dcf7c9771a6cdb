"""LayerNorm / RMSNorm over the last dim: Triton fwd+bwd with fp32 statistics (kernels: norm_kernels.py).

Forward and backward are persistent kernels (a few programs per SM) whose row-tile loops are software-
pipelined, so the next tiles' loads are in flight while this tile is stored. Forward saves fp32 mean/rstd.
Backward writes dx and keeps fp32 partial dW/dB per program; the partials [programs, N] are summed over
programs (two-stage, no atomics). Rows longer than the fused block are processed in chunks.

Launch configurations (rows per tile, warps, stages, programs per SM) come from kernels/tuned.py: the
committed table for this device, else the defaults below. `SPACES` is what benchmarks/tune_kernels.py
searches; `forward_launch` / `backward_launch` run the kernels with an explicit configuration.
"""
import torch
import torch.nn.functional as F
import triton

from . import tuned
from ._dispatch import empty, empty_like, num_warps, use_triton
from .norm_kernels import _norm_bwd, _norm_bwd_chunked, _norm_fwd

# Largest row (in elements) kept whole in registers; longer rows are chunked.
# Tests lower these to exercise the chunked path under the interpreter.
FWD_FUSED_BYTES = 65536
BWD_FUSED_ELEMS = 8192  # x, dy, w, dW, dB of a whole row in registers: 16384 spills on sm_80/sm_90
# even with 32 warps (tests/kernels/gpu_compile.py); longer rows take the chunked path
BWD_CHUNK_ELEMS = 4096  # the chunked backward's step: its two pipelined passes stage x, dy, w and the partials
# in shared memory, 229 KB at 8192 (past sm_80's 163 KB)
TILE_ELEMS = 4096  # default tile: rows of a small hidden size are stacked up to this many elements
INTERPRET_PROGRAMS = 3  # programs off a GPU (interpreter, meta): several, and not dividing the test's row counts
SMEM_BUDGET = 160 * 1024  # pipeline buffers per program, bytes: below sm_80's 163 KB and sm_90's 227 KB


def _sm_count(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return None


def _blocks(n, es, backward):
    """(BLOCK, one pass?) for rows of n elements of es bytes."""
    cap = BWD_FUSED_ELEMS if backward else FWD_FUSED_BYTES // es
    block = min(triton.next_power_of_2(n), cap)
    if backward and block < n:
        return min(block, BWD_CHUNK_ELEMS), False
    return block, block >= n


def _hoist(rows, block, warps):
    """Does the forward keep w and b in registers across tiles? Not past 16 fp32 a thread (wide rows spill)."""
    return rows * block <= 16 * 32 * warps


def _stage_bytes(bucket, dtype, cfg, backward):
    """Shared memory one pipeline stage holds (the pipeliner keeps num_stages - 1 of them in flight)."""
    es = dtype.itemsize
    block, one_pass = _blocks(bucket, es, backward)
    tile = cfg["ROWS"] * block
    if not backward:  # x, and w and b when reloaded per tile (the pipeliner stages them too)
        return tile * es + (0 if _hoist(cfg["ROWS"], block, cfg["num_warps"]) else 2 * block * es)
    return 2 * tile * es if one_pass else block * (3 * es + 2 * 4)  # x, dy (, w and the fp32 partials)


def default_config(bucket, dtype, backward):
    """The built-in configuration for a power-of-two hidden-size bucket (the table overrides it)."""
    es = dtype.itemsize
    block, one_pass = _blocks(bucket, es, backward)
    rows = max(1, TILE_ELEMS // block) if one_pass else 1
    # the chunked backward at 16 warps: ptxas caps it at 64 registers and spills (sm_80); 8 warps do not
    warps = num_warps(rows * block) if one_pass else 8
    # two forward programs an SM where both fit (about 50 registers a thread at 16 warps: up to 8 fp32 each)
    per_sm = 1 if backward or rows * block > 4096 else 2
    cfg = {"ROWS": rows, "num_warps": warps, "num_stages": 3, "PROGRAMS_PER_SM": per_sm}
    if not backward and not _hoist(rows, block, warps):
        # wide rows: one row a program is bytes enough in flight, and pipelining would stage w and b as well
        return {**cfg, "num_stages": 1, "PROGRAMS_PER_SM": 0}
    if 2 * _stage_bytes(bucket, dtype, cfg, backward) > 96 * 1024:
        cfg["num_stages"] = 2
    return cfg


def _valid(backward):
    def valid(bucket, dtype, cfg):
        es = dtype.itemsize
        block, one_pass = _blocks(bucket, es, backward)
        if cfg["ROWS"] != 1 and (not one_pass or cfg["ROWS"] * block > 2 * TILE_ELEMS):
            return False
        # elements of a tensor a thread holds: at least one 16-byte access, at most 16 fp32 (more spills)
        per_thread = cfg["ROWS"] * block // (32 * cfg["num_warps"])
        if (one_pass or backward) and not 16 // es <= per_thread <= 16:
            return False
        # one tile a program (PROGRAMS_PER_SM 0) has nothing to pipeline; a persistent loop needs it
        if (cfg["PROGRAMS_PER_SM"] == 0) != (cfg["num_stages"] == 1):
            return False
        return (cfg["num_stages"] - 1) * _stage_bytes(bucket, dtype, cfg, backward) <= SMEM_BUDGET
    return valid


def _grid(device, tiles, cfg):
    """Persistent: PROGRAMS_PER_SM programs per SM (0: one program per tile), never more than the tiles."""
    sms = _sm_count(device)
    per_sm = cfg["PROGRAMS_PER_SM"]
    g = INTERPRET_PROGRAMS if sms is None else (sms * per_sm if per_sm else tiles)
    return max(1, min(g, tiles))


def _options(cfg):
    """Launch options. A persistent program tells ptxas the registers it may take (.maxnreg): left to choose, ptxas
    (Triton 3.6) gave the 16-warp backward 64 registers, as if for two programs an SM, and spilled."""
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    if cfg["PROGRAMS_PER_SM"]:
        opts["maxnreg"] = min(255, 65536 // (32 * cfg["num_warps"] * cfg["PROGRAMS_PER_SM"])) // 8 * 8
    return opts


def forward_launch(x2, weight, bias, eps, is_rms, cfg):
    """y, mean, rstd of x2 [m, n] with an explicit configuration."""
    m, n = x2.shape
    y = empty_like(x2)
    mean = empty(m, x2.device, torch.float32)
    rstd = empty(m, x2.device, torch.float32)
    block, one_pass = _blocks(n, x2.element_size(), backward=False)
    rows = cfg["ROWS"] if one_pass else 1
    if m > 0:
        _norm_fwd[(_grid(x2.device, triton.cdiv(m, rows), cfg),)](
            x2, weight, bias if bias is not None else weight, y, mean, rstd, m, n, eps,
            IS_RMS=is_rms, HAS_BIAS=bias is not None, BLOCK=block, ROWS=rows, ONE_PASS=one_pass,
            STAGES=cfg["num_stages"], HOIST=_hoist(rows, block, cfg["num_warps"]), **_options(cfg))
    return y, mean, rstd


def backward_launch(x2, weight, bias, dy, mean, rstd, is_rms, cfg):
    """dx, dW, dB (None without a bias) with an explicit configuration."""
    m, n = x2.shape
    dx = empty_like(x2)
    block, one_pass = _blocks(n, x2.element_size(), backward=True)
    rows = cfg["ROWS"] if one_pass else 1
    g = _grid(x2.device, triton.cdiv(m, rows), cfg)  # never more programs than tiles: each writes a partial
    dw_part = empty((g, n), x2.device, torch.float32)  # every program writes its whole row: no zeroing
    db_part = empty((g, n), x2.device, torch.float32) if bias is not None else dw_part
    if m > 0:
        args = (x2, weight, dy, dx, mean, rstd, dw_part, db_part, m, n)
        meta = dict(IS_RMS=is_rms, HAS_BIAS=bias is not None, BLOCK=block, STAGES=cfg["num_stages"], **_options(cfg))
        if one_pass:
            _norm_bwd[(g,)](*args, ROWS=rows, **meta)
        else:
            _norm_bwd_chunked[(g,)](*args, **meta)
    else:
        dw_part.zero_()
        db_part.zero_()
    dw = dw_part.sum(0).to(weight.dtype)
    db = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dw, db


def _kernel(is_rms, backward):
    return ("rms_norm" if is_rms else "layer_norm") + (".bwd" if backward else ".fwd")


def launch_config(x2, is_rms, backward):
    bucket = triton.next_power_of_2(x2.shape[1])
    return tuned.config(_kernel(is_rms, backward), x2.device, x2.dtype, bucket,
                        default_config(bucket, x2.dtype, backward))


def backward_programs(x2, is_rms):
    """Programs (so partial dW rows) the backward launches for x2 [m, n]: what a byte count needs."""
    cfg = launch_config(x2, is_rms, True)
    block, one_pass = _blocks(x2.shape[1], x2.element_size(), backward=True)
    return _grid(x2.device, triton.cdiv(x2.shape[0], cfg["ROWS"] if one_pass else 1), cfg)


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms):
        shape, n = x.shape, x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()  # strided inputs: copied once, explicitly
        y, mean, rstd = forward_launch(x2, weight, bias, eps, is_rms, launch_config(x2, is_rms, False))
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.is_rms, ctx.shape = is_rms, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        dy = dy.reshape(-1, x2.shape[1]).contiguous()
        dx, dw, db = backward_launch(x2, weight, bias, dy, mean, rstd, ctx.is_rms,
                                     launch_config(x2, ctx.is_rms, True))
        return dx.view(ctx.shape), dw, db, None, None


def layer_norm(x, weight, bias, eps=1e-5):
    """LayerNorm over the last dim of x; weight [N]; bias [N] or None. Output dtype = x.dtype."""
    if use_triton(x, weight, bias, kernel="layer_norm"):
        return _NormFn.apply(x, weight, bias, eps, False)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# ---- the tuning space (kernels/tuned.py; benchmarks/tune_kernels.py searches it) -----------------------------
BUCKETS = (1024, 2048, 4096, 8192)
PARAMS = {  # by backward?; stages 1 only with one tile a program (PROGRAMS_PER_SM 0), see _valid
    False: {"ROWS": (1, 2, 4, 8), "num_warps": (4, 8, 16), "num_stages": (1, 2, 3), "PROGRAMS_PER_SM": (0, 1, 2)},
    True: {"ROWS": (1, 2, 4, 8), "num_warps": (4, 8, 16), "num_stages": (2, 3, 4), "PROGRAMS_PER_SM": (1,)}}


def _make(is_rms, backward):
    def make(bucket, dtype, device, small=False):
        n = 768 if bucket == 1024 else bucket  # GPT-2 / BERT's 768 (a masked tail); the others as Llama's
        m = 7 if small else max(1, (1 << 25) // bucket)  # 32M elements: 64 MB a tensor in bf16, past any L2
        x2 = torch.randn(m, n, device=device, dtype=dtype)
        w = torch.randn(n, device=device, dtype=dtype)
        b = None if is_rms else torch.randn(n, device=device, dtype=dtype)
        if not backward:
            return lambda cfg: forward_launch(x2, w, b, 1e-5, is_rms, cfg)
        _, mean, rstd = forward_launch(x2, w, b, 1e-5, is_rms, default_config(bucket, dtype, False))
        dy = torch.randn_like(x2)
        return lambda cfg: backward_launch(x2, w, b, dy, mean, rstd, is_rms, cfg)
    return make


SPACES = tuple(tuned.register(tuned.Space(
    kernel=_kernel(is_rms, bwd), params=PARAMS[bwd], buckets=BUCKETS, make=_make(is_rms, bwd), valid=_valid(bwd),
    default=lambda bucket, dtype, bwd=bwd: default_config(bucket, dtype, bwd)))
    for is_rms in (False, True) for bwd in (False, True))
