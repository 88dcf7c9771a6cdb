import numpy as np
import pytest
from conftest import write_random_dataset

from megalite.data import MegatronPretrainingSampler, build_gpt_datasets
from megalite.data.blended_dataset import build_blending_indices


def test_blending_greedy_reference():
    ids, within = build_blending_indices([0.25, 0.75], 8)
    # Greedy on error w_i * max(k, 1) - count_i, ties to the lowest id.
    assert ids.tolist() == [1, 0, 1, 1, 0, 1, 1, 1]
    assert within.tolist() == [0, 0, 1, 2, 1, 3, 4, 5]


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.2, 0.3]])
def test_blend_proportions_and_sources(tmp_path, weights):
    rng = np.random.default_rng(1)
    data_path = []
    for i, w in enumerate(weights):  # dataset i holds token ids in [1000 i, 1000 i + 1000)
        write_random_dataset(tmp_path / f"p{i}", rng, num_docs=40, max_len=200, offset=1000 * i)
        data_path += [str(w * 10), str(tmp_path / f"p{i}")]  # weights normalised by the builder
    train, _, _ = build_gpt_datasets(data_path, "100,0,0", 8, 1, (10_000, 0, 0), str(tmp_path / "c"))
    assert len(train) == 10_000
    counts = np.bincount(train.dataset_index, minlength=len(weights))
    assert np.all(np.abs(counts / 10_000 - weights) < 0.01)
    for k in (0, 1, 57, 9_999):  # every sample comes whole from the dataset it was assigned
        src = int(train.dataset_index[k])
        assert np.all(train[k]["text"] // 1000 == src)
    # Every prefix of the stream is within one sample of the weights (greedy assignment).
    running = np.cumsum(np.eye(len(weights))[train.dataset_index], axis=0)
    expect = np.arange(1, 10_001)[:, None] * np.array(weights)
    assert np.abs(running - expect).max() <= 1.0 + 1e-9


def _run(total, consumed, mbs, dp):
    """Global stream as the union of all DP ranks' micro-batches, step by step."""
    iters = [iter(MegatronPretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    steps = []
    for batches in zip(*iters):
        assert all(len(b) == mbs for b in batches)
        steps.append([i for b in batches for i in b])
    return steps


def test_sampler_resume_and_dp_change():
    total = 1000
    full = _run(total, 0, 4, 2)  # global batch 8 per step
    assert [i for s in full for i in s] == list(range(len(full) * 8))
    assert all(len(set(s)) == 8 for s in full)  # DP ranks read disjoint slices
    for consumed in (8, 96, 800):
        assert _run(total, consumed, 4, 2) == full[consumed // 8:]  # exact continuation
    # Resume with DP 4 (micro-batch 2, same global batch): the same global samples per step.
    assert _run(total, 96, 2, 4) == full[12:]
    # And the same stream with a different global batch size too.
    assert [i for s in _run(total, 96, 3, 4) for i in s][:120] == list(range(96, 216))


def test_sampler_rank_slices_and_errors():
    assert list(MegatronPretrainingSampler(10, 0, 2, 1, 2)) == [[2, 3], [6, 7]]
    # Partial last step (samples 8, 9) only with drop_last=False, sliced like a full one.
    assert list(MegatronPretrainingSampler(10, 0, 2, 0, 2, drop_last=False)) == [[0, 1], [4, 5], [8, 9]]
    assert list(MegatronPretrainingSampler(10, 0, 2, 1, 2, drop_last=False)) == [[2, 3], [6, 7]]
    assert list(MegatronPretrainingSampler(10, 0, 2, 0, 2)) == [[0, 1], [4, 5]]
    assert len(MegatronPretrainingSampler(10, 4, 2, 0, 2)) == 1
    for args, match in [((0, 0, 1, 0, 1), "total_samples=0"), ((10, 10, 1, 0, 1), "consumed samples 10"),
                        ((10, 0, 0, 0, 1), "--micro-batch-size 0"), ((10, 0, 1, 2, 2), "rank 2")]:
        with pytest.raises(ValueError, match=match):
            MegatronPretrainingSampler(*args)
