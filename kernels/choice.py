"""Never slower than torch, by measurement: for each shape class (shape_class.py), whether a kernel's Triton path
or its torch fallback runs.

Modes (set_kernel_choice; megalite's --kernel-choice):
  "auto" (the default): on a CUDA device, the first time a process uses a class, once the kernel's self-check
      has passed (self_check.py), both paths are timed forward and backward, as training runs them, on the
      class's representative inputs (workloads.py; for attention the fallback is SDPA, whichever backend torch
      picks), and the faster runs for that class from then on. CPU tensors take the fallback, as before.
  "triton": Triton on CUDA once the self-check has passed, untimed. "torch": the fallback everywhere.
  "always": "auto" on any device and under a forced backend "triton" too (the interpreter tests).
A backend forced with set_backend / use_backend (tests, benchmarks) is what it says: only "always" races under it.

The timer: timer(run, cls, backend) -> milliseconds of one run() (run: one forward and backward). On CUDA the
default is triton.testing.do_bench's median (calls repeated for REP_MS, synchronised, the L2 flushed between
calls); elsewhere the median of a few wall-clock calls. set_timer installs a stand-in (tests). A path that raises
while timed (out of memory at the class's size, a build that fails there) counts as infinitely slow.

Measurements are cached on disk per (device name, torch, triton) (choice_cache.py): a later process reads them
and times nothing.

Every rank of a job takes the same decision: megalite's setup calls decide(shapes, reduce_fn) once on every rank,
after the model is built, with the same list (derived from the model configuration, not from what a pipeline
stage runs: megalite/training/kernel_choice.py). Each rank reads or times its classes; the [n, 2] times
(Triton, fallback) go through reduce_fn, one sum over the ranks (an all-reduce, done by megalite: kernels/ has
no process groups); each class takes Triton iff its summed Triton time is below its summed fallback time. The
sums are the same bits on every rank, so the decision is too. A kernel whose self-check failed on a rank counts
as infinitely slow there, so no rank uses it for that class. Ranks whose lists differ only in dtype (replicas of
other precisions) agree position by position. A class met later that was not in the list is decided by the rank
that meets it, alone (no collective can run at an arbitrary call inside a model), and kept in its disk cache.
"""
import math
import statistics
import sys
import time

import torch

from . import _dispatch, choice_cache, self_check, shape_class
from .workloads import workload

MODES = ("auto", "triton", "torch", "always")
WARMUP_MS, REP_MS = 10, 50  # do_bench's budget per path and class: a few hundred calls of a small kernel
FALLBACK = {"flash_attention": "sdpa"}  # how the summary names a fallback (else "torch")
_mode = "auto"
_timer = None  # None: _default_timer
_decided = {}  # ShapeClass -> (triton_ms, torch_ms): summed over the ranks for the classes decide() was given
_answers = {}  # (kernel, shape, dtype, device) -> the gate's answer: a call's class built once per shape, not per call


def set_kernel_choice(mode):
    global _mode
    if mode not in MODES:
        raise ValueError(f"kernels choice must be one of {', '.join(MODES)}, got {mode!r}")
    _mode = mode
    _answers.clear()


def get_kernel_choice():
    return _mode


def set_timer(timer):
    """timer(run, cls, backend) -> milliseconds; None: the default (do_bench on CUDA)."""
    global _timer
    _timer = timer


def reset():
    """Forget every decision and what was read from disk (tests)."""
    _decided.clear()
    _answers.clear()
    choice_cache.forget()


def decisions():
    """{ShapeClass: "triton" or "torch"} for every class decided so far in this process."""
    return {cls: "triton" if tt < tf else "torch" for cls, (tt, tf) in _decided.items()}


def decide(shapes, reduce_fn=None):
    """Decide these classes now: shapes, [(kernel, shape of the first tensor it passes use_triton, dtype, device)],
    the same list on every rank; reduce_fn(tensor) -> its sum over the ranks (None: this process alone). Does
    nothing (and calls no reduce_fn) where this mode races nothing on these devices, which is the same on every
    rank. Returns decisions() for the classes given."""
    classes, seen = [], set()
    for kernel, shape, dtype, device in shapes:
        cls = shape_class.of(kernel, shape, dtype, device)
        if cls is not None and (cls.kernel, cls.bucket) not in seen and _races(torch.device(device), False):
            seen.add((cls.kernel, cls.bucket))
            classes.append(cls)
    if not classes:
        return {}
    times = torch.tensor([_measure(cls) if _trusted(cls) else (math.inf, 1.0) for cls in classes],
                         dtype=torch.float64)
    if reduce_fn is not None:
        times = reduce_fn(times).to("cpu", torch.float64)
    for cls, (tt, tf) in zip(classes, times.tolist()):
        _decided[cls] = (tt, tf)
    _answers.clear()
    return {cls: d for cls, d in decisions().items() if cls in classes}


