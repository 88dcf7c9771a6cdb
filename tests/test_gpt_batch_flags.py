"""Megatron's batch flags for packed documents: --eod-mask-loss, --reset-position-ids,
--reset-attention-mask, and --calculate-per-token-loss: the masks equal megatron-core's, a
document sees only itself, and TP/SP/PP/DP layouts match one process (tests/support/parity.py)."""

import itertools

import numpy as np
import pytest
import torch

from dist_util import rel_err
from megalite import parallel_state as ps
from megalite.data.gpt_batch import GPTBatchDataset, ltor_masks_and_position_ids
from parity import ALPHABET, VOCAB, check_reference, layout, reference, run_layouts
from parity_check import assert_parity

EOD = VOCAB - 1  # outside the chain's alphabet
DOC_FLAGS = ("--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask")


class DocChainDataset(torch.utils.data.Dataset):
    """Packed documents: bigram chains (as tests/support/parity.py's) cut by EODs at random places."""

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
            mask, loss_mask, position_ids = (a if a is None else torch.from_numpy(a)
                                             for a in ltor_masks_and_position_ids(t.numpy(), 0, *flags))
            if mask is None:  # only causal: the model's own mask
                mask = ~torch.tril(torch.ones(s, s, dtype=torch.bool))[None]
            assert torch.equal(mask, am) and torch.equal(loss_mask, lm) and torch.equal(position_ids, pos), (t, flags)


def test_a_document_sees_only_itself():
    """With --reset-attention-mask --reset-position-ids, the logits of the second document do
    not change when the first is rewritten, and equal the second document run alone."""
    from megalite.cli.parser import model_config, parse_args
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
            mask, _, pos = ltor_masks_and_position_ids(tokens, EOD, True, True, False)
            return model(torch.tensor([tokens]), position_ids=torch.from_numpy(pos)[None],
                         attention_mask=torch.from_numpy(mask)[None])[0]
        with torch.no_grad():
            packed = logits(a + b)[len(a):]
            rewritten = logits([11, 12, 13, EOD] + b)[len(a):]
            alone = logits(b)
        torch.testing.assert_close(packed, rewritten, rtol=0, atol=0)
        # alone: shorter attention rows and GEMMs, so sums ordered differently: DESIGN's fp32 bound
        assert rel_err(packed, alone) <= 1e-5, rel_err(packed, alone)
    finally:
        ps.destroy_model_parallel()


def test_per_token_loss_is_batch_wide():
    """Two micro-batches with 3 and 1 counted tokens: the loss is (s1 + s2) / 4, not the mean of
    the two micro-batch means."""
    from megalite.training.step import mean_losses
    ps.initialize_model_parallel(1, 1)
    try:
        lm, means = mean_losses([{"lm loss": torch.tensor([6.0, 3.0])}, {"lm loss": torch.tensor([4.0, 1.0])}],
                                 grid=ps.current_grid())
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


class _Counting(DocChainDataset):
    reads = 0

    def __getitem__(self, i):
        _Counting.reads += 1
        return super().__getitem__(i)


def _loader_batches(workers):
    """On a TP2 x DP2 grid: 5 micro-batches from consumed sample 6, and this process's reads."""
    from megalite.batching.data_iterators import build_data_iterator
    from megalite.config.data import LoaderConfig
    ps.initialize_model_parallel(2, 1)
    try:
        ds = GPTBatchDataset(_Counting(64, 16, 1), EOD, True, True, True)
        _Counting.reads = 0
        torch.manual_seed(0)
        it = build_data_iterator(ds, 6, LoaderConfig(micro_batch_size=2, num_workers=workers, seed=0),
                                 grid=ps.current_grid())
        batches = [{k: v.clone() for k, v in next(it).items()} for _ in range(5)]
        draw = torch.rand(4)  # the global RNG (hidden dropout on CPU) is untouched by the reader's loader
        batches[0]["draw"] = draw
        reads = _Counting.reads
        left = sum(1 for _ in it)  # the rest of the sampler, then a clean end on every TP rank
        return batches, reads, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), left
    finally:
        ps.destroy_model_parallel()


def _both_loaders():
    return _loader_batches(0), _loader_batches(2)


def test_loader_workers_and_tp_broadcast():
    """--num-workers 2 yields exactly the in-process batches; only TP rank 0 reads samples, the
    other TP rank receives the same batch (masks included); DP ranks read their own slices."""
    from dist_util import run_on_ranks
    per_rank = run_on_ranks(_both_loaders, 4)
    by_coord = {}
    keys = ["attention_mask", "loss_mask", "position_ids", "text"]
    for (b0, reads0, tp, dp, left0), (b2, _, _, _, left2) in per_rank:
        assert [sorted(b) for b in b0] == [sorted(keys + ["draw"])] + [keys] * 4
        for x, y in zip(b0, b2):
            assert all(torch.equal(x[k], y[k]) for k in x)
        assert reads0 == (10 if tp == 0 else 0), (tp, reads0)  # 5 micro-batches of 2 samples
        assert left0 == left2 == (64 - 6) // 4 - 5  # steps of 4 samples (micro 2 x DP 2) after the 5
        by_coord[(tp, dp)] = b0
    for dp in (0, 1):
        assert all(torch.equal(a["text"], b["text"]) for a, b in zip(by_coord[(0, dp)], by_coord[(1, dp)]))
        assert torch.equal(by_coord[(0, dp)][0]["draw"], by_coord[(1, dp)][0]["draw"])
    expected = DocChainDataset(64, 16, 1)[6 + 2]["text"]  # step 1 starts at 6; DP rank 1 reads samples 8, 9
    assert torch.equal(by_coord[(0, 1)][0]["text"][0], torch.as_tensor(expected))


def test_loss_func_is_megatrons_masked_mean():
    """loss = sum(loss * mask) / sum(mask) per micro-batch (a fully masked one gives 0, not NaN,
    as Megatron's clamp); with --calculate-per-token-loss: (sum, count, [sum, count])."""
    import types

    import pretrain_gpt
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    for per_token in (False, True):
        def fake(*args, **kwargs):  # the model: its per-token loss
            return losses
        fake.config = types.SimpleNamespace(calculate_per_token_loss=per_token)
        for m, want_sum, want_count in ((mask, 1 + 3 + 4 + 7, 4), (torch.zeros_like(mask), 0.0, 0)):
            out, loss_func = pretrain_gpt.forward_step(iter([{"text": torch.zeros(2, 5, dtype=torch.long),
                                                               "loss_mask": m}]), fake)
            res = loss_func(out)
            if per_token:
                assert len(res) == 3 and float(res[0].detach()) == want_sum and float(res[1]) == want_count
                assert res[2]["lm loss"].tolist() == [want_sum, want_count]
            else:
                assert len(res) == 2 and float(res[0].detach()) == (want_sum / want_count if want_count else 0.0)
