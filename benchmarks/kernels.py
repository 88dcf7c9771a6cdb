"""Kernel benchmark: megalite's Triton kernels vs PyTorch eager, torch.compile (and Liger-Kernel /
flash-attn when importable), all in one process on one GPU.

    python benchmarks/kernels.py [--only NAME ...] [--no-compile] [--cpu-smoke]

Prints, per kernel and shape: forward and forward+backward time, achieved GB/s (the bytes our kernels
move / time) as % of the copy bandwidth measured in this run (attention: TFLOP/s), speed ratios vs the
baselines, and for cross-entropy the peak extra memory vs unfused. Times are device time per call from
many calls per measurement (gpu_timer.py: a CUDA graph of the calls, replayed), so host dispatch is not in
them; only the call itself is timed (inputs and the output gradient are made before). Bytes are counted as
our kernels move them: every tensor read and written, the statistics, the norms' per-program partial dW
rows and their sum, bias_gelu's bias-gradient sum.
Without CUDA it prints one line and exits 0; --cpu-smoke runs the fallbacks at tiny shapes
on CPU to check the script itself. Works with torch >= 2.4 and triton >= 3.0.
"""
import argparse
import importlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402
from kernels.softmax import _softmax_torch  # noqa: E402
from gpu_timer import call_ms  # noqa: E402


def timeit(fn, dev=None):
    """Median device milliseconds of one call of fn (wall time on CPU)."""
    return call_ms(fn)[0]


