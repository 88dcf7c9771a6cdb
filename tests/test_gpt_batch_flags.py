"""Megatron's batch flags for packed documents: --eod-mask-loss, --reset-position-ids,
--reset-attention-mask, and --calculate-per-token-loss: the masks equal megatron-core's, a
document sees only itself, and TP/SP/PP/DP layouts match one process (tests/parity.py)."""

import itertools

import numpy as np
import pytest
import torch

from megalite import parallel_state as ps
from megalite.data.gpt_batch import GPTBatchDataset, ltor_masks_and_position_ids
from parity import ALPHABET, VOCAB, assert_parity, check_reference, layout, reference, run_layouts

EOD = VOCAB - 1  # outside the chain's alphabet
DOC_FLAGS = ("--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask")


class DocChainDataset(torch.utils.data.Dataset):
    """Packed documents: bigram chains (as tests/parity.py's) cut by EODs at random places."""

    def __init__(self, n, seq, seed):
        self.n, self.seq, self.seed = n, seq, seed
        self.perm = np.random.default_rng(seed).permutation(ALPHABET)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng([self.seed, int(i)])
        x, t = np.empty(self.seq + 1, dtype=np.int64), int(rng.integers(ALPHABET))
        for j in range(self.seq + 1):
            if j and rng.random() < 0.2:
                x[j], t = EOD, int(rng.integers(ALPHABET))  # a document ends; the next starts anywhere
            else:
                x[j], t = t, int(self.perm[t])
        return {"text": x}


def doc_datasets(args, num_samples):
    ds = DocChainDataset(num_samples[0], args.seq_length, args.seed)
    return (GPTBatchDataset(ds, EOD, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss),
            None, None)


def test_masks_equal_megatron_cores():
    mcore = pytest.importorskip("megatron.core.datasets.gpt_dataset", reason="megatron-core (the [test] extra)")
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        s = int(torch.randint(1, 40, (1,), generator=g))
        t = torch.randint(0, 5, (s,), generator=g)  # EOD = 0: frequent, adjacent, first and last
        for flags in itertools.product([False, True], repeat=3):
            am, lm, pos = mcore._get_ltor_masks_and_position_ids(t, 0, *flags, True)
            mask, loss_mask, position_ids = ltor_masks_and_position_ids(t, 0, *flags)
            if mask is None:  # only causal: the model's own mask
                mask = ~torch.tril(torch.ones(s, s, dtype=torch.bool))[None]
            assert torch.equal(mask, am) and torch.equal(loss_mask, lm) and torch.equal(position_ids, pos), (t, flags)


def test_a_document_sees_only_itself():
    """With --reset-attention-mask --reset-position-ids, the logits of the second document do
    not change when the first is rewritten, and equal the second document run alone."""
    from megalite.arguments import model_config, parse_args
    from megalite.models import GPTModel
    from parity import BASE
    from megalite.tensor_parallel import model_parallel_manual_seed
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(1234)
    try:
        args = parse_args(list(BASE) + list(DOC_FLAGS), world_size=1)
        model = GPTModel(model_config(args, VOCAB)).eval()
        a, b = [3, 7, 1, EOD], [5, 9, 2, 8, 4]

        def logits(tokens):
            mask, _, pos = ltor_masks_and_position_ids(torch.tensor(tokens), EOD, True, True, False)
            return model(torch.tensor([tokens]), position_ids=pos[None], attention_mask=None if mask is None
                         else mask[None])[0]
        with torch.no_grad():
            packed = logits(a + b)[len(a):]
            rewritten = logits([11, 12, 13, EOD] + b)[len(a):]
            alone = logits(b)
        torch.testing.assert_close(packed, rewritten, rtol=0, atol=0)
        torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    finally:
        ps.destroy_model_parallel()


def test_per_token_loss_is_batch_wide():
    """Two micro-batches with 3 and 1 counted tokens: the loss is (s1 + s2) / 4, not the mean of
    the two micro-batch means."""
    from megalite.evaluation import mean_losses
    ps.initialize_model_parallel(1, 1)
    try:
        lm, means = mean_losses([{"lm loss": torch.tensor([6.0, 3.0])}, {"lm loss": torch.tensor([4.0, 1.0])}])
    finally:
        ps.destroy_model_parallel()
    assert lm == pytest.approx(2.5) and float(means["lm loss"]) == pytest.approx(2.5)


@pytest.fixture(scope="module")
def runs():
    lays = [layout("docs_tp2_sp_pp2_interleaved", tp=2, pp=2, sp=True, vp=1, model=DOC_FLAGS,
                   datasets=doc_datasets),
            layout("docs_per_token_pp2_dp2_interleaved", pp=2, dp=2, vp=1,
                   model=("--calculate-per-token-loss", "--eod-mask-loss"), datasets=doc_datasets),
            layout("per_token_tp2_dp2_zero2", tp=2, dp=2, zero=2, model=("--calculate-per-token-loss",
                                                                           "--eod-mask-loss"), datasets=doc_datasets)]
    return lays, run_layouts(lays, 4)


@pytest.mark.parametrize("i", range(3), ids=["docs_tp2_sp_pp2_vp", "per_token_pp2_dp2_vp", "per_token_tp2_dp2_zero2"])
def test_layouts_match_single_process(runs, i):
    """Every step-1 gradient before clipping, grad norms, losses and parameters after 6 steps at
    rel <= 1e-5; the single process learns the chains (documents and all)."""
    lays, results = runs
    check_reference(reference(lays[i]))
    assert_parity(lays[i], results[i])
