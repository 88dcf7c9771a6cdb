"""Start-up in O(shard): each TP rank generates only its own shard of every weight, and the
shards are exactly the slices of the TP=1 weight (rows for column-parallel layers, columns for
row-parallel ones, [gate; up] blocks for SwiGLU, padded vocabulary rows zero)."""
import pytest
import torch

from megalite.tensor_parallel import init as tp_init
from megalite.tensor_parallel.layers import shard_row_ranges


@pytest.fixture
def tiles(monkeypatch):
    """Counts the tiles generated."""
    count = [0]
    real = tp_init._generate_tile

    def counted(*a):
        count[0] += 1
        return real(*a)
    monkeypatch.setattr(tp_init, "_generate_tile", counted)
    return count


@pytest.mark.parametrize("rows,cols,chunks", [(1000, 300, 1), (1024, 520, 2), (96, 1000, 1)])
def test_column_shards_are_slices_of_the_full_weight(rows, cols, chunks):
    init = tp_init.init_normal(0.02)
    seed = int(torch.randint(0, 2 ** 62, ()))
    full = tp_init.init_master((rows, cols), init, seed)
    assert full.shape == (rows, cols) and full.std().item() == pytest.approx(0.02, rel=0.05)
    for tp in (2, 4, 8):
        if rows % (tp * chunks):
            continue
        parts = [tp_init.init_block((rows, cols), init, seed, shard_row_ranges(rows, tp, r, chunks), (0, cols))
                 for r in range(tp)]
        blocks = [torch.cat([p.chunk(chunks)[c] for p in parts]) for c in range(chunks)]
        assert torch.equal(torch.cat(blocks), full), f"TP={tp}: shards are not the full weight's slices"
        cparts = [tp_init.init_block((rows, cols), init, seed, [(0, rows)], (r * cols // tp, (r + 1) * cols // tp))
                  for r in range(tp)] if cols % tp == 0 else []
        if cparts:
            assert torch.equal(torch.cat(cparts, dim=1), full), f"TP={tp}: column shards differ"


def test_padding_rows_zero_and_independent_of_padded_size():
    seed, real = 123, 1000
    init = tp_init.init_normal(0.5, real_rows=real)
    a = tp_init.init_master((1008, 64), init, seed)
    b = tp_init.init_master((1024, 64), init, seed)  # the padding a larger TP gives
    assert torch.equal(a[:real], b[:real]) and (a[real:] == 0).all() and (b[real:] == 0).all()
    assert (a[:real] != 0).all()
    plain = tp_init.init_master((real, 64), tp_init.init_normal(0.5), seed)
    assert torch.equal(plain, a[:real]), "tied embedding (padded) and an unpadded weight must agree"


def test_work_scales_with_the_shard(tiles):
    init = tp_init.init_normal(0.02)
    shape = (4096, 2048)
    tp_init.init_master(shape, init, 7)
    full = tiles[0]
    tiles[0] = 0
    tp_init.init_block(shape, init, 7, shard_row_ranges(4096, 8, 3), (0, 2048))
    assert tiles[0] * 8 == full, (tiles[0], full)
    tiles[0] = 0
    tp_init.init_block(shape, init, 7, [(0, 4096)], (3 * 256, 4 * 256))
    assert tiles[0] * 8 == full, (tiles[0], full)


def test_custom_init_falls_back_to_the_full_weight():
    def init(t):
        return torch.nn.init.uniform_(t, -1, 1)
    full = tp_init.init_master((64, 48), init, 5)
    part = tp_init.init_block((64, 48), init, 5, [(16, 32)], (8, 40))
    assert torch.equal(part, full[16:32, 8:40])
