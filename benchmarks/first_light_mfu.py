"""first-light's MFU step: the 1.7B GPT of Megatron's H100 table (hidden 2048, 24 layers, 16 heads, seq
4096, vocab 131072, RMSNorm, rope, SwiGLU, untied, no biases), bf16, whole training steps, in one process:
a plain PyTorch GPT of the same shape (SDPA, torch.autocast, fused AdamW, clipping), the same under
torch.compile (each block compiled, as torchtitan does), megalite --no-fused-kernels, megalite with its
fused kernels; then one megalite step under the torch profiler: its device time (every kernel) against its
wall time, and its top kernels. Every TFLOP/s figure counts the same model FLOPs (megalite.planner.flops,
Megatron's formula).

    python benchmarks/first_light_mfu.py [--micro 4] [--steps 7]
    python benchmarks/first_light_mfu.py --cpu-smoke      # tiny shapes on CPU: checks the script runs
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import mfu
from megalite.planner.flops import num_floating_point_operations


class Block(nn.Module):
    def __init__(self, h, heads, groups, ffn):
        super().__init__()
        self.heads, self.groups, self.hd = heads, groups, h // heads
        self.n1, self.n2 = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
        self.qkv = nn.Linear(h, (heads + 2 * groups) * self.hd, bias=False)
        self.proj = nn.Linear(heads * self.hd, h, bias=False)
        self.fc1 = nn.Linear(h, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).split([self.heads * self.hd, self.groups * self.hd, self.groups * self.hd], -1)
        q, k, v = (t.view(b, s, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.groups != self.heads)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        g, u = self.fc1(self.n2(x)).chunk(2, -1)
        return x + self.fc2(F.silu(g) * u)


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


class PlainGPT(nn.Module):
    def __init__(self, c, vocab):
        super().__init__()
        h = c.hidden_size
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h, c.num_attention_heads, c.num_query_groups, c.ffn_hidden_size)
                                    for _ in range(c.num_layers))
        self.norm = nn.RMSNorm(h, eps=1e-5)
        self.head = nn.Linear(h, vocab, bias=False)
        hd = h // c.num_attention_heads
        inv = 1.0 / (c.rotary_base ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(c.seq_length).float(), inv)
        ang = torch.cat((ang, ang), -1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def plain_step_time(c, vocab, micro, steps, dev, compile_backend=None):
    """Median step seconds of the plain GPT; with compile_backend, each block under torch.compile (torchtitan's
    way: one compiled graph serves every block, so the compile is one block's, not the whole model's). The
    first steps, which compile, are not in the median."""
    torch.manual_seed(0)
    model = PlainGPT(c, vocab).to(dev)
    if compile_backend:
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = torch.compile(blk, backend=compile_backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=dev == "cuda")
    ids = torch.randint(0, vocab, (micro, c.seq_length), device=dev)
    times = []
    for _ in range(steps):
        mfu.sync()
        t = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = model(ids, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mfu.sync()
        times.append(time.perf_counter() - t)
    del model, opt
    if dev == "cuda":
        torch.cuda.empty_cache()
    return sorted(times[2:])[len(times[2:]) // 2] if len(times) > 3 else min(times)


def run_all(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args(argv if argv is not None else [])
    smoke = a.cpu_smoke or not torch.cuda.is_available()
    dev = "cpu" if smoke else "cuda"
    flags = mfu.CONFIGS["smoke"] + " --position-embedding-type rope --normalization RMSNorm --swiglu " \
        "--disable-bias-linear --untie-embeddings-and-output-weights" if smoke else mfu.CONFIGS["llama-1.7b"]
    micro, steps = (2, 4) if smoke else (a.micro, a.steps)
    ceiling = float("nan") if smoke else mfu.matmul_ceiling()
    print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else 'CPU (smoke)'} | bf16 matmul ceiling "
          f"{ceiling / 1e12:.0f} TFLOP/s (8192^3, this run) | peak {mfu.PEAK / 1e12:.0f}", flush=True)
    res, shape = {}, {}
    for label, extra in (("megalite --no-fused-kernels", "--bf16 --no-fused-kernels"), ("megalite", "--bf16")):
        for m in (micro, micro // 2):
            try:
                out = mfu.run(flags, m, steps, extra, profile=label == "megalite", model_out=shape)
                res[label] = (m,) + out[:2]
                if len(out) > 2:
                    print("where megalite's step goes (one step under the profiler; kernels by device time):\n  "
                          + "\n  ".join(out[2]))
                break
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"{label}: micro-batch {m} does not fit")
            except Exception as e:  # reported, and the other variants still run
                print(f"{label}: {type(e).__name__}: {str(e)[:400]}")
                break
        print(f"{label}: {res.get(label)}", flush=True)
    plain = [(PLAIN, None), (COMPILED, "eager" if smoke else "inductor")]  # smoke: the path, not inductor's build
    if shape:
        c, vocab = shape["mcfg"], shape["vocab"]
        m = min(r[0] for r in res.values())
        for label, backend in plain:
            try:
                s = plain_step_time(c, vocab, m, steps, dev, backend)
                res[label] = (m, num_floating_point_operations(c, m, vocab) / s, s)
            except Exception as e:
                print(f"{label}: {type(e).__name__}: {str(e)[:400]}")
    _table(res, ceiling)
    return 0 if {"megalite", "megalite --no-fused-kernels", PLAIN} <= set(res) else 1


PLAIN = "plain PyTorch (SDPA, fused AdamW)"
COMPILED = "plain PyTorch + torch.compile"


def _table(res, ceiling):
    """The rows, each against plain PyTorch and against plain PyTorch + torch.compile (same micro-batch), and the
    SUMMARY line."""
    base, comp = res.get(PLAIN), res.get(COMPILED)
    print(f"{'variant':<36}{'micro':>6}{'step ms':>9}{'TFLOP/s':>9}{'MFU':>7}{'of ceiling':>11}{'x plain':>9}"
          f"{'x compiled':>11}")
    for label, (m, f, s) in res.items():
        x = f"{f / base[1]:.2f}" if base and base[0] == m else "-"
        xc = f"{f / comp[1]:.2f}" if comp and comp[0] == m else "-"
        print(f"{label:<36}{m:>6}{s * 1e3:>9.1f}{f / 1e12:>9.1f}{f / mfu.PEAK:>7.1%}{f / ceiling:>11.1%}"
              f"{x:>9}{xc:>11}")
    parts = [f"{k.split(' (')[0]} {f / 1e12:.0f} TF ({f / mfu.PEAK:.0%} MFU)" for k, (m, f, s) in res.items()]
    if base and "megalite" in res:
        parts.append(f"megalite x{res['megalite'][1] / base[1]:.2f} plain")
    if comp and "megalite" in res:
        parts.append(f"x{res['megalite'][1] / comp[1]:.2f} plain + compile")
    print("SUMMARY " + ("; ".join(parts) if parts else "nothing ran"))


if __name__ == "__main__":
    sys.exit(run_all(sys.argv[1:]))
