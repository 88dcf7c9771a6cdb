"""The grid as a value (DESIGN.md, "Process-group grid"): model code is handed its layout
(parallel_state.Grid) and never reads the global one, so one process can hold models of different
parallelism side by side (a planner builds many layouts on the meta device; a replica or a re-cut
pipeline a second layout). Every test here runs with no global grid at all: a read of it raises."""

import re
from pathlib import Path

import pytest
import torch

from megalite import parallel_state as ps
from megalite.parallel.global_grid import set_global_grid
from megalite.cli.parser import model_config, parse_args
from megalite.models.gpt import GPTModel
from megalite.tensor_parallel import model_parallel_manual_seed

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--vocab-size", "200", "--train-iters", "1", "--lr", "1e-3", "--hidden-dropout", "0",
        "--attention-dropout", "0"]
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--disable-bias-linear", "--moe-ffn-hidden-size", "32"]


@pytest.fixture
def no_global_grid():
    saved = set_global_grid(None)
    try:
        yield
    finally:
        set_global_grid(saved)


def config(*extra):
    args = parse_args(BASE + list(extra), world_size=1)
    return model_config(args, args.vocab_size)


def build(cfg, grid, pre=True, post=True):
    with ps.meta_init():
        return GPTModel(cfg, pre_process=pre, post_process=post, grid=grid)


def shapes(model):
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_two_layouts_side_by_side_have_their_shapes(no_global_grid):
    """A TP2 x PP2 last stage and a TP4 x EP2 MoE model (TP rank 3: expert rank 1) in one process, on meta."""
    dense = build(config(), ps.Grid.of(tp=2, pp=2, dp=2, pp_rank=1, tp_rank=1), pre=False)
    moe = build(config(*MOE), ps.Grid.of(tp=4, dp=2, ep=2, etp=1, tp_rank=3))
    a, b = shapes(dense), shapes(moe)
    assert sorted({n.split(".")[2] for n in a if n.startswith("decoder.layers.")}) == ["2", "3"]  # PP2 stage 1
    assert "embedding.word_embeddings.weight" not in a and a["output_layer.weight"] == (128, 64)  # 256 / TP2
    assert a["decoder.layers.2.self_attention.linear_qkv.weight"] == (3 * 64 // 2, 64)
    assert a["decoder.layers.2.self_attention.linear_proj.weight"] == (64, 32)
    assert a["decoder.layers.3.mlp.linear_fc1.weight"] == (4 * 64 // 2, 64)
    assert sorted({n.split(".")[2] for n in b if n.startswith("decoder.layers.")}) == ["0", "1", "2", "3"]
    assert b["embedding.word_embeddings.weight"] == (512 // 4, 64)  # vocabulary padded to 128 x TP4
    assert b["decoder.layers.0.self_attention.linear_qkv.weight"] == (3 * 64 // 4, 64)
    experts = sorted({int(n.split(".")[6]) for n in b if ".local_experts." in n})
    assert experts == [4, 5, 6, 7]  # EP rank 1 of 2: the second half, named by global index
    assert b["decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight"] == (32, 64)  # expert-TP 1: whole
    assert b["decoder.layers.0.mlp.router.weight"] == (8, 64)
    assert all(p.is_meta for m in (dense, moe) for p in m.parameters())


def test_a_model_trains_on_its_own_grid_without_the_global_one(no_global_grid):
    """Forward and backward through dense and MoE layers, loss included, on an explicit one-process grid."""
    grid = ps.Grid.of()
    model_parallel_manual_seed(0, grid)
    for extra in ((), MOE):
        model = GPTModel(config(*extra), grid=grid)
        ids = torch.randint(0, 200, (2, 32))
        loss = model(ids, labels=torch.roll(ids, -1, 1)).mean()
        loss.backward()
        assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_grid_reaches_every_layer(no_global_grid):
    """Without a grid, building a model reads the global one, which is absent here: the default path is the
    only one that can reach it."""
    with pytest.raises(RuntimeError, match="not initialised"):
        GPTModel(config())


MODEL_CODE = ("transformer", "models", "moe", "tensor_parallel")
# the accessors of the global grid (parallel_state's get_* / is_* functions); current_grid(grid) is the one
# default a module may resolve when it is not handed a grid, and the device is not part of the grid
GLOBAL_READ = re.compile(r"\bps\.(get_(?!device\b)\w+|is_pipeline_\w+|global_rank|_grid)\(")


def test_model_code_does_not_read_the_global_grid():
    root = Path(ps.__file__).parent
    reads = [f"{f.relative_to(root)}:{i}: {line.strip()}" for d in MODEL_CODE for f in sorted((root / d).rglob("*.py"))
             for i, line in enumerate(f.read_text().splitlines(), 1) if GLOBAL_READ.search(line)]
    assert not reads, "model code reads the global grid:\n" + "\n".join(reads)


def test_a_copied_model_shares_its_grid(no_global_grid):
    """deepcopy (an EMA copy, a reference model) shares the grid, whose process groups cannot be copied (a
    stand-in plays one here)."""
    import copy
    grid = ps.Grid.of(tp=1)
    grid.tp_group = torch.distributed.ProcessGroup.__new__(torch.distributed.ProcessGroup)
    with ps.meta_init():
        model = GPTModel(config(), grid=grid)
    twin = copy.deepcopy(model)
    assert twin.grid is grid and twin.decoder.layers["0"].self_attention.linear_qkv.grid is grid


def test_the_runs_grid_is_a_value():
    """The grid parallel_state builds cannot be changed by what it is handed to (only the virtual-pipeline rank,
    Megatron's accessor, moves)."""
    ps.initialize_model_parallel(1, 1)
    try:
        grid = ps.current_grid()
        with pytest.raises(AttributeError, match="Grid.tp cannot change"):
            grid.tp = 2
        ps.set_virtual_pipeline_model_parallel_rank(0)
        assert grid.tp == 1
    finally:
        ps.destroy_model_parallel()
