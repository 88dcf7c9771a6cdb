"""megalite's pipeline schedules against torch.distributed.pipelining's on the same model and ranks: 1F1B
(Schedule1F1B), ZB-V (ScheduleZBVZeroBubble) and DualPipeV (ScheduleDualPipeV), --pp gloo CPU ranks, one thread
each. The model: --layers residual MLP blocks (LayerNorm, Linear h -> 4h, GeLU, Linear 4h -> h), cut into PP stages
for 1F1B and 2 PP for the V's, each stage built from the same seed by its global index on whichever rank holds it
(megalite's V puts stage p - 1 - r and p + r on rank r, torch's r and 2p - 1 - r); the loss, the mean square of
the last stage's output. megalite's side runs its schedule functions (megalite/pipeline/schedules.py) over the
blocks, their linear layers' weight gradients deferred by its split backward (tensor_parallel/deferred_wgrad.py);
torch's runs its PipelineStage, which splits the backward itself (autograd.grad to the inputs, then the weights).
Prints per schedule the median step (ms) of each, torch's over megalite's, and the largest relative difference
between the two sides' gradients after one step (the same sums in another order: rounding only).

    python benchmarks/pipelining_side_by_side.py [--pp 2 --micro-batches 8 --hidden 256 --layers 8 --steps 6]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (not benchmarks/kernels.py)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from gloo_ranks import spawn  # noqa: E402
from megalite.tensor_parallel.deferred_wgrad import deferred_linear  # noqa: E402

SCHEDULES = (("1F1B", "1f1b", "Schedule1F1B"), ("ZB-V", "zbv", "ScheduleZBVZeroBubble"),
             ("DualPipeV", "dualpipev", "ScheduleDualPipeV"))


class Block(nn.Module):
    wgrad_store = None  # (megalite's split backward sets it: pipeline/wgrad.py)

    def __init__(self, h):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        s = self.wgrad_store
        y = F.gelu(deferred_linear(self.norm(x), self.fc1.weight, self.fc1.bias, s))
        return x + deferred_linear(y, self.fc2.weight, self.fc2.bias, s)


class Stage(nn.Module):
    """A stage's blocks; megalite's contract besides (set_input_tensor: the input of a stage that is not first)."""

    def __init__(self, index, blocks, h):
        super().__init__()
        torch.manual_seed(1000 + index)
        self.index, self.blocks, self.inp = index, nn.Sequential(*(Block(h) for _ in range(blocks))), None
        self.config = None

    def set_input_tensor(self, t):
        self.inp = t

    def forward(self, x=None):
        return self.blocks(self.inp if x is None else x)


def _loss(out, _target=None):
    return out.square().mean()


def _megalite_stages(v, p, r, a):
    from megalite import parallel_state as ps
    ps.initialize_model_parallel(1, p, v if v > 1 else None, pipeline_placement="v" if v == 2 else "loop")
    g = ps.current_grid()
    return [Stage(g.stage_of(c), a.layers // (v * p), a.hidden) for c in range(v)]


def _megalite_step(schedule, chunks, batch, a):
    from megalite import parallel_state as ps
    from megalite.pipeline import schedules as S
    g = ps.current_grid()
    m, shape = a.micro_batches, (a.micro, a.seq, a.hidden)
    firsts = [g.stage_of(c) == 0 for c in range(len(chunks))]
    iters = [iter(batch.chunk(m)) if first else None for first in firsts]

    def forward_step(it, model):
        return model(next(it) if it is not None else None), lambda out: (_loss(out), {})
    fn = {"1f1b": S.forward_backward_pipelining_without_interleaving,
          "zbv": S.forward_backward_pipelining_zero_bubble_v,
          "dualpipev": S.forward_backward_pipelining_dualpipe_v}[schedule]
    one = len(chunks) == 1
    fn(forward_step, iters[0] if one else iters, chunks[0] if one else chunks, m, tensor_shape=shape,
       dtype=torch.float32)


def _torch_schedule(cls_name, v, p, r, a):
    from torch.distributed.pipelining import PipelineStage, schedules
    n = v * p
    indices = [r] if v == 1 else [r, n - 1 - r]
    modules = [Stage(i, a.layers // n, a.hidden) for i in indices]
    stages = [PipelineStage(mod, i, n, torch.device("cpu")) for mod, i in zip(modules, indices)]
    cls = getattr(schedules, cls_name)
    sched = cls(stages[0] if v == 1 else stages, a.micro_batches, loss_fn=_loss)
    return sched, modules


def _grads(modules):
    """{stage.parameter: its gradient}."""
    return {f"{mod.index}.{n}": p.grad.clone() for mod in modules for n, p in mod.named_parameters()}


def _timed(step, modules, steps):
    times = []
    for _ in range(steps + 1):  # (the first: a warm-up)
        for mod in modules:
            mod.zero_grad(set_to_none=True)
        dist.barrier()
        t = time.perf_counter()
        step()
        dist.barrier()
        times.append(1e3 * (time.perf_counter() - t))
    return times[1:]


def _measure(a):
    """On each rank (gloo_ranks.spawn's): {schedule: (megalite ms, torch ms, megalite's grads, torch's grads)}."""
    from megalite import parallel_state as ps
    r, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    batch = torch.randn(a.micro * a.micro_batches, a.seq, a.hidden)
    out = {}
    for name, schedule, cls_name in SCHEDULES:
        v = 1 if schedule == "1f1b" else 2
        chunks = _megalite_stages(v, p, r, a)
        ours = _timed(lambda: _megalite_step(schedule, chunks, batch, a), chunks, a.steps)
        our_grads = _grads(chunks)
        ps.destroy_model_parallel()
        sched, modules = _torch_schedule(cls_name, v, p, r, a)
        args = (batch,) if any(mod.index == 0 for mod in modules) else ()
        target = batch if any(mod.index == v * p - 1 for mod in modules) else None  # (the loss ignores it)
        theirs = _timed(lambda: sched.step(*args, target=target), modules, a.steps)
        out[name] = (statistics.median(ours), statistics.median(theirs), our_grads, _grads(modules))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.layers % (2 * a.pp) or a.micro_batches < 2 * a.pp:
        raise SystemExit(f"--layers must divide by 2 x --pp and --micro-batches be at least 2 x --pp {a.pp}")
    got = dict(enumerate(spawn(a.pp, _measure, a)))
    print(f"residual MLP, {a.layers} blocks, hidden {a.hidden}, seq {a.seq}, micro-batch {a.micro}, "
          f"{a.micro_batches} micro-batches, PP{a.pp} (gloo, 1 thread a rank), torch {torch.__version__}; "
          f"median of {a.steps} steps after a warm-up")
    print(f"{'schedule':<11}{'megalite ms':>12}{'torch ms':>10}{'torch / megalite':>18}{'max grad diff':>15}")
    for name, _, _ in SCHEDULES:
        ours = max(got[r][name][0] for r in got)
        theirs = max(got[r][name][1] for r in got)
        ours_g = {k: g for r in got for k, g in got[r][name][2].items()}  # (each side's stages on other ranks)
        theirs_g = {k: g for r in got for k, g in got[r][name][3].items()}
        assert sorted(ours_g) == sorted(theirs_g), name
        diff = max(((ours_g[k] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for k, g in theirs_g.items())
        print(f"{name:<11}{ours:>12.1f}{theirs:>10.1f}{theirs / ours:>18.3f}{diff:>15.2e}")


if __name__ == "__main__":
    main()
