"""--deterministic-mode: only deterministic algorithms, so two runs from one seed are bitwise equal.

torch raises on any op without a deterministic implementation instead of running a
nondeterministic one; cuBLAS needs a fixed workspace for repeatable GEMMs (the variable must
be set before CUDA creates its first handle, i.e. at start-up). megalite's Triton kernels use no
atomics (their reductions are two-stage, in a fixed order), so they stay on.
"""

import os

import torch


def enable_deterministic():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if torch.backends.cudnn.is_available():
        torch.backends.cudnn.benchmark = False
