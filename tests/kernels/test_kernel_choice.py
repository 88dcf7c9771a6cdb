"""The race between each Triton kernel and its fallback (kernels/choice.py), through the Triton interpreter with a
stand-in timer: a kernel made slower is not chosen, a run's losses are those of the path chosen, a decision on disk
is reused by a second process without timing, a corrupt cache file is ignored with one line, and the ranks' summed
times make one decision (the world of ranks: tests/test_kernel_choice_training.py)."""

import importlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import _dispatch, choice, choice_cache, self_check, shape_class
from kernel_testutil import tiny_gpt_losses

SWIGLU = importlib.import_module("kernels.swiglu")  # the module (the package's name is the function)


class StandIn:
    """timer(run, cls, backend): `slow` {kernel: backend} takes 2 ms, the other path 1 ms; run() is called once
    when `runs` (the workload really goes through both paths). Counts its calls."""

    def __init__(self, slow, runs=False):
        self.slow, self.runs, self.calls = slow, runs, []

    def __call__(self, run, cls, backend):
        self.calls.append((cls.kernel, backend, _dispatch.get_backend()))
        if self.runs:
            assert all(torch.isfinite(t).all() for t in run())
        return 2.0 if self.slow.get(cls.kernel) == backend else 1.0


@pytest.fixture
def raced(tmp_path, monkeypatch):
    """Triton forced (the interpreter), every class raced ("always") with the self-check off (its own tests), the
    cache in a fresh directory; the gate's answers recorded in `answers`."""
    monkeypatch.setenv(choice_cache.ENV, str(tmp_path))
    choice.reset()
    self_check.reset()
    self_check.set_self_check("off")
    choice.set_kernel_choice("always")
    answers = []

    def recording(kernel, ts, forced):
        answers.append((kernel, choice._gate(kernel, ts, forced)))
        return answers[-1][1]
    monkeypatch.setattr(_dispatch, "_gate", recording)
    with kernels.use_backend("triton"):
        yield answers
    choice.set_timer(None)
    choice.set_kernel_choice("auto")
    self_check.set_self_check("cuda")
    choice.reset()



def test_ring_attention_blocks_are_not_raced(raced):
    """A ring-attention block's fallback is an explicit fp32 computation, not what the race times (SDPA): the
    self-check alone decides it, so a race lost by attention never sends the blocks down that path."""
    timer = StandIn({"flash_attention": "triton"})
    choice.set_timer(timer)
    q = torch.randn(1, 32, 2, 16)
    kernels.flash_attention(q, q, q)  # whole attention: raced, Triton made slower, SDPA chosen
    assert choice.decisions() == {shape_class.ShapeClass("flash_attention", torch.float32, "cpu", (1, 32, 2, 16)):
                                  "torch"}
    out, lse = kernels.flash_attention_block(q, q, q, causal=True)  # the same shape: Triton, untimed
    assert len(timer.calls) == 2 and raced[-1] == ("flash_attention_block", True)
    ref, ref_lse = (t.detach() for t in fa_block_torch(q))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def fa_block_torch(q):
    with kernels.use_backend("torch"):
        return kernels.flash_attention_block(q, q, q, causal=True)

def test_a_kernel_made_slower_is_not_chosen(raced):
    timer = StandIn({"rms_norm": "triton", "swiglu": "torch"}, runs=True)
    choice.set_timer(timer)
    x, w = torch.randn(37, 100), torch.rand(100) + 0.5
    y = kernels.rms_norm(x, w)
    assert torch.equal(y, torch.nn.functional.rms_norm(x, (100,), w, 1e-5))  # the fallback's, this very call
    kernels.swiglu(torch.randn(37, 64))
    d = choice.decisions()
    assert d == {shape_class.ShapeClass("rms_norm", torch.float32, "cpu", (32, 100)): "torch",
                 shape_class.ShapeClass("swiglu", torch.float32, "cpu", (32, 64)): "triton"}, d
    # each path timed once, on the backend it stands for, and never again for the class
    assert timer.calls == [("rms_norm", "triton", "triton"), ("rms_norm", "torch", "torch"),
                           ("swiglu", "triton", "triton"), ("swiglu", "torch", "torch")]
    kernels.rms_norm(torch.randn(40, 100), w)  # 40 rows: the same class (32 <= rows < 64)
    assert len(timer.calls) == 4 and [a for k, a in raced if k == "rms_norm"] == [False, False]
    assert choice.summary() == "kernels: rms_norm torch 0.50x | swiglu triton 2.00x"


def test_modes_and_forced_backends(raced):
    timer = StandIn({"rms_norm": "triton"})
    choice.set_timer(timer)
    x = torch.randn(8, 64)
    choice.set_kernel_choice("triton")
    assert kernels.use_triton(x, kernel="rms_norm") and timer.calls == []  # untimed
    choice.set_kernel_choice("auto")  # a forced backend is what it says: only "always" races under it
    assert kernels.use_triton(x, kernel="rms_norm") and timer.calls == []
    choice.set_kernel_choice("torch")
    with kernels.use_backend("auto"):
        assert not kernels.use_triton(x, kernel="rms_norm")
    with pytest.raises(ValueError, match="kernels choice must be one of auto, triton, torch, always, got 'fast'"):
        choice.set_kernel_choice("fast")


