"""AdamW update: per-tensor (the previous paths) vs one flat launch per param group, side by side.

A ~100-tensor GPT-shaped parameter set (per layer: QKV, projection and two MLP matrices with
their biases, two LayerNorms; plus embeddings and a final norm), gradients in a DDP grad
buffer as in training. Timed, alternating so machine noise hits all alike (medians):
  torch per-tensor     torch.optim.AdamW(foreach=False): megalite's previous CPU path
  kernels per-tensor   kernels.adamw_step once per tensor, step read with .item(): the previous
                       CUDA path
  torch foreach        torch.optim.AdamW(foreach=True): torch's multi-tensor path, for reference
  megalite flat        MixedPrecisionOptimizer's update: one kernels.adamw_step per group over
                       flat buffers (grads gathered with one torch.cat, bf16 copies in one
                       foreach copy); the update only, no grad norm / clipping
fp32 and bf16 models (bf16: fp32 main params, model copies written back). On CUDA also torch's
fused AdamW. Only the update is timed.

    python benchmarks/adamw_flat.py [--layers 8 --hidden 256 512 --steps 20]
"""

import os
import sys

# Run as a script, this folder comes first on sys.path and its kernels.py would shadow the
# `kernels` package: put the repository root first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import statistics
import time

import torch
from torch import nn

import kernels
from megalite import parallel_state as ps
from megalite.config import TrainingConfig
from megalite.distributed import DistributedDataParallel
from megalite.optimizer import MixedPrecisionOptimizer
from megalite.optimizer.optimizer import no_weight_decay

HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Stack(nn.Module):
    def __init__(self, layers, h, vocab=8192, seq=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(h), "qkv": nn.Linear(h, 3 * h), "proj": nn.Linear(h, h),
            "ln2": nn.LayerNorm(h), "fc1": nn.Linear(h, 4 * h), "fc2": nn.Linear(4 * h, h)}) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def torch_groups(named, params):
    return [{"params": [q for (n, p), q in zip(named, params) if not no_weight_decay(n, p)],
             "weight_decay": HP["weight_decay"]},
            {"params": [q for (n, p), q in zip(named, params) if no_weight_decay(n, p)], "weight_decay": 0.0}]


def variants(layers, hidden, dtype, dev):
    """{name: update()} over separate copies of one model, all with the same gradients."""
    torch.manual_seed(0)
    tcfg = TrainingConfig(lr=HP["lr"], adam_beta1=HP["betas"][0], adam_beta2=HP["betas"][1],
                          weight_decay=HP["weight_decay"], global_batch_size=1, bf16=dtype == torch.bfloat16)
    model = DistributedDataParallel(Stack(layers, hidden).to(dev, dtype))
    opt = MixedPrecisionOptimizer([model], tcfg)
    named = list(model.module.named_parameters())
    for _, p in named:
        p.main_grad.normal_()
    grads = [p.main_grad for _, p in named]
    out = {"megalite flat": lambda: opt._update(opt._grads(), opt._copies())}

    def torch_opt(**kw):
        mains = [p.detach().float().clone().requires_grad_() for _, p in named]
        models = [p.detach().clone() for _, p in named]
        o = torch.optim.AdamW(torch_groups(named, mains), lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], **kw)
        for m, g in zip(mains, grads):
            m.grad = g

        def update():
            o.step()
            if dtype != torch.float32:
                for p, m in zip(models, mains):
                    p.copy_(m)
        return update
    out["torch per-tensor"] = torch_opt(foreach=False)
    out["torch foreach"] = torch_opt(foreach=True)
    if dev.type == "cuda":
        out["torch fused"] = torch_opt(fused=True)

    mains = [p.detach().float().clone() for _, p in named]
    models = [p.detach().clone() for _, p in named]
    states = [(torch.zeros(()), torch.zeros_like(m), torch.zeros_like(m)) for m in mains]
    wd = [0.0 if no_weight_decay(n, p) else HP["weight_decay"] for n, p in named]

    def per_tensor():  # the previous fused path, as it was
        for m, g, (st, a, b), out_, w in zip(mains, grads, states, models, wd):
            st += 1
            kernels.adamw_step(m.view(-1), g.reshape(-1), a.view(-1), b.view(-1), step=int(st.item()), lr=HP["lr"],
                               beta1=HP["betas"][0], beta2=HP["betas"][1], eps=HP["eps"], weight_decay=w,
                               model_params=None if dtype == torch.float32 else out_.view(-1))
    out["kernels per-tensor"] = per_tensor
    return out, len(named), sum(p.numel() for _, p in named)


def bench(layers, hidden, dtype, dev, steps, warmup):
    fns, ntensors, numel = variants(layers, hidden, dtype, dev)
    times = {k: [] for k in fns}
    with torch.no_grad():
        for i in range(warmup + steps):
            for name, fn in fns.items():
                sync()
                t = time.perf_counter()
                fn()
                sync()
                if i >= warmup:
                    times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    flat = med["megalite flat"]
    print(f"\n{str(dtype).split('.')[-1]} model, {layers} layers, hidden {hidden}: {ntensors} tensors, "
          f"{numel / 1e6:.1f} M params")
    print(f"{'update':<22}{'median ms':>11}{'min ms':>9}{'vs flat':>9}")
    for name, m in sorted(med.items(), key=lambda kv: -kv[1]):
        print(f"{name:<22}{m:11.3f}{min(times[name]) * 1e3:9.3f}{m / flat:8.2f}x")
    return med


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 512])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    ps.initialize_model_parallel(1, 1)
    dev = ps.get_device()
    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {where}, torch {torch.__version__}; AdamW update only, medians of {a.steps} alternated steps")
    for dt in a.dtypes:
        for h in a.hidden:
            bench(a.layers, h, getattr(torch, dt), dev, a.steps, a.warmup)


if __name__ == "__main__":
    main()
