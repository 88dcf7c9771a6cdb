"""Weight initialisation that is independent of TP and costs O(shard) per rank.

A weight W of shape [R, C] with an `init_normal(std, real_rows)` method and a seed is defined
tile by tile: tile (i, j) covers rows [i*T, (i+1)*T) and columns [j*T, (j+1)*T) (T = TILE) and
holds N(0, std) numbers drawn, as a full T x T block, from a generator seeded with
mix(seed, i, j) (splitmix64); rows >= real_rows (vocabulary padding) are zero. A rank builds
only the tiles its shard touches (rows for column-parallel layers, columns for row-parallel
ones), on its own device, so start-up time and memory scale with the shard, and the result
is exactly the TP=1 weight's slice whatever TP is (and whatever the padded size is: a tile's
numbers depend on its position only). The numbers depend on the generator's device type
(CPU and CUDA Philox streams differ), not on the topology.
Any other init method (a plain callable) falls back to building the full weight from the
seed with the global RNG, then slicing it (O(full) per rank, still TP-independent).

Every parameter also records its recipe (`init_recipe`: any flat range of its local tensor,
on demand), so a model built on the meta device (ZeRO-3) materialises only the ranges a rank
keeps: O(shard) per rank, the same values as the eager build.
"""

import zlib

import torch
from torch import nn

TILE = 256
_M64 = (1 << 64) - 1


def param_seed(seed, name):
    """A stable per-parameter init seed: the same weight whatever the topology."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def init_normal(std, real_rows=None):
    """N(0, std) init; with real_rows, rows from real_rows on are zero (vocab padding).

    Called on a tensor it fills it from the global RNG; the layers read .std/.real_rows to
    build only their shard (see the module docstring)."""
    def init_(t):
        if real_rows is None:
            return nn.init.normal_(t, mean=0.0, std=std)
        t.zero_()
        nn.init.normal_(t[:real_rows], mean=0.0, std=std)
        return t
    init_.std, init_.real_rows = std, real_rows
    return init_


def _splitmix(z):
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def tile_seed(seed, i, j):
    return _splitmix(_splitmix(_splitmix(seed & _M64) ^ i) ^ j) & ((1 << 63) - 1)


def _generate_tile(buf, gen, seed, i, j, std):
    gen.manual_seed(tile_seed(seed, i, j))
    return buf.normal_(0.0, std, generator=gen)


def init_master(shape, init_method, seed, device="cpu"):
    """The full weight (replicated parameters; tests): the block of every row and column."""
    return init_block(shape, init_method, seed, [(0, shape[0])], (0, shape[1]), device)


def init_block(shape, init_method, seed, row_ranges, col_range, device="cpu"):
    """fp32 W[rows, c0:c1] of the full weight W (`shape`) that (init_method, seed) define, the
    row ranges [(a, b), ...] concatenated; generated tile by tile when the method allows it."""
    c0, c1 = col_range
    if torch.device(device).type == "meta":  # shapes only (placement checks, deferred init)
        return torch.empty(sum(b - a for a, b in row_ranges), c1 - c0, dtype=torch.float32, device=device)
    std = getattr(init_method, "std", None)
    if seed is None or std is None:
        full = torch.empty(shape, dtype=torch.float32)
        if seed is None:
            init_method(full)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                init_method(full)
        return torch.cat([full[a:b, c0:c1] for a, b in row_ranges]).to(device)
    if torch.device(device).type != "cpu":
        return _tiles(shape, std, getattr(init_method, "real_rows", None), seed, row_ranges, col_range, device)
    # Many small ops: on CPU one intra-op thread is faster than a parallel region per tile, and
    # far faster when cores are oversubscribed (each region waits for its second thread).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _tiles(shape, std, getattr(init_method, "real_rows", None), seed, row_ranges, col_range, device)
    finally:
        torch.set_num_threads(threads)


def _tiles(shape, std, real, seed, row_ranges, col_range, device):
    c0, c1 = col_range
    out = torch.empty(sum(b - a for a, b in row_ranges), c1 - c0, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device)
    buf = torch.empty(TILE, TILE, dtype=torch.float32, device=device)
    strip = torch.empty(TILE, c1 - c0, dtype=torch.float32, device=device)  # one tile row, reused:
    o = 0  # tiles land in warm memory and `out` is written row-contiguously
    for a, b in row_ranges:
        if real is not None:  # padding rows: zero, never generated
            out[o + max(real, a) - a:o + b - a].zero_()
            b_gen = min(b, max(real, a))
        else:
            b_gen = b
        for i in range(a // TILE, -(-b_gen // TILE)):
            r0, r1 = max(a, i * TILE), min(b_gen, (i + 1) * TILE)
            for j in range(c0 // TILE, -(-c1 // TILE)):
                q0, q1 = max(c0, j * TILE), min(c1, (j + 1) * TILE)
                tile = _generate_tile(buf, gen, seed, i, j, std)
                strip[:, q0 - c0:q1 - c0].copy_(tile[:, q0 - j * TILE:q1 - j * TILE])  # (copy_: slice
            out[o + r0 - a:o + r1 - a].copy_(strip[r0 - i * TILE:r1 - i * TILE])  # assignment is ~100x slower)
        o += b - a
    return out


class BlockRecipe:
    """Flat elements [start, end) of the local tensor W[rows, c0:c1] (init_block's arguments):
    the local rows covering the range are generated, then cut (O(range + 2 rows))."""

    def __init__(self, shape, init_method, seed, row_ranges, col_range, on_cpu=False):
        """on_cpu: generated on the CPU then moved, as replicated weights are (init_master)."""
        self.shape, self.init_method, self.seed = shape, init_method, seed
        self.row_ranges, self.col_range, self.on_cpu = row_ranges, col_range, on_cpu

    def __call__(self, start, end, device):
        width = self.col_range[1] - self.col_range[0]
        i0, i1 = start // width, -(-end // width)
        ranges, base = [], 0
        for a, b in self.row_ranges:  # local rows [i0, i1) -> rows of the full weight
            lo, hi = max(i0, base), min(i1, base + b - a)
            if hi > lo:
                ranges.append((a + lo - base, a + hi - base))
            base += b - a
        block = init_block(self.shape, self.init_method, self.seed, ranges, self.col_range,
                           "cpu" if self.on_cpu else device).reshape(-1)
        return block[start - i0 * width:end - i0 * width].to(device)


class ConstantRecipe:
    def __init__(self, value):
        self.value = value

    def __call__(self, start, end, device):
        return torch.full((end - start,), float(self.value), dtype=torch.float32, device=device)


def replicated_init(shape, init_method, seed, device):
    """A replicated weight's full initial value (generated on the CPU, as init_master), or an
    empty meta tensor when the model is built on the meta device; and its recipe."""
    recipe = BlockRecipe(shape, init_method, seed, [(0, shape[0])], (0, shape[1]), on_cpu=True)
    meta = torch.device(device).type == "meta"
    return init_master(shape, init_method, seed, "meta" if meta else "cpu"), recipe


def with_recipe(param, recipe):
    param.init_recipe = recipe
    return param


def materialize(param, start, end, device):
    """fp32 flat elements [start, end) of `param`'s initial local value, from its recipe."""
    recipe = getattr(param, "init_recipe", None)
    if recipe is None:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} was built on the meta device without an "
                         "init_recipe (megalite.tensor_parallel.init.with_recipe): ZeRO-3 cannot initialise it")
    return recipe(start, end, device)
