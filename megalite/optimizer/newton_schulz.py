"""Newton–Schulz orthogonalisation (Muon's core) and Muon's update scales, as Megatron-LM defines them.

X is normalised by its Frobenius norm (so its spectral norm is at most 1), laid so that the Gram
matrix is over the smaller side, and then each step applies the odd polynomial
X <- a X + (b A + c A^2) X with A = X X^T: after a few steps the singular values sit near 1, which
is the orthogonalised update U V^T (approximately: the fast coefficient sets overshoot on purpose).

Precision (`--muon-fp32-matmul-prec`): "medium" (Megatron's default) and "low" run the steps in
bfloat16 after normalising in fp32; "high" keeps fp32 (TF32 allowed on CUDA, as torch's "high").
Distributed over a group (`--muon-tp-mode distributed`): X is sharded along its long side, each rank
forms its part of A and one all-reduce per step sums it; every rank then updates its own columns.
"""

import torch
import torch.distributed as dist

# (a, b, c) per step; published constants (Megatron's emerging_optimizers carries the same sets).
COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)],  # Keller Jordan's, torch.optim.Muon's
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
    "cans": [(8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)],
    "aol": [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)],
    "deepseekv4": [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2,
}
# past the end of its list a set either repeats its last step or starts over (as Megatron's)
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
PRECISIONS = ("low", "medium", "high")
EPS = 1e-15  # Megatron's guard on the norm (an all-zero momentum stays zero)


def coefficients(kind, steps):
    """The (a, b, c) of each of `steps` steps."""
    sets = COEFFICIENTS[kind]
    if kind in REPEAT_LAST:
        return [sets[min(i, len(sets) - 1)] for i in range(steps)]
    return [sets[i % len(sets)] for i in range(steps)]


def scale_factor(rows, cols, mode):
    """The factor on the orthogonalised update of a rows x cols (out x in) matrix."""
    if mode == "shape_scaling":  # Keller Jordan's (torch.optim.Muon's "original")
        return max(1.0, rows / cols) ** 0.5
    if mode == "spectral":  # Kimi's: the update's RMS matches AdamW's
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"unknown Muon scale mode {mode!r}")


def flops(rows, cols, steps, shards=1):
    """Multiply-adds x 2 of the iteration on a rows x cols matrix (s = the smaller side, l = the larger):
    per step X X^T (2 s^2 l), A A (2 s^3), B X (2 s^2 l). shards: one rank's part when the long side is
    sharded over that many ranks (--muon-tp-mode distributed: X X^T and B X split, A A on every rank)."""
    s, n = min(rows, cols), max(rows, cols)
    return steps * (4 * s * s * n // shards + 2 * s ** 3)


def newton_schulz(x, steps, kind="quintic", precision="medium", transpose=None, group=None):
    """Orthogonalise the 2-D float32 x (whole, or x's columns of a matrix sharded over `group` along
    the long side after the transpose). Returns float32, x's shape."""
    if transpose is None:
        transpose = x.size(0) > x.size(1)
    if transpose:
        x = x.mT
    sq = (x * x).sum()
    if group is not None:
        dist.all_reduce(sq, group=group)
    X = x / sq.sqrt().clamp_min(EPS)
    if precision in ("low", "medium"):
        X = X.to(torch.bfloat16)
    for a, b, c in coefficients(kind, steps):
        A = X @ X.mT
        if group is not None:
            dist.all_reduce(A, group=group)
        X = torch.addmm(X, torch.addmm(A, A, A, alpha=c, beta=b), X, beta=a)
    X = X.float()
    return X.mT if transpose else X
