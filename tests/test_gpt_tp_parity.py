"""TP (with and without sequence parallelism) computes the same function as TP=1."""

import pytest
import torch

from dist_util import rel_err, run_on_ranks
from megalite import parallel_state as ps
from megalite.distributed import allreduce_sequence_parallel_grads
from megalite.models import GPTModel
from megalite.optimizer.clip_grads import get_grad_norm
from megalite.tensor_parallel import gather_from_tensor_model_parallel_region, model_parallel_manual_seed
from model_util import batch, full_grads, tiny_config

TOL = 1e-5


def _run(tp, flavour, sp):
    ps.initialize_model_parallel(tp, 1)
    model_parallel_manual_seed(123)
    cfg = tiny_config(flavour, sequence_parallel=sp)
    model = GPTModel(cfg)
    ids, labels = batch(cfg)
    logits = gather_from_tensor_model_parallel_region(model(ids))[..., :cfg.vocab_size].detach()
    loss = model(ids, labels=labels)
    loss.mean().backward()
    params = list(model.parameters())
    allreduce_sequence_parallel_grads(params)
    grads = full_grads(model, cfg.vocab_size)
    grads["(global grad norm)"] = torch.tensor([get_grad_norm(params, [p.grad for p in params])])
    return logits, loss.detach(), grads


def _compare(tp, flavour, sp, ref):
    logits, loss, grads = _run(tp, flavour, sp)
    r_logits, r_loss, r_grads = ref
    errs = {"logits": rel_err(logits, r_logits), "loss": rel_err(loss, r_loss)}
    assert grads.keys() == r_grads.keys()
    for k in grads:
        assert grads[k].shape == r_grads[k].shape, k
        errs[k] = rel_err(grads[k], r_grads[k])
    return errs


@pytest.fixture(scope="module")
def references():
    refs = {}
    for flavour in ("gpt2", "llama"):
        refs[flavour] = _run(1, flavour, False)
        ps.destroy_model_parallel()
    return refs


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_tp_matches_single_process(references, flavour, tp, sp):
    errs_per_rank = run_on_ranks(_compare, tp, tp, flavour, sp, references[flavour])
    for errs in errs_per_rank:
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"TP={tp} SP={sp} {flavour}: relative errors above {TOL}: {bad}"
        assert len(errs) > 10  # logits, loss and every parameter were compared
