"""first-light's kernel steps, each printing a table and one SUMMARY line:
  attention()  megalite's flash attention vs F.scaled_dot_product_attention (the faster of its GQA call and
               its flash backend on repeated k/v), causal, head dim 128, GQA 32/8, at 4k and 16k tokens:
               forward and forward+backward, and the largest difference of the outputs
  fp8()        torch._scaled_mm in e4m3 (tensorwise and row-wise scales) against the bf16 GEMM, 8192^3

    python benchmarks/first_light_kernels.py attention|fp8 [--cpu-smoke]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

import kernels
from gpu_timer import call_ms


def timeit(fn):
    """Median device milliseconds of one call (benchmarks/gpu_timer.py: many calls per measurement, no host
    dispatch inside; wall clock on CPU)."""
    return call_ms(fn)[0]


def _sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _sdpa_flash_repeated(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rep = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=True)


def _fwd_bwd(fn, leaves):
    def run():
        y = fn()
        torch.autograd.grad(y, leaves, torch.ones_like(y))
    return run


def attention(smoke=False):
    old = kernels.get_kernel_choice()
    kernels.set_kernel_choice("triton")  # "ours" is the Triton kernel itself, not whichever path the race picks
    try:
        return _attention(smoke)
    finally:
        kernels.set_kernel_choice(old)


def _attention(smoke):
    dev = "cpu" if smoke else "cuda"
    dt = torch.float32 if smoke else torch.bfloat16
    b, hq, hkv, d = (1, 4, 2, 64) if smoke else (2, 32, 8, 128)
    seqs = (128,) if smoke else (4096, 16384)
    print(f"{'seq':>6} {'pass':<8}{'ours ms':>9}{'sdpa ms':>9}{'x sdpa':>8}{'TFLOP/s':>9}  sdpa used; max |out diff|")
    parts, ok = [], True
    for s in seqs:
        torch.manual_seed(0)
        q = torch.randn(b, s, hq, d, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(b, s, hkv, d, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(b, s, hkv, d, device=dev, dtype=dt, requires_grad=True)
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        ours = lambda: kernels.flash_attention(q, k, v, causal=True)  # noqa: E731
        diff = (ours().float() - _sdpa_gqa(qt, kt, vt).transpose(1, 2).float()).abs().max().item()
        bound = 2 ** -7 * 4 if dt == torch.bfloat16 else 1e-4  # a few bf16 ulps of outputs of size ~1
        ok &= diff <= bound
        flops = 4 * b * hq * s * s * d / 2
        for pas, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            wrap = (lambda f, leaves: f) if pas == "fwd" else _fwd_bwd
            t_ours = timeit(wrap(ours, [q, k, v]))
            base = {}
            for name, fn in (("gqa", _sdpa_gqa), ("flash on repeated k/v", _sdpa_flash_repeated)):
                try:
                    base[name] = timeit(wrap(lambda fn=fn: fn(qt, kt, vt), [qt, kt, vt]))
                except Exception as e:  # a backend this build lacks for these inputs
                    print(f"#   sdpa {name} {pas}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            name, t_base = min(base.items(), key=lambda kv: kv[1]) if base else ("none", float("nan"))
            print(f"{s:>6} {pas:<8}{t_ours:>9.3f}{t_base:>9.3f}{t_base / t_ours:>8.2f}"
                  f"{flops * mult / t_ours / 1e9:>9.0f}  {name}; {diff:.2e}", flush=True)
            parts.append(f"{s // 1024 if s >= 1024 else s}{'k' if s >= 1024 else ''} {pas} x{t_base / t_ours:.2f}")
        del q, k, v, qt, kt, vt
    print("SUMMARY flash attention vs SDPA: " + "; ".join(parts)
          + ("" if ok else " | OUTPUTS DIFFER beyond bf16 bound"))
    return 0 if ok else 1


def fp8(smoke=False):
    dev = "cpu" if smoke else "cuda"
    n = 256 if smoke else 8192
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        print("SUMMARY this torch has no float8_e4m3fn / _scaled_mm")
        return 1
    torch.manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t_bf16 = timeit(lambda: a @ w.t())
    ref = (a.float() @ w.float().t())
    rows = [("bf16", t_bf16, (a @ w.t()).float())]
    fmax = torch.finfo(torch.float8_e4m3fn).max
    for mode in ("tensorwise", "rowwise"):
        try:
            if mode == "tensorwise":
                sa, sw = a.abs().amax().float() / fmax, w.abs().amax().float() / fmax
            else:
                sa, sw = a.abs().amax(1, keepdim=True).float() / fmax, w.abs().amax(1, keepdim=True).float() / fmax
            a8 = (a.float() / sa).to(torch.float8_e4m3fn)
            w8 = (w.float() / sw).to(torch.float8_e4m3fn)
            sw_t = sw if mode == "tensorwise" else sw.t()
            fn = lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw_t, out_dtype=torch.bfloat16)  # noqa: E731
            rows.append((f"e4m3 {mode}", timeit(fn), fn().float()))
        except Exception as e:
            print(f"#   {mode}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    print(f"{'gemm':<18}{'ms':>8}{'TFLOP/s':>9}{'x bf16':>8}{'rel. error':>12}")
    parts = []
    for name, t, out in rows:
        err = ((out - ref).norm() / ref.norm()).item()
        print(f"{name:<18}{t:>8.3f}{2 * n ** 3 / t / 1e9:>9.0f}{t_bf16 / t:>8.2f}{err:>12.2e}")
        parts.append(f"{name} {2 * n ** 3 / t / 1e9:.0f} TF x{t_bf16 / t:.2f} (err {err:.1e})")
    print("SUMMARY " + "; ".join(parts) + " | FP8 training step: not yet (issue 65)")
    return 0 if len(rows) == 3 else 1


if __name__ == "__main__":
    smoke = "--cpu-smoke" in sys.argv
    sys.exit({"attention": attention, "fp8": fp8}[sys.argv[1]](smoke))