def test_a_run_trains_as_the_path_chosen(raced, monkeypatch):
    """RMSNorm's Triton path measured faster, the others' slower (the interpreter's attention, rotary and loss are
    slow to run here), and SwiGLU's Triton path made wrong by 1%: the run's losses are bit for bit those of a run
    with exactly that split forced (no race), every call of each kernel went the chosen way, and the same run
    with the wrong SwiGLU chosen trains otherwise (so the chosen path is what trained)."""
    wrong = SWIGLU._SwigluFn
    monkeypatch.setattr(SWIGLU, "_SwigluFn", type("Off", (), {"apply": staticmethod(lambda x: wrong.apply(x) * 1.01)}))
    slow = {"flash_attention": "triton", "rms_norm": "torch", "swiglu": "triton", "rotary": "triton",
            "cross_entropy": "triton"}
    choice.set_timer(StandIn(slow))
    raced_losses = tiny_gpt_losses()
    chosen = {k: "torch" if b == "triton" else "triton" for k, b in slow.items()}
    assert {c.kernel: d for c, d in choice.decisions().items()} == chosen
    assert {k for k, a in raced} == set(slow) and all(a == (chosen[k] == "triton") for k, a in raced)
    monkeypatch.setattr(_dispatch, "_gate", lambda kernel, ts, forced: chosen[kernel] == "triton")
    assert raced_losses == tiny_gpt_losses()
    monkeypatch.setattr(_dispatch, "_gate", lambda kernel, ts, forced: kernel in ("rms_norm", "swiglu"))
    assert raced_losses[0] != tiny_gpt_losses(1)[0]


def _decide(shape=(37, 100)):
    return choice.decide([("rms_norm", shape, torch.float32, "cpu")])


def test_a_decision_on_disk_is_reused_by_another_process(raced, tmp_path):
    choice.set_timer(StandIn({"rms_norm": "triton"}))
    assert list(_decide().values()) == ["torch"]
    assert len(choice._timer.calls) == 2
    body = json.loads(open(choice_cache.path("cpu")).read())
    assert body["times"] == {"rms_norm float32 32x100": [2.0, 1.0]} and body["torch"] == torch.__version__
    code = ("import torch\nfrom kernels import choice, self_check\nself_check.set_self_check('off')\n"
            "choice.set_kernel_choice('always')\ncalls = []\n"
            "choice.set_timer(lambda run, cls, backend: calls.append(backend) or 1.0)\n"
            "d = choice.decide([('rms_norm', (50, 100), torch.float32, 'cpu')])\n"
            "print(len(calls), list(d.values()), choice.summary())\n")
    env = dict(os.environ, **{choice_cache.ENV: str(tmp_path)})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0 ['torch'] kernels: rms_norm torch 0.50x", out.stdout


def test_a_corrupt_cache_file_is_ignored_with_one_line(raced, capfd):
    os.makedirs(os.path.dirname(choice_cache.path("cpu")), exist_ok=True)
    with open(choice_cache.path("cpu"), "w") as f:
        f.write('{"format": 1, "times": {"rms_norm float32 32x100": [1.0,')  # a write cut short
    choice.set_timer(StandIn({"rms_norm": "torch"}))
    assert list(_decide().values()) == ["triton"]
    assert list(_decide((300, 100)).values()) == ["triton"]  # another class: no second line
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megalite kernels: ignoring the kernel-choice cache ") \
        and err[0].endswith("; its classes are timed again"), err
    assert len(choice._timer.calls) == 4  # timed, not read
    times = json.loads(open(choice_cache.path("cpu")).read())["times"]  # rewritten whole
    assert times == {"rms_norm float32 32x100": [1.0, 2.0], "rms_norm float32 256x100": [1.0, 2.0]}


def test_summed_times_decide_and_an_untrusted_kernel_loses_everywhere(raced):
    """This rank finds Triton faster (1 vs 2 ms); the other rank, through reduce_fn, much slower (5 vs 1): the sum
    (6 vs 3) decides. A kernel another rank distrusts arrives as an infinite time."""
    choice.set_timer(StandIn({"rms_norm": "torch"}))
    other = torch.tensor([[5.0, 1.0], [math.inf, 1.0]], dtype=torch.float64)
    shapes = [("rms_norm", (37, 100), torch.float32, "cpu"), ("swiglu", (37, 64), torch.float32, "cpu")]
    d = choice.decide(shapes, reduce_fn=lambda t: t + other)
    assert list(d.values()) == ["torch", "torch"]
    assert choice.summary() == "kernels: rms_norm torch 0.50x | swiglu torch (Triton failed)"
    # the cache keeps this rank's own measurements, not the sums
    assert choice_cache.lookup("cpu", "rms_norm float32 32x100") == (1.0, 2.0)


def test_a_kernel_that_failed_its_self_check_is_not_timed(raced):
    self_check.set_self_check("always")
    self_check.distrust("swiglu", "cpu", torch.float32, "set by the test")
    choice.set_timer(StandIn({}))
    assert list(choice.decide([("swiglu", (37, 64), torch.float32, "cpu")]).values()) == ["torch"]
    assert choice._timer.calls == [] and not kernels.use_triton(torch.randn(37, 64), kernel="swiglu")


def test_kernels_import_no_circle():
    """kernels/ imports itself one way (the gate is registered, not imported back: _dispatch imports no kernel)."""
    import ast
    import pathlib
    root = pathlib.Path(kernels.__file__).parent
    graph = {}
    for f in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
        graph[f.stem] = deps & {g.stem for g in root.glob("*.py")} - {"__init__"}

    def reaches(a, b, seen=()):
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in graph.get(a, ()))
    circles = sorted(m for m in graph if m != "__init__" and reaches(m, m))
    assert not circles, f"kernels/ modules importing themselves through others: {circles}"
    assert graph["_dispatch"] == set()
