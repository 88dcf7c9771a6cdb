"""Pipeline stages balanced by measurement (--pipeline-model-parallel-layout auto), emulated on CPU
ranks: a 4-stage pipeline whose stage --slow-stage is --factor times slower, step time with the
even split (Megatron's default), with `auto`, and with every cut of the layers into 4 stages, tried
one by one (the best of them is the target).

The slower GPU is emulated on its rank by sleeping, after each transformer layer's forward and
after its backward, (factor - 1) x the time the layer just took (forward and backward hooks): its
layers cost factor x theirs, as on a slower device. A GPT (hidden --hidden, --layers layers, seq
--seq, vocab 1024, micro-batch 1, global batch --batch) trains --iters iterations per layout through
pretrain_gpt; the figure is the median time per iteration after iteration --warmup (--log-json).

    python benchmarks/auto_layout.py [--layers 12 --factor 2 --slow-stage 1 --iters 4]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import contextlib
import itertools
import json
import statistics
import tempfile
import time

from gloo_ranks import spawn


def _model_flags(a):
    return (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads 4 --seq-length {a.seq} "
            f"--max-position-embeddings {a.seq} --vocab-size 1024 --mock-data --micro-batch-size 1 "
            f"--global-batch-size {a.batch} --train-iters {a.iters} --lr 1e-4 --log-interval 1 --eval-iters 0 "
            "--num-workers 0 --hidden-dropout 0 --attention-dropout 0 --pipeline-model-parallel-size 4").split()


@contextlib.contextmanager
def slower_stage(stage, factor):
    """The layers that pipeline rank `stage` builds take `factor` x their time (forward and backward)."""
    from megalite import parallel_state as ps
    from megalite.transformer.block import TransformerBlock
    original = TransformerBlock.__init__

    def pre(module, *_):
        module._started = time.perf_counter()

    def post(module, *_):
        time.sleep((factor - 1) * (time.perf_counter() - module._started))

    def init(self, *args, **kw):
        original(self, *args, **kw)
        if ps.get_pipeline_model_parallel_rank() == stage:
            for layer in self.layers.values():
                layer.register_forward_pre_hook(pre)
                layer.register_forward_hook(post)
                layer.register_full_backward_pre_hook(pre)
                layer.register_full_backward_hook(post)
    TransformerBlock.__init__ = init
    try:
        yield
    finally:
        TransformerBlock.__init__ = original


def cut_string(counts):
    from megalite.pipeline.auto_layout import layout_string
    return layout_string(list(counts))


def _timed(a, modes, log_dir):
    """In each rank: one pretrain per mode, the slow stage emulated; median ms per iteration (last rank)."""
    import pretrain_gpt
    from megalite import parallel_state as ps
    from megalite.cli.parser import parse_args
    from megalite.training import pretrain
    from megalite.training.record import RunRecord
    out = {}
    with slower_stage(a.slow_stage, a.factor):
        for name, flags in modes:
            path = os.path.join(log_dir, f"{name.replace('|', '_').replace('*', 'x')}.jsonl")
            args = parse_args(_model_flags(a) + flags + ["--log-json", path], world_size=4)
            record = RunRecord()
            pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args,
                     record=record)
            ps.destroy_model_parallel()
            if ps.global_rank() == 3:
                lines = [json.loads(x) for x in open(path)]
                out[name] = statistics.median(1e3 * x["iteration-time"] for x in lines if x["iteration"] > a.warmup)
            if name == "auto":
                out["auto cut"] = record.layout[1]
                out["auto stages"] = [(st.u, st.e) for st in record.layout[0]]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--slow-stage", type=int, default=1)
    a = p.parse_args()
    cuts = [c for c in itertools.product(range(1, a.layers + 1), repeat=4) if sum(c) == a.layers]
    modes = [("even", []), ("auto", ["--pipeline-model-parallel-layout", "auto"])]
    modes += [(cut_string(c), ["--pipeline-model-parallel-layout", cut_string(c)]) for c in cuts]
    times = {}
    with tempfile.TemporaryDirectory() as d:  # fresh ranks every 40 runs (bounds what one world accumulates)
        for i in range(0, len(modes), 40):
            times.update(spawn(4, _timed, a, modes[i:i + 40], d)[3])
    tried = {c: times[cut_string(c)] for c in cuts}
    best = min(tried, key=tried.get)
    even, auto, top = times["even"], times["auto"], tried[best]
    print(f"\nPP4 on 4 CPU ranks (gloo), stage {a.slow_stage} {a.factor:g}x slower (emulated); GPT h{a.hidden} "
          f"L{a.layers} seq {a.seq}, global batch {a.batch} of micro-batch 1; median ms/iteration after "
          f"iteration {a.warmup}")
    print(f"  auto measured ms per layer by stage "
          f"{', '.join(f'{1e3 * u:.2f}' for u, _ in times['auto stages'])}, outside the layers "
          f"{', '.join(f'{1e3 * e:.2f}' for _, e in times['auto stages'])}")
    print(f"  even split {'-'.join(str(a.layers // 4) for _ in range(4)):<10} {even:8.1f} ms")
    print(f"  auto       {'-'.join(map(str, times['auto cut'])):<10} {auto:8.1f} ms   "
          f"{even / auto:.2f}x the even split, "
          f"{auto / top:.3f} of the best cut's time")
    print(f"  best of {len(cuts)} cuts tried {'-'.join(map(str, best)):<10} {top:8.1f} ms   "
          f"{even / top:.2f}x the even split")
    ranked = sorted(tried, key=tried.get)
    print(f"  auto's cut ranks {ranked.index(tuple(times['auto cut'])) + 1} of {len(cuts)}; the five best: " +
          ", ".join(f"{'-'.join(map(str, c))} {tried[c]:.1f}" for c in ranked[:5]))


if __name__ == "__main__":
    main()
