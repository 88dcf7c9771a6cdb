"""Discrete decisions taken on float comparisons: the top-k choices of MoE routing (top-k,
Sinkhorn's, the expert bias's), of capacity drops and of DSA's keys.

Two runs that compute the same function in another order (a parallel layout and the single
process, or one CPU's rounding and another's) agree to a rounding error, and a choice between
values closer than that may go either way, after which the runs differ by far more than a
rounding. Every such choice goes through `topk` here, so that a test can see each one and, to
compare two runs, make the second take the first's choices where they are ties within the
rounding (tests/support/decision_replay.py). With no hook installed it is torch.topk.
"""

import contextlib

import torch

_hooks = []
_about = []


@contextlib.contextmanager
def hooked(fn):
    """Inside the block, fn(kind, values, k, dim, choosable, about) sees every top-k choice first; it
    returns the indices to take ([..., k] along dim, like torch.topk's) or None (torch.topk's).
    about: (where, rows) of the innermost `about` block where the choice is one per row of values,
    else None."""
    _hooks.append(fn)
    try:
        yield
    finally:
        _hooks.remove(fn)


@contextlib.contextmanager
def about(where, rows):
    """The choices taken inside, one per row of their values, are those of `rows` [T, ...] (one per
    token: a router's input) at `where` (the router's name): what a hook tells a token's choice by
    where the values alone cannot (in bf16, sigmoid scores spanning 0.02 move by much of that)."""
    _about.append((where, rows))
    try:
        yield
    finally:
        _about.pop()


def topk(values, k, dim, kind, choosable=None):
    """torch.topk(values, k, dim) -> (values, indices), the choice named `kind` for hooks.
    choosable: a bool mask of the values whose order is the decision, where that is not all of
    them (e.g. an expert's own tokens: the others are dropped whatever their order)."""
    if not _hooks:
        return torch.topk(values, k, dim=dim)
    per_row = values.dim() == 2 and dim == 1  # one choice per row of values
    about = _about[-1] if _about and per_row and values.shape[0] == _about[-1][1].shape[0] else None
    for fn in _hooks:
        idx = fn(kind, values, k, dim, choosable, about)
        if idx is not None:
            return torch.return_types.topk((values.gather(dim, idx), idx))
    return torch.topk(values, k, dim=dim)