def times():
    """{ShapeClass: (triton_ms, torch_ms)} of every class decided so far (summed over the ranks where decide()
    was given a reduce_fn)."""
    return dict(_decided)


def summary():
    """One line, each decided kernel's choice and Triton's speed against its fallback (fallback time / Triton
    time), e.g. 'kernels: flash_attention sdpa 0.61x | rms_norm triton 1.42x'; a kernel decided for several
    classes names each by its bucket; "(Triton failed)" where its self-check failed or it raised while timed on
    some rank. '' when nothing was raced."""
    if not _decided:
        return ""
    count = {}
    for cls in _decided:
        count[cls.kernel] = count.get(cls.kernel, 0) + 1
    parts = []
    for cls, (tt, tf) in sorted(_decided.items(), key=lambda kv: (kv[0].kernel, str(kv[0].dtype), kv[0].bucket)):
        name = cls.kernel if count[cls.kernel] == 1 else f"{cls.kernel}[{'x'.join(map(str, cls.bucket))}]"
        path = "triton" if tt < tf else FALLBACK.get(cls.kernel, "torch")
        parts.append(f"{name} {path} {tf / tt:.2f}x" if math.isfinite(tt) else f"{name} {path} (Triton failed)")
    return "kernels: " + " | ".join(parts)


def _races(device, forced):
    return _mode == "always" or (_mode == "auto" and not forced and device.type == "cuda")


# kernels whose fallback is not the one the race times: ring attention's blocks (kernels.flash_attention_block and
# its backward) fall back to an explicit fp32 computation, never faster than the kernel, so the self-check of the
# kernel named here alone decides them (and every rank of a CP ring runs its blocks alike)
SELF_CHECK_ONLY = {"flash_attention_block": "flash_attention"}


def _gate(kernel, tensors, forced):
    """use_triton's question for a named kernel (registered with _dispatch below): may its Triton path run?"""
    if not tensors:
        return True
    t = tensors[0]
    if _mode == "torch" and not forced:
        return False
    if not self_check.trusted(SELF_CHECK_ONLY.get(kernel, kernel), t):
        return False
    if kernel in SELF_CHECK_ONLY or not _races(t.device, forced):
        return True
    key = (kernel, t.shape, t.dtype, t.device)
    if key not in _answers:
        _answers[key] = _answer(shape_class.of(kernel, t.shape, t.dtype, t.device))
    return _answers[key]


def _answer(cls):
    if cls is None:
        return True
    if cls not in _decided:  # met here first: this rank decides alone (see the module docstring)
        _decided[cls] = _measure(cls)
    tt, tf = _decided[cls]
    return tt < tf


def _trusted(cls):
    return self_check.trusted(cls.kernel, torch.empty(0, device=cls.device, dtype=cls.dtype))


def _measure(cls):
    """(triton_ms, torch_ms) of a class: from the disk cache, else timed now (and kept there)."""
    label = cls.label()
    cached = choice_cache.lookup(cls.device, label)
    if cached is not None:
        return cached
    times = (_time(cls, "triton"), _time(cls, "torch"))
    choice_cache.store(cls.device, label, times)
    return times


def _time(cls, backend):
    run = workload(cls.kernel, cls.device, cls.dtype, shape_class.size(cls))
    try:
        with _dispatch.pinned(backend), torch.enable_grad():
            return float((_timer or _default_timer)(run, cls, backend))
    except Exception as e:  # (the class's size out of memory, a build that fails at that size)
        sys.stderr.write(f"megalite kernels: timing {cls.label()} on {cls.device} ({backend}) raised "
                         f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}; counted as slowest\n")
        return math.inf


def _default_timer(run, cls, backend):
    if torch.device(cls.device).type == "cuda":
        from triton.testing import do_bench
        with torch.cuda.device(cls.device):
            return do_bench(run, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
    run()  # (the first call builds)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


_dispatch.set_gate(_gate)
