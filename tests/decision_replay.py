"""Discrete decisions of a parallel run replayed from the single process, where they are ties.

A parallel layout computes the same function as the single process in another order, and its
ranks may round as another machine does (dist_util.OTHER_CAPABILITY), so each top-k choice
(megalite/decisions.py: MoE routing, capacity drops, DSA's keys) sees values that differ from the
reference's by a rounding. Over thousands of choices some gap between the k-th and the (k+1)-th
value is smaller than that (measured: 4e-6 of the row's largest value in MoE routing, exact ReLU
zeros in DSA's scores), the two runs choose differently, and after that no bound follows from the
arithmetic: the verdict would depend on the machine.

So the reference records every choice (`Recorder`: the row of values it chose from, and the
indices), and the parallel run (`Replayer`) finds, for each of its rows, the reference's row of
the same decision (the same token at the same layer and step: the nearest row, within MATCH of
the row's spread; rows of different tokens differ by O(1) of it). Where its own choice differs,
the difference must be a tie within the rounding: its own gap between the k-th and (k+1)-th value
is at most twice the largest difference between the two rows (a swap of two values needs each to
move by half their gap). Then it takes the reference's choice, and both runs
go on through the same decisions, so the usual bounds hold. Anything else is a problem the parity
check reports: a row with no counterpart, counterparts that disagree, or a choice that differs by
more than a tie (a wrong score, not a rounding). The choice itself is tested on its own against
its float64 definition (tests/test_moe.py, tests/test_dsa.py).
"""

import torch

# A row of another run is the same decision if it differs by less than this, relative to the
# row's spread. It only identifies the row (different tokens' rows differ by O(1); rows
# that nearly agree and chose differently are reported as ambiguous): scores that cancel differ by
# more than the parameters' 1e-5 (DSA's signed index scores: 3e-4 of the row's largest value), and
# whether a differing choice is a tie is judged on the rows' actual difference, not on this.
MATCH = {"fp32": 1e-2, "bf16": 1e-1, "fp16": 5e-2}
MASKED = -1e30  # -inf (a key that may not be chosen) as a number rows can be compared with


def _rows(values, dim, choosable=None):
    """values -> [n, L] float64 rows along dim, -inf and values not choosable as MASKED."""
    if choosable is not None:
        values = values.masked_fill(~choosable, float("-inf"))
    v = values.detach().movedim(dim, -1)
    return v.reshape(-1, v.shape[-1]).double().nan_to_num(neginf=MASKED)


def _decides(rows, k):
    """Rows with more than k choosable values: elsewhere every choosable value is taken (and the rest,
    -inf or equal, in torch.topk's fixed order), so nothing is decided."""
    return (rows != MASKED).sum(dim=-1) > k


def _scale(rows):
    """A row's spread (largest - smallest choosable value): what tells tokens apart (sigmoid scores
    sit near 0.5, a spread of 0.02)."""
    hi = rows.amax(dim=-1)
    lo = rows.masked_fill(rows == MASKED, float("inf")).amin(dim=-1)
    return (hi - lo).clamp_min(1e-30)


class Recorder:
    """decisions hook for the reference: records every choice; takes torch.topk's."""

    def __init__(self):
        self.rows = {}

    def __call__(self, kind, values, k, dim, choosable):
        idx = torch.topk(values, k, dim=dim).indices.movedim(dim, -1)
        rows = _rows(values, dim, choosable)
        keep = _decides(rows, k)
        self.rows.setdefault((kind, rows.shape[-1], k), []).append((rows[keep], idx.reshape(-1, k)[keep].sort(-1).values))
        return None

    def table(self):
        """{(kind, row length, k): (rows [N, L], chosen [N, k] sorted)}"""
        return {key: (torch.cat([r for r, _ in v]), torch.cat([i for _, i in v])) for key, v in self.rows.items()}


class Replayer:
    """decisions hook for a parallel run: the reference's choice where its own differs by a tie."""

    def __init__(self, table, match):
        self.table, self.match = table, match
        self.counts = {}  # kind -> [rows, replayed]
        self.problems = []

    def _problem(self, msg):
        if len(self.problems) < 5:
            self.problems.append(msg)

    def __call__(self, kind, values, k, dim, choosable):
        own = torch.topk(values, k, dim=dim).indices
        own_rows = own.movedim(dim, -1)
        shape = own_rows.shape
        own_rows = own_rows.reshape(-1, k)
        rows = _rows(values, dim, choosable)
        count = self.counts.setdefault(kind, [0, 0])
        which = _decides(rows, k).nonzero().flatten()
        rows = rows[which]
        count[0] += rows.shape[0]
        if not rows.shape[0]:
            return None
        key = (kind, rows.shape[-1], k)
        if key not in self.table:
            self._problem(f"{kind}: a top-{k} of {rows.shape[-1]} the single process never took")
            return None
        ref_rows, ref_idx = self.table[key]
        scale = _scale(rows)
        dist = ((rows[:, None, :] - ref_rows[None]).abs().amax(-1) / scale[:, None])  # [n, N]
        best, nearest = dist.min(dim=1)
        mine = own_rows[which].sort(-1).values
        theirs = ref_idx[nearest]
        near = dist <= self.match
        ambiguous = (near & (ref_idx[None] != theirs[:, None]).any(-1)).any(-1)
        top = rows.topk(min(k + 1, rows.shape[-1]), dim=-1).values
        out, changed = own_rows.clone(), False
        for i in torch.nonzero((best > self.match) | ambiguous | (mine != theirs).any(-1)).flatten().tolist():
            if best[i] > self.match:
                self._problem(f"{kind}: a row with no counterpart in the single process (nearest at "
                              f"{best[i]:.1e} of its scale > {self.match:.0e})")
            elif ambiguous[i]:
                self._problem(f"{kind}: the single process chose differently for rows within {self.match:.0e} of "
                              "this one: ambiguous")
            else:
                # a swap needs each of the two values to move by half their gap
                gap = ((top[i, k - 1] - top[i, k]) / (2 * scale[i])).item() if top.shape[-1] > k else float("inf")
                if gap > best[i]:
                    self._problem(f"{kind}: chose {mine[i].tolist()} where the single process chose "
                                  f"{theirs[i].tolist()}, with a margin {gap:.1e} larger than the rows' difference "
                                  f"{best[i]:.1e}: not a tie")
                else:
                    out[which[i]], changed = theirs[i], True
                    count[1] += 1
        if not changed:
            return None
        return out.reshape(shape).movedim(-1, dim)