def copy_bandwidth(dev, nbytes):
    x = torch.empty(nbytes // 4, device=dev, dtype=torch.float32)
    y = torch.empty_like(x)
    ms = timeit(lambda: y.copy_(x), dev)
    return 2 * nbytes / ms / 1e6  # GB/s (read + write)


def norm_bytes(x, bias):
    """(forward, forward+backward) bytes of kernels.layer_norm / rms_norm on x [m, n] as its kernels move them:
    x read, y written, fp32 mean (LayerNorm) and rstd written; backward x, dy and the statistics read, dx
    written, each program's fp32 partial dW (dB) row written then read by the sum, dW (dB) written."""
    ln = importlib.import_module("kernels.layer_norm")
    m, n = x.shape
    es, stats, params = x.element_size(), 2 if bias else 1, 2 if bias else 1
    g = ln.backward_programs(x, not bias) if x.is_cuda else 1
    fwd = 2 * m * n * es + params * n * es + stats * 4 * m
    bwd = 3 * m * n * es + stats * 4 * m + n * es + params * (2 * g * n * 4 + n * es)
    return fwd, fwd + bwd


def _optional(name):
    try:
        if name == "liger":
            import liger_kernel.transformers.functional as lf
            return lf
        if name == "flash_attn":
            from flash_attn import flash_attn_func
            return flash_attn_func
    except Exception:
        return None


def cases(dev, dt, smoke):
    """(name, shape text, make() -> (inputs, dict of fns), bytes fwd, bytes fwd+bwd, flops fwd)."""
    S = (lambda big, small: small if smoke else big)
    liger, fa = _optional("liger"), _optional("flash_attn")
    out = []
    m, n = S((4096, 8192), (37, 1000))
    es = torch.tensor([], dtype=dt).element_size()
    nb_ln = norm_bytes(torch.empty(m, n, device=dev, dtype=dt), True)
    nb_rms = norm_bytes(torch.empty(m, n, device=dev, dtype=dt), False)

    def norm_inputs(bias):
        x = torch.randn(m, n, device=dev, dtype=dt, requires_grad=True)
        w = torch.randn(n, device=dev, dtype=dt, requires_grad=True)
        b = torch.randn(n, device=dev, dtype=dt, requires_grad=True) if bias else None
        return x, w, b

    def ln():
        x, w, b = norm_inputs(True)
        fns = {"ours": lambda: kernels.layer_norm(x, w, b, 1e-5),
               "eager": lambda: F.layer_norm(x, (n,), w, b, 1e-5)}
        if liger:
            fns["liger"] = lambda: liger.liger_layer_norm(x, w, b, 1e-5)
        return [x, w, b], fns
    out.append(("layer_norm", f"{m}x{n}", ln, *nb_ln, None))

    def rms():
        x, w, _ = norm_inputs(False)
        fns = {"ours": lambda: kernels.rms_norm(x, w, 1e-5),
               "eager": lambda: F.rms_norm(x, (n,), w, 1e-5)}
        if liger:
            fns["liger"] = lambda: liger.liger_rms_norm(x, w, 1e-5)
        return [x, w], fns
    out.append(("rms_norm", f"{m}x{n}", rms, *nb_rms, None))

    b, h, s = S((4, 32, 2048), (3, 2, 100))

    def sm():
        x = torch.randn(b, h, s, s, device=dev, dtype=dt, requires_grad=True)
        return [x], {"ours": lambda: kernels.softmax(x, 0.125, None, True),
                     "eager": lambda: _softmax_torch(x, 0.125, None, True)}  # Megatron's torch path
    out.append(("softmax causal", f"{b}x{h}x{s}x{s}", sm, 2 * b * h * s * s * es, 5 * b * h * s * s * es, None))

    t, f = S((8 * 2048, 16384), (37, 1000))

    def bg():
        x = torch.randn(t, f, device=dev, dtype=dt, requires_grad=True)
        bias = torch.randn(f, device=dev, dtype=dt, requires_grad=True)
        return [x, bias], {"ours": lambda: kernels.bias_gelu(x, bias),
                           "eager": lambda: F.gelu(x + bias, approximate="tanh")}
    # backward: x, dy read, dx written, then dx read again by the bias gradient's sum
    out.append(("bias_gelu", f"{t}x{f}", bg, 2 * t * f * es + f * es, 6 * t * f * es + f * (2 * es + 4), None))

    t2, f2 = S((8192, 14336), (37, 1000))

    def sw():
        x = torch.randn(t2, 2 * f2, device=dev, dtype=dt, requires_grad=True)

        def eager():
            g, u = x.chunk(2, -1)
            return F.silu(g) * u
        fns = {"ours": lambda: kernels.swiglu(x), "eager": eager}
        if liger:
            fns["liger"] = lambda: liger.liger_swiglu(*x.chunk(2, -1))
        return [x], fns
    out.append(("swiglu", f"{t2}x2*{f2}", sw, 3 * t2 * f2 * es, 8 * t2 * f2 * es, None))

    rb, rs, rh, rd = S((4, 4096, 32, 128), (3, 100, 4, 64))

    def rot():
        x = torch.randn(rb, rs, rh, rd, device=dev, dtype=dt, requires_grad=True)
        ang = torch.arange(rs, device=dev)[:, None] * torch.rand(rd // 2, device=dev)
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos(), ang.sin()
        return [x], {"ours": lambda: kernels.rotary(x, cos, sin), "eager": lambda: _rot_eager(x, cos, sin)}
    nb, cs = rb * rs * rh * rd * es, 2 * rs * rd * 4  # x; fp32 cos and sin, read once a position
    out.append(("rotary", f"{rb}x{rs}x{rh}x{rd}", rot, 2 * nb + cs, 4 * nb + 2 * cs, None))

    cn, cv = S((8 * 2048, 131072), (37, 1000))

    def ce():
        x = torch.randn(cn, cv, device=dev, dtype=dt, requires_grad=True)
        tg = torch.randint(0, cv, (cn,), device=dev)
        # ours as training runs it, the gradient written over the logits (inplace_backward): every call after
        # the first reads the last one's gradient as its logits, which costs the same; so does Liger, which
        # writes it there in its forward. Nothing but the loss and its gradient is timed.
        fns = {"ours": lambda: kernels.cross_entropy(x, tg, inplace_backward=True),
               "eager": lambda: F.cross_entropy(x, tg, reduction="none")}
        if liger:
            fns["liger"] = lambda: liger.liger_cross_entropy(x, tg, reduction="mean")
        return [x], fns
    # forward: logits read, targets read, 3 fp32 statistics written; backward: logits read, gradient written
    out.append(("cross_entropy", f"{cn}x{cv}", ce, cn * cv * es + cn * (8 + 12), 3 * cn * cv * es + cn * 28, None))

    for sa in S((2048, 4096, 8192, 16384), (100,)):
        ab, ah, ahk, ad = S((4, 32, 32, 128), (3, 4, 1, 64))

        def att(sa=sa, ab=ab, ah=ah, ahk=ahk, ad=ad):
            q = torch.randn(ab, sa, ah, ad, device=dev, dtype=dt, requires_grad=True)
            k = torch.randn(ab, sa, ahk, ad, device=dev, dtype=dt, requires_grad=True)
            v = torch.randn(ab, sa, ahk, ad, device=dev, dtype=dt, requires_grad=True)
            qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
            fns = {"ours": lambda: kernels.flash_attention(q, k, v, causal=True),
                   "eager": lambda: _sdpa(qt, kt, vt, dev)}
            if fa:
                fns["flash_attn"] = lambda: fa(q, k, v, causal=True)
            return [q, k, v, qt, kt, vt], fns
        flops = 4 * ab * ah * sa * sa * ad / 2  # causal
        out.append(("flash_attention causal", f"B{ab} H{ah} S{sa} d{ad}", att, None, None, flops))
    return out


def _rot_eager(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos[:, None, :] + torch.cat((-x2, x1), -1) * sin[:, None, :]


def _sdpa(q, k, v, dev):
    """SDPA, restricted to its flash backend on CUDA (the baseline the issue names)."""
    if dev == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def fwd_bwd(fn, inputs):
    """fn's forward and backward, the output gradient made once, before (not a fill inside the timing)."""
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    dy = torch.randn_like(fn()).detach()

    def run():
        y = fn()
        # inputs outside this fn's graph (the other layout's copies) just get None
        torch.autograd.grad(y, leaves, dy, allow_unused=True)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", help="kernel names to run (prefix match)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, fallbacks only")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("benchmarks/kernels.py needs a CUDA GPU (none found); nothing measured. "
              "Use --cpu-smoke to check the script on CPU.")
        return 0
    dev = "cpu" if args.cpu_smoke else "cuda"
    kernels.set_kernel_choice("triton")  # "ours" is the Triton kernel itself, not whichever path the race picks
    dt = torch.float32 if args.cpu_smoke else torch.bfloat16
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (smoke: torch fallbacks, not a measurement)"
    bw = copy_bandwidth(dev, (1 << 20) if args.cpu_smoke else (1 << 30))
    print(f"# device: {name} | torch {torch.__version__} | dtype {dt} | copy bandwidth {bw:.0f} GB/s")
    hdr = ("kernel", "shape", "pass", "ours ms", "GB/s|TF/s", "%copy", "eager ms", "x eager",
           "compile ms", "x compile", "other", "timed by")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for kname, shape, make, b_f, b_fb, flops in cases(dev, dt, args.cpu_smoke):
        if args.only and not any(kname.startswith(o) for o in args.only):
            continue
        inputs, fns = make()
        compiled = None
        if not args.no_compile and not args.cpu_smoke:
            compiled = torch.compile(fns["eager"])
        for pas, nbytes, mult in (("fwd", b_f, 1.0), ("fwd+bwd", b_fb, 3.5)):
            hows = set()

            def timed(fn):
                try:
                    ms, how = call_ms(fn if pas == "fwd" else fwd_bwd(fn, inputs))
                    hows.add(how)
                    return ms
                except Exception as e:  # a baseline that cannot run this case is reported, not fatal
                    print(f"#   {kname} {pas}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    return float("nan")
            ours = timed(fns["ours"])
            eager = timed(fns["eager"])
            comp = timed(compiled) if compiled is not None else float("nan")
            if flops is not None:
                rate, pct = f"{flops * mult / ours / 1e9:.0f} TF", "-"
            else:
                gbs = nbytes / ours / 1e6
                rate, pct = f"{gbs:.0f}", f"{100 * gbs / bw:.0f}%"
            other = "; ".join(f"{k} x{timed(f) / ours:.2f}" for k, f in fns.items() if k not in ("ours", "eager"))
            print(f"| {kname} | {shape} | {pas} | {ours:.3f} | {rate} | {pct} | {eager:.3f} | "
                  f"{eager / ours:.2f} | {comp:.3f} | {comp / ours:.2f} | {other or '-'} | {'/'.join(sorted(hows))} |")
        if kname == "cross_entropy" and dev == "cuda":
            print(f"# cross_entropy peak extra memory, fwd+bwd: {ce_peak(fns, inputs)}")
        del inputs, fns, compiled
        if dev == "cuda":
            torch.cuda.empty_cache()
    if not args.only or any("adamw".startswith(o) for o in args.only):
        bench_adamw(dev, bw, args.cpu_smoke)
    if not args.only or any("fp8_cast".startswith(o) for o in args.only):
        bench_fp8_cast(dev, bw, args.cpu_smoke)
    if not args.only or any("fp8_blockwise".startswith(o) for o in args.only):
        bench_fp8_blockwise(dev, args.cpu_smoke)
    return 0


def bench_fp8_cast(dev, bw, smoke):
    """An FP8 GEMM operand's quantization (megalite/tensor_parallel/fp8.py): the fused cast (and, delayed, amax)
    kernel vs torch's ops (multiply, clamp, cast; amax), a bf16 activation of a Llama-8B layer."""
    from kernels.fp8_cast import fp8_cast, _torch
    m, n = (37, 1000) if smoke else (8192, 4096)
    x = torch.randn(m, n, device=dev, dtype=torch.float32 if smoke else torch.bfloat16)
    s = torch.tensor(3.0, device=dev)
    print("| fp8 cast | shape | ours ms | GB/s | %copy | torch ms | x torch |\n|---|---|---|---|---|---|---|")
    for label, amax in (("tensorwise (cast)", False), ("delayed (cast + amax)", True)):
        ours = timeit(lambda: fp8_cast(x, s, torch.float8_e4m3fn, amax), dev)
        eager = timeit(lambda: _torch(x, s, torch.float8_e4m3fn, amax), dev)
        gbs = x.numel() * (x.element_size() + 1) / ours / 1e6  # (x read once, one byte written an element)
        print(f"| {label} | {m}x{n} | {ours:.3f} | {gbs:.0f} | {100 * gbs / bw:.0f}% | {eager:.3f} | "
              f"{eager / ours:.2f} |")


def bench_fp8_blockwise(dev, smoke):
    """DeepSeek-V3's blockwise-scaled FP8 GEMM (kernels/fp8_blockwise.py) at 4096 x 8192 x 16384 against bf16's
    GEMM and torch._scaled_mm's tensorwise FP8 GEMM (cuBLASLt), and against its own fallback (dequantize, then an
    fp32 GEMM: what --fp8-recipe blockwise ran before the kernel)."""
    from kernels.fp8_blockwise import blockwise_mm, _torch
    m, k, n = (64, 256, 128) if smoke else (4096, 8192, 16384)
    e4 = torch.float8_e4m3fn
    a, b = torch.randn(m, k, device=dev).to(e4), torch.randn(n, k, device=dev).to(e4).t()
    sa, sb = torch.rand(m, k // 128, device=dev), torch.rand(k // 128, n // 128, device=dev)
    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
    one = torch.ones((), device=dev)
    runs = {"blockwise (ours)": lambda: blockwise_mm(a, sa, b, sb, 128, torch.bfloat16),
            "bf16 GEMM": lambda: ab @ bb,
            "tensorwise _scaled_mm": lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                              out_dtype=torch.bfloat16),
            "fallback (dequantize + fp32)": lambda: _torch(a, sa, b, sb, 128, torch.bfloat16)}
    ms = {name: timeit(fn, dev) for name, fn in runs.items()}
    print(f"| fp8 GEMM {m}x{k}x{n} | ms | TFLOP/s | x ours |\n|---|---|---|---|")
    for name, t in ms.items():
        print(f"| {name} | {t:.3f} | {2 * m * n * k / t / 1e9:.0f} | {t / ms['blockwise (ours)']:.2f} |")


def bench_adamw(dev, bw, smoke):
    """Fused step on one flat fp32 buffer (+ bf16 model copy) vs torch.optim.AdamW foreach / fused."""
    n = 1001 if smoke else 1 << 28
    p, g = torch.randn(n, device=dev), torch.randn(n, device=dev)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    model = torch.empty(n, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    hp = dict(lr=1e-4, weight_decay=0.1)
    ours = timeit(lambda: kernels.adamw_step(p, g, m, v, step=10, model_params=model, **hp), dev)
    res = []
    for impl in ("foreach", "fused"):
        ref = p.clone().requires_grad_()
        ref.grad = g.clone()
        try:
            opt = torch.optim.AdamW([ref], **{impl: True}, **hp)
            t = timeit(opt.step, dev)
            res.append(f"{impl} {t:.3f} ms (x{t / ours:.2f})")
        except Exception as e:
            res.append(f"{impl} n/a ({type(e).__name__})")
    gbs = n * (24 + 4 + model.element_size()) / ours / 1e6
    print(f"# adamw_step {n} params: ours {ours:.3f} ms, {gbs:.0f} GB/s = {100 * gbs / bw:.0f}% of copy "
          f"(torch.optim.AdamW step without the model-copy cast: {'; '.join(res)})")


def ce_peak(fns, inputs):
    res = {}
    for k in ("ours", "eager"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd(fns[k], inputs)()
        torch.cuda.synchronize()
        res[k] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return f"ours {res['ours']:.2f} GiB, unfused {res['eager']:.2f} GiB, ratio {res['ours'] / res['eager']:.2f}"


if __name__ == "__main__":
    sys.exit(main())
