"""Pipeline parallelism: same losses and same gradients as PP=1; 1F1B order and memory bound."""

import pytest
import torch

import pretrain_gpt
from dist_util import rel_err, run_on_ranks
from megalite import parallel_state as ps
from megalite.arguments import parse_args
from megalite.pipeline import schedules
from megalite.training import pretrain
from model_util import gather_full

# lr 1e-4: Adam turns last-bit differences in near-zero gradient elements (reduction order
# differs between layouts) into parameter differences of order lr; a small lr keeps the
# 5-step comparison a test of the pipeline, not of that amplification.
BASE = ("--mock-data --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 1 --global-batch-size 8 --train-iters 5 --log-interval 1 --vocab-size 250 "
        "--make-vocab-size-divisible-by 8 --hidden-dropout 0 --attention-dropout 0 --lr 1e-4").split()


def _train(argv, world_size):
    """Train; return losses, {global param name: full grad} from DP rank 0, and schedule records."""
    args = parse_args(argv, world_size=world_size)
    try:
        losses, chunks, _ = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                     pretrain_gpt.forward_step, args, return_state=True)
        grads = {}
        for c in chunks:
            for name, p in c.module.named_parameters():
                full = gather_full(p, p.main_grad)
                if "word_embeddings" in name or "output_layer" in name:
                    full = full[:250]
                grads[name] = full
        if ps.get_data_parallel_rank() != 0:
            grads = {}
        return losses, grads, ps.get_pipeline_model_parallel_rank(), list(schedules.last_run["ops"]), \
            schedules.last_run["max_alive"]
    finally:
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def reference():
    losses, grads, *_ = _train(BASE, 1)
    return losses, grads


def _check(reference, results, label):
    ref_losses, ref_grads = reference
    merged = {}
    for losses, grads, *_ in results:
        errs = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
        assert len(losses) == 5 and max(errs) <= 1e-5, f"{label}: losses {losses} vs {ref_losses}"
        for k, g in grads.items():
            if k in merged:  # the last stage's tied output copy: its grad equals the embedding's
                assert rel_err(g, merged[k]) <= 1e-5, f"{label}: two copies of {k} differ"
            merged[k if k != "output_layer.weight" or k in ref_grads else "embedding.word_embeddings.weight"] = g
    assert merged.keys() == ref_grads.keys(), f"{label}: {sorted(set(merged) ^ set(ref_grads))}"
    bad = {k: rel_err(merged[k], ref_grads[k]) for k in ref_grads if not rel_err(merged[k], ref_grads[k]) <= 1e-5}
    assert not bad, f"{label}: gradients differ from PP=1: {bad}"


CONFIGS = {
    "pp2_1f1b": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp4_1f1b": (4, ["--pipeline-model-parallel-size", "4"]),
    "pp2_interleaved_v2": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    "pp2_uneven_1_3": (2, ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"]),
    "tp2_pp2_dp2_sp": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                           "--sequence-parallel"]),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pipeline_matches_single_stage(reference, name):
    n, extra = CONFIGS[name]
    results = run_on_ranks(_train, n, BASE + extra, n, timeout=300)
    _check(reference, results, name)
    if "interleaved" not in name:
        pp = int(extra[extra.index("--pipeline-model-parallel-size") + 1])
        m = 8 // (n // pp // (2 if "--tensor-model-parallel-size" in extra else 1))
        for *_, stage, ops, max_alive in results:
            assert ops == one_f_one_b(pp, stage, m), f"{name} stage {stage}: {ops}"
            assert max_alive <= pp - stage, f"{name} stage {stage}: {max_alive} micro-batches alive at once"
            assert max_alive == min(pp - stage, m)  # and it does use the pipeline depth


def one_f_one_b(pp, stage, m):
    """The 1F1B definition: warm-up forwards, steady F/B pairs, cool-down backwards."""
    w = min(pp - stage - 1, m)
    ops = [("F", 0, i) for i in range(w)]
    for i in range(m - w):
        ops += [("F", 0, w + i), ("B", 0, i)]
    return ops + [("B", 0, i) for i in range(m - w, m)]


def test_one_f_one_b_definition_is_not_gpipe():
    # Guard the reference itself: stage 0 of 4 with 8 micro-batches interleaves early.
    ops = one_f_one_b(4, 0, 8)
    assert ops[:4] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 0, 3)] and ops[4] == ("B", 0, 0)
