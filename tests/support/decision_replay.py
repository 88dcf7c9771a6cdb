"""Discrete decisions of a parallel run replayed from the single process, where they are ties.

A parallel layout computes the same function as the single process in another order, and its
ranks may round as another machine does (dist_util.OTHER_CAPABILITY), so each top-k choice
(megalite/moe/decisions.py: MoE routing, capacity drops, DSA's keys) sees values that differ from the
reference's by a rounding. Over thousands of choices some gap between the k-th and the (k+1)-th
value is smaller than that (measured: 4e-6 of the row's largest value in MoE routing, exact ReLU
zeros in DSA's scores), the two runs choose differently, and after that no bound follows from the
arithmetic: the verdict would depend on the machine.

So the reference records every choice (`Recorder`: the row of values it chose from, and the
indices), and the parallel run (`Replayer`) finds, for each of its rows, the reference's row of
the same decision. A router's choices say whose they are (decisions.about: the router and its
input): the row is the one of the same router at the same step whose token's input is nearest,
within KEY_MATCH; other choices (capacity, DSA) are told by their values, the nearest row within
MATCH of the row's spread. Either way the two rows' values must agree within MATCH (else a wrong
score, not a rounding). Where its own choice differs, the difference must be a tie within the
rounding: its own gap between the k-th and (k+1)-th value is at most twice the largest difference
between the two rows (a swap of two values needs each to move by half their gap). Then it takes
the reference's choice, and both runs go on through the same decisions, so the usual bounds hold.
Anything else is a problem the parity check reports: a row with no counterpart, counterparts that
disagree, or a choice that differs by more than a tie. The choice itself is tested on its own
against its float64 definition (tests/test_moe.py, tests/test_dsa.py).

In bf16 / fp16 only the first step's choices are replayed (HALF_PRECISION_STEPS): from step 2 on
the two runs part by half precision's own chaos (tests/support/parity_check.py), sigmoid scores that
span 0.02 move by most of that, and the bound of the later steps, the farthest of the single process's
rounding twins, already holds the choices that half precision itself flips.
"""

import torch

# A row of another run is the same decision if it differs by less than this, relative to the
# row's spread. It only identifies the row (different tokens' rows differ by O(1); rows
# that nearly agree and chose differently are reported as ambiguous): scores that cancel differ by
# more than the parameters' 1e-5 (DSA's signed index scores: 3e-4 of the row's largest value), and
# whether a differing choice is a tie is judged on the rows' actual difference, not on this.
MATCH = {"fp32": 1e-2, "bf16": 1e-1, "fp16": 5e-2}
# A router's input within this of the reference's, relative to its largest element, is the same token's: about
# ten units in the last place of that element in half precision (bf16 2^-8..2^-7 of it, fp16 2^-11..2^-10),
# far more in fp32. Measured on the DeepSeek-shaped all-axes model (tests/test_all_axes.py) at step 1: the
# same token 2e-6 (fp32) and 9e-3 (bf16) apart, the nearest token that chose otherwise 3e-2 (fp32) and 0.38 (bf16).
KEY_MATCH = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 1e-2}
HALF_PRECISION_STEPS = 1
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


def _group(kind, rows, k, about, keep, step):
    """(the table's key, the rows' identities) of a choice: with `about` (a router's name and input), the rows
    of that router at this step, each told by its token's input; else every row of its kind, by the values."""
    if about is None:
        return (kind, rows.shape[-1], k), None
    where, inputs = about
    return (kind, rows.shape[-1], k, where, step), inputs.detach().reshape(inputs.shape[0], -1).double()[keep]


class Recorder:
    """decisions hook for the reference: records every choice; takes torch.topk's. `step`: counted by the
    harness after each optimizer step (a token's choices are told apart within a step)."""

    def __init__(self):
        self.rows, self.step = {}, 0

    def __call__(self, kind, values, k, dim, choosable, about=None):
        idx = torch.topk(values, k, dim=dim).indices.movedim(dim, -1)
        rows = _rows(values, dim, choosable)
        keep = _decides(rows, k)
        group, keys = _group(kind, rows, k, about, keep, self.step)
        self.rows.setdefault(group, []).append((rows[keep], idx.reshape(-1, k)[keep].sort(-1).values, keys))
        return None

    def table(self):
        """{(kind, row length, k[, where, step]): (rows [N, L], chosen [N, k] sorted, keys [N, h] or None)}, numpy
        arrays (sent to spawned ranks by value: a tensor each would be a file descriptor, and a fork server takes
        few)."""
        return {g: (torch.cat([r for r, _, _ in v]).numpy(), torch.cat([i for _, i, _ in v]).numpy(),
                    None if v[0][2] is None else torch.cat([key for _, _, key in v]).numpy())
                for g, v in self.rows.items()}


