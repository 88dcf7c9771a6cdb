"""Evaluation: forward-only passes over the validation / test data, mean losses over
micro-batches, iterations and DP ranks (every rank gets the same numbers); which splits there
are to evaluate (report_splits), how many samples each needs (dataset_sizes) and one evaluation
iteration's batch (config/evaluation.py: EvaluationConfig.batch)."""

import torch

from megalite import parallel_state as ps
from megalite.logger import print_rank_last
from megalite.pipeline.schedules import run_forward_backward
from megalite.training.step import mean_losses

SPLITS = ("train", "validation", "test")


def evaluate(forward_step_func, iters, chunks, num_microbatches, eval_iters, shape, dtype, total=None):
    """{key: mean} of every reported loss ("lm loss", ...) over `eval_iters` global batches
    (total: the batch's micro-batch count with uneven shares, see mean_losses)."""
    for c in chunks:
        c.eval()
    losses, grid = [], ps.grid_of(chunks)
    with torch.no_grad():
        for _ in range(eval_iters):
            reported = run_forward_backward(forward_step_func, iters, chunks, num_microbatches, shape, dtype,
                                            forward_only=True)
            losses.append(mean_losses(reported, total=total, grid=grid)[1])
    for c in chunks:
        c.train()
    return {k: float(sum(d[k] for d in losses)) / len(losses) for k in losses[-1]}


def report_splits(cfg, datasets, wanted):
    """cfg: the EvaluationConfig. Print each split's sample count once from the logging rank (as Megatron's dataset
    builder) and, in one line, the splits whose evaluation is skipped because they hold no
    sample. Returns (train, valid, test), None for a split not evaluated (all under --eval-iters 0)."""
    sizes = [0 if d is None else len(d) for d in datasets]
    print_rank_last(f"megalite: datasets built, samples per split (this run needs {', '.join(map(str, wanted))}):\n"
                    + "\n".join(f"    {name + ':':<12}{n}" for name, n in zip(SPLITS, sizes)))
    if cfg.eval_iters <= 0:
        return datasets[0], None, None
    empty = [name for name, n in zip(SPLITS[1:], sizes[1:]) if n == 0]
    if empty:
        print_rank_last(_skip_line(cfg, empty))
    return datasets[0], *(d if n else None for d, n in zip(datasets[1:], sizes[1:]))


def _skip_line(cfg, empty):
    it, which = ("it", f"the {empty[0]} split holds") if len(empty) == 1 else \
        ("them", "the validation and test splits hold")
    if cfg.train_data_path:  # (Megatron's per-split paths)
        flags = " or ".join(f"--{'valid' if n == 'validation' else n}-data-path" for n in empty)
        return f"megalite: evaluation skipped: {which} no sample; give {flags} to evaluate {it}"
    why = ""
    if cfg.data_path:  # how many documents --split gives them (mock data: none to count)
        from megalite.data.builder import split_document_counts
        try:
            counts, total = split_document_counts(cfg.data_path, cfg.split, documents=cfg.model_type == "bert")
            why = f" (--split {cfg.split} gives {it} {' and '.join(str(counts[SPLITS.index(n)]) for n in empty)} " \
                  f"of {total} documents)"
        except (ValueError, OSError):  # a provider of its own may read --data-path otherwise
            pass
    return (f"megalite: evaluation skipped: {which} no sample{why}; give {it} a larger share of --split to evaluate "
            f"{it}")


def dataset_sizes(cfg, batches):
    """(train, valid, test) samples: Megatron's get_train_valid_test_num_samples, with the
    final validation counted when there is no periodic one; a sample-based ramp-up's last
    batch may pass --train-samples, and the train set covers it."""
    g, eval_g = cfg.global_batch_size, cfg.batch[0]
    if cfg.train_samples is not None:
        train = max(cfg.train_samples, batches.samples_for(cfg.train_iters))
    else:
        train = (cfg.train_iters or 0) * g
    if cfg.eval_iters <= 0:  # Megatron: --eval-iters 0 turns evaluation off
        return train, 0, 0
    evals = cfg.train_iters // cfg.eval_interval + 1 if cfg.eval_interval and not cfg.skip_train else 1
    return train, evals * cfg.eval_iters * eval_g, cfg.eval_iters * eval_g
