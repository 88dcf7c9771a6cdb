"""The GPT's GPU code path — every Triton kernel wired into the model — run on CPU by the
Triton interpreter, against the same model on the torch path: loss and every gradient.

On CUDA the model calls the kernels by default; this CPU suite cannot, so it forces the
Triton backend (TRITON_INTERPRET=1 is set by conftest) to check the wiring: shapes,
strides, GQA layout, rotary tables, the vocab-parallel CE protocol under TP.
"""

import pytest
import torch

import kernels
from dist_util import rel_err, run_on_ranks
from megalite import parallel_state as ps
from megalite.distributed import allreduce_sequence_parallel_grads
from megalite.models import GPTModel
from megalite.tensor_parallel import model_parallel_manual_seed
from model_util import batch, full_grads, tiny_config

SHAPES = dict(hidden_size=64, num_attention_heads=4, seq_length=16)  # head dim 16: a valid tl.dot block
FLAVOURS = {"gpt2": dict(SHAPES), "llama": dict(SHAPES, num_query_groups=2)}


def _run(tp, flavour, backend):
    ps.initialize_model_parallel(tp, 1)
    model_parallel_manual_seed(3)
    cfg = tiny_config(flavour, sequence_parallel=tp > 1, **FLAVOURS[flavour])
    model = GPTModel(cfg)
    ids, labels = batch(cfg)
    with kernels.use_backend(backend):
        loss = model(ids, labels=labels)
        loss.mean().backward()
    allreduce_sequence_parallel_grads(list(model.parameters()), model.grid)
    return loss.detach(), full_grads(model, cfg.vocab_size)


def _compare(tp, flavour):
    ref_loss, ref = _run(tp, flavour, "torch")
    ps.destroy_model_parallel()
    loss, grads = _run(tp, flavour, "triton")
    errs = {"loss": rel_err(loss, ref_loss)}
    errs.update({k: rel_err(grads[k], ref[k]) for k in ref})
    return errs


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_triton_path_matches_torch_path_single_rank(flavour):
    try:
        errs = _compare(1, flavour)
    finally:
        ps.destroy_model_parallel()
    bad = {k: v for k, v in errs.items() if not v <= 1e-5}
    assert not bad and len(errs) > 10, bad


def test_triton_path_matches_torch_path_tp2_sp():
    for rank, errs in enumerate(run_on_ranks(_compare, 2, 2, "llama")):
        bad = {k: v for k, v in errs.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"