def _distance(rows, ref_rows, scale):
    """[n, N]: each row's largest difference from each reference row, relative to scale [n]."""
    return (rows[:, None, :] - ref_rows[None]).abs().amax(-1) / scale[:, None]


class Replayer:
    """decisions hook for a parallel run: the reference's choice where its own differs by a tie.
    match: how near a row's values must be to the reference's, relative to their spread (MATCH);
    key_match: how near its token's input, relative to its largest element (KEY_MATCH), where the
    choice says whose it is (the row is then found by its token, its values still checked);
    steps: replay in the first `steps` optimizer steps only (None: all), see HALF_PRECISION_STEPS."""

    def __init__(self, table, match, key_match=None, steps=None):
        self.table = {g: tuple(None if t is None else torch.as_tensor(t) for t in v) for g, v in table.items()}
        self.match, self.key_match, self.steps = match, key_match, steps
        self.counts = {}  # kind -> [rows, replayed]
        self.problems = []
        self.step = 0

    def _problem(self, msg):
        if len(self.problems) < 5:
            self.problems.append(msg)

    def __call__(self, kind, values, k, dim, choosable, about=None):
        if self.steps is not None and self.step >= self.steps:
            return None
        own_rows = torch.topk(values, k, dim=dim).indices.movedim(dim, -1)
        shape = own_rows.shape
        own_rows = own_rows.reshape(-1, k)
        rows = _rows(values, dim, choosable)
        count = self.counts.setdefault(kind, [0, 0])
        keep = _decides(rows, k)
        which = keep.nonzero().flatten()
        rows = rows[which]
        count[0] += rows.shape[0]
        if not rows.shape[0]:
            return None
        group, keys = _group(kind, rows, k, about, keep, self.step)
        if group not in self.table:
            self._problem(f"{kind}: a top-{k} of {rows.shape[-1]} the single process never took"
                          + (f" at {about[0]}, step {self.step + 1}" if about else ""))
            return None
        ref_rows, ref_idx, ref_keys = self.table[group]
        scale = _scale(rows)
        if keys is None:  # the row told by its values
            dist, match = _distance(rows, ref_rows, scale), self.match
        else:  # by its token
            dist, match = _distance(keys, ref_keys, keys.abs().amax(-1).clamp_min(1e-30)), self.key_match
        best, nearest = dist.min(dim=1)
        differ = (rows - ref_rows[nearest]).abs().amax(-1) / scale  # the values' difference, of their spread
        mine = own_rows[which].sort(-1).values
        theirs = ref_idx[nearest]
        ambiguous = ((dist <= match) & (ref_idx[None] != theirs[:, None]).any(-1)).any(-1)
        top = rows.topk(min(k + 1, rows.shape[-1]), dim=-1).values
        out, changed = own_rows.clone(), False
        for i in torch.nonzero((best > match) | ambiguous | (mine != theirs).any(-1)).flatten().tolist():
            if best[i] > match:
                self._problem(f"{kind}: a row with no counterpart in the single process (nearest at "
                              f"{best[i]:.1e} > {match:.0e})")
            elif ambiguous[i]:
                self._problem(f"{kind}: the single process chose differently for rows within {match:.0e} of "
                              "this one: ambiguous")
            elif differ[i] > self.match:
                self._problem(f"{kind}: chose {mine[i].tolist()} on values {differ[i]:.1e} of their spread from "
                              f"the single process's (> {self.match:.0e}): a wrong score, not a rounding")
            else:
                # a swap needs each of the two values to move by half their gap
                gap = ((top[i, k - 1] - top[i, k]) / (2 * scale[i])).item() if top.shape[-1] > k else float("inf")
                if gap > differ[i]:
                    self._problem(f"{kind}: chose {mine[i].tolist()} where the single process chose "
                                  f"{theirs[i].tolist()}, with a margin {gap:.1e} larger than the rows' difference "
                                  f"{differ[i]:.1e}: not a tie")
                else:
                    out[which[i]], changed = theirs[i], True
                    count[1] += 1
        if not changed:
            return None
        return out.reshape(shape).movedim(-1, dim)
