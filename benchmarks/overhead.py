"""megalite's TP=1 training step vs a plain PyTorch GPT of the same shape, side by side.

Both models: pre-LN GPT-2 blocks (LayerNorm, tanh-GeLU MLP 4h, causal SDPA attention),
learned positions, tied embeddings, no dropout; both steps: forward, backward, global-norm
clipping at 1.0 and torch AdamW. megalite's step is the one pretrain() runs: the DDP grad
buffer hooks, vocab-parallel cross-entropy, mixed-precision optimizer wrapper, schedule.
Steps alternate between the two so machine noise hits both alike; medians are compared.

    python benchmarks/overhead.py [--layers 4 --hidden 256 --heads 4 --seq 256 --batch 8 --steps 20]
"""

import os
import sys

# Run as a script, this folder comes first on sys.path and its kernels.py would shadow the
# `kernels` package: put the repository root first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from megalite import parallel_state as ps
from megalite.config import ModelConfig, TrainingConfig
from megalite.distributed import DistributedDataParallel, finalize_model_grads
from megalite.models import GPTModel
from megalite.optimizer import MixedPrecisionOptimizer
from megalite.pipeline.schedules import forward_backward_no_pipelining
from megalite.tensor_parallel import model_parallel_manual_seed


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.heads = heads

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, vocab, h, heads, layers, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()

    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, seq_length=a.seq,
                      vocab_size=a.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    tcfg = TrainingConfig(lr=1e-4, clip_grad=1.0, weight_decay=0.01, global_batch_size=a.batch,
                          micro_batch_size=a.batch)
    mega = DistributedDataParallel(GPTModel(cfg))
    mega_opt = MixedPrecisionOptimizer([mega], tcfg)
    dev = ps.get_device()  # the GPU when there is one: both models run on the same device
    plain = PlainGPT(a.vocab, a.hidden, a.heads, a.layers, a.seq).to(dev)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.01)

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    ids, labels = data[:, :-1].contiguous().to(dev), data[:, 1:].contiguous().to(dev)

    def fwd(_it, model):
        out = model(ids, labels=labels)
        return out, lambda o: (o.mean(), {"lm loss": o.mean().detach()})

    def mega_step():
        mega.zero_grad_buffer()
        forward_backward_no_pipelining(fwd, None, mega, 1)
        finalize_model_grads([mega])
        mega_opt.step()

    def plain_step():
        plain_opt.zero_grad(set_to_none=True)
        plain(ids, labels).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()

    times = {"megalite": [], "plain": []}
    for i in range(a.warmup + a.steps):
        for name, step in (("megalite", mega_step), ("plain", plain_step)):
            sync()
            t = time.perf_counter()
            step()
            sync()
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t)
    n_mega = sum(p.numel() for p in mega.parameters())
    n_plain = sum(p.numel() for p in plain.parameters())
    m, b = statistics.median(times["megalite"]), statistics.median(times["plain"])
    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {where}, torch {torch.__version__}")
    print(f"shape: layers={a.layers} hidden={a.hidden} heads={a.heads} seq={a.seq} batch={a.batch} "
          f"vocab={a.vocab} | params megalite {n_mega:,} (vocab padded) vs plain {n_plain:,}")
    print(f"{'step':<10}{'median ms':>12}{'min ms':>10}")
    for name in ("megalite", "plain"):
        print(f"{name:<10}{statistics.median(times[name]) * 1e3:12.1f}{min(times[name]) * 1e3:10.1f}")
    print(f"ratio megalite / plain (median): {m / b:.3f}  (goal <= 1.05)")
    assert math.isfinite(m / b)


if __name__ == "__main__":
    main()
