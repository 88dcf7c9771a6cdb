"""Build every Triton kernel in kernels/ to a real cubin for a GPU target, on a machine without one.

    python tests/kernels/gpu_compile.py --arch 90 [--json out.json] [--only flash] [--sass-dir DIR]

Triton's NVIDIA backend and its bundled ptxas compile for any target the active driver
reports, so this process installs a driver that reports GPUTarget("cuda", arch, 32) and
runs the kernels' own host code (the autograd Functions, forward and backward) on meta
tensors of real model shapes: every launch `kernel[grid](...)` is turned into a warmup,
which builds the cubin and returns before launching anything. The shapes, block sizes,
warps and stages are therefore the ones the host code picks on a GPU. Triton's kernel
cache dedupes identical specializations, so each distinct build is compiled once.

Registers and local memory (spills) come from the bundled cuobjdump's resource usage on the
cubin; shared memory from Triton's metadata (what the launch asks the driver for); each row also
carries the launch's constexpr arguments and the SASS statistics of tests/kernels/cubin_stats.py,
which benchmarks/sm90_report.py turns into instructions per MFLOP (the sm_90 gate,
tests/kernels/test_sm90_report.py, reads the suite's one build of this).
Must build in a process where `kernels` was not imported under TRITON_INTERPRET=1 (build()
sets it to 0 before importing kernels); the test runs it in a subprocess for that reason, and
importing this module changes nothing.
"""
import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

import cubin_stats  # a sibling module: this file runs as a script and is imported from tests/kernels

SMEM_LIMIT = {90: 232448, 80: 166912}  # max dynamic shared memory per block (opt-in), bytes
FP8_GEMMS = {"_blockwise_mm"}  # built for sm_89 and later only (no FP8 type before)
KERNEL_MODULES = ("adamw", "bias_gelu", "cross_entropy", "flash_attention", "flash_attention_bwd",
                  "flash_attention_fwd", "fp8_blockwise", "fp8_cast", "grouped_gemm", "layer_norm", "norm_kernels",
                  "rms_norm", "rotary", "softmax", "swiglu")


class _TargetOnlyDriver:
    """The part of Triton's driver interface a warmup compile touches: it reports a target."""

    def __init__(self, arch):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("meta")


_BUILT = []  # (kernel name, CompiledKernel, its constexpr arguments) of every launch in the current case


def _plain(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def _warmup_instead_of_launch():
    orig = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = orig(self, *args, grid=grid, warmup=True, **kwargs)
        given = {**dict(zip(self.arg_names, args)), **kwargs}  # the block sizes: what the SASS report divides by
        constexprs = {p.name: _plain(given[p.name]) for p in self.params if p.is_constexpr and p.name in given}
        _BUILT.append((self.fn.__name__, kernel, constexprs))
        return kernel

    JITFunction.run = run


def _t(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta").requires_grad_(grad)


def _fwd_bwd(out):
    out.backward(torch.empty_like(out))


# ---- the cases: (group, label, hot, fn) at the shapes real models use -------------------------
def _attn(b, s, h, hk, d, causal=True, dtype=torch.bfloat16, padded=False, dropout=0.0):
    def run(K):
        q, k, v = _t(b, s, h, d, dtype=dtype, grad=True), _t(b, s, hk, d, dtype=dtype, grad=True), \
            _t(b, s, hk, d, dtype=dtype, grad=True)
        kpm = torch.empty(b, s, dtype=torch.bool, device="meta") if padded else None
        kw = {"dropout_p": dropout} if dropout else {}
        _fwd_bwd(K.flash_attention(q, k, v, causal=causal, key_padding_mask=kpm, **kw))
    return run


def _softmax(b, h, s, causal=True, mask=False, dtype=torch.bfloat16):
    def run(K):
        m = torch.empty(b, 1, s, s, dtype=torch.bool, device="meta") if mask else None
        _fwd_bwd(K.softmax(_t(b, h, s, s, dtype=dtype, grad=True), scale=0.125, mask=m, causal=causal))
    return run


def _norm(rows, n, rms, dtype=torch.bfloat16):
    def run(K):
        x, w = _t(rows, n, dtype=dtype, grad=True), _t(n, dtype=dtype, grad=True)
        _fwd_bwd(K.rms_norm(x, w) if rms else K.layer_norm(x, w, _t(n, dtype=dtype, grad=True)))
    return run


def _ce(rows, v, smooth=0.0, dtype=torch.bfloat16):
    def run(K):
        t = torch.empty(rows, dtype=torch.int64, device="meta")
        _fwd_bwd(K.cross_entropy(_t(rows, v, dtype=dtype, grad=True), t, label_smoothing=smooth))
    return run


def _adamw(n, gdtype, out_dtype):
    def run(K):
        p, m, v = (_t(n, dtype=torch.float32) for _ in range(3))
        K.adamw_step(p, _t(n, dtype=gdtype), m, v, step=3, lr=1e-4, grad_scale=0.5,
                     model_params=_t(n, dtype=out_dtype) if out_dtype else None)
    return run


def _rotary(b, s, h, d, r):
    def run(K):
        cos = _t(s, r, dtype=torch.float32)
        _fwd_bwd(K.rotary(_t(b, s, h, d, grad=True), cos, cos))
    return run


def _fp8_cast(dtype, with_amax):
    def run(K):
        importlib.import_module("kernels.fp8_cast").fp8_cast(_t(8192, 4096), _t(dtype=torch.float32), dtype, with_amax)
    return run


def _blockwise(m, k, n, group, a_dtype):
    def run(K):
        kb = -(-k // 128)
        importlib.import_module("kernels.fp8_blockwise").blockwise_mm(
            _t(m, k, dtype=a_dtype), _t(m, kb, dtype=torch.float32), _t(n, k, dtype=torch.float8_e4m3fn).t(),
            _t(kb, -(-n // group), dtype=torch.float32), group, torch.float32 if group == 1 else torch.bfloat16)
    return run


def _grouped(e, rows, n_in, n_out, dtype=torch.bfloat16):
    """An MoE projection: rows routed unevenly over e experts (one gets none), weights [e, n_out, n_in]."""
    def run(K):
        counts = [0] + [rows // (e - 1)] * (e - 1)
        counts[1] += rows - sum(counts)
        gg = importlib.import_module("kernels.grouped_gemm")  # the module: kernels does not re-export it
        _fwd_bwd(gg.grouped_gemm(_t(rows, n_in, dtype=dtype, grad=True), _t(e, n_out, n_in, dtype=dtype, grad=True),
                                 counts))
    return run


# the sm_90 report's production shapes (benchmarks/sm90_report.py) whose configurations another case already
# builds for sm_80 (fp16 beside bf16, non-causal beside causal): built for sm_90 only, to save the suite's time
SM90_REPORT_CASES = [
    ("flash", "d64 causal MHA s4096 fp16", True, _attn(1, 4096, 12, 12, 64, dtype=torch.float16)),
    ("flash", "d64 non-causal MHA s4096 bf16", True, _attn(1, 4096, 12, 12, 64, False)),
    ("flash", "d64 non-causal MHA s4096 fp16", True, _attn(1, 4096, 12, 12, 64, False, dtype=torch.float16)),
    ("flash", "d128 non-causal MHA s4096 bf16", True, _attn(1, 4096, 32, 32, 128, False)),
    ("flash", "d128 non-causal GQA 32:8 s4096 fp16", True, _attn(1, 4096, 32, 8, 128, False, dtype=torch.float16)),
]
CASES = [
    ("flash", "d64 causal MHA s4096 bf16 (GPT-2/BERT heads)", True, _attn(1, 4096, 12, 12, 64)),
    ("flash", "d80 causal s2048 bf16", True, _attn(1, 2048, 32, 32, 80)),
    ("flash", "d96 causal s2048 bf16", True, _attn(1, 2048, 32, 32, 96)),
    ("flash", "d128 causal MHA s4096 bf16 (Llama-7B)", True, _attn(1, 4096, 32, 32, 128)),
    ("flash", "d128 causal GQA 64:8 s8192 bf16 (Llama-70B)", True, _attn(1, 8192, 64, 8, 128)),
    ("flash", "d128 causal GQA 32:8 s4096 fp16", True, _attn(1, 4096, 32, 8, 128, dtype=torch.float16)),
    ("flash", "d64 padded keys non-causal s512 bf16 (BERT)", True, _attn(8, 512, 12, 12, 64, False, padded=True)),
    ("flash", "d256 causal s4096 bf16 (Gemma)", False, _attn(1, 4096, 8, 8, 256)),
    ("flash", "d64 causal dropout 0.1 s2048 bf16 (GPT default)", True, _attn(1, 2048, 12, 12, 64, dropout=0.1)),
    ("flash", "d128 causal GQA dropout 0.1 s4096 bf16", True, _attn(1, 4096, 32, 8, 128, dropout=0.1)),
    ("flash", "d256 causal dropout 0.1 s4096 bf16", False, _attn(1, 4096, 8, 8, 256, dropout=0.1)),
    ("flash", "d64 causal s2048 fp32", True, _attn(1, 2048, 12, 12, 64, dtype=torch.float32)),
    ("flash", "d128 causal s2048 fp32", True, _attn(1, 2048, 32, 32, 128, dtype=torch.float32)),
    ("softmax", "causal s2048 bf16", True, _softmax(1, 16, 2048)),
    ("softmax", "causal s8192 bf16", True, _softmax(1, 8, 8192)),
    ("softmax", "causal s32768 bf16", False, _softmax(1, 1, 32768)),
    ("softmax", "padding mask s512 bf16 (BERT)", True, _softmax(8, 12, 512, causal=False, mask=True)),
    ("softmax", "causal s2048 fp32", True, _softmax(1, 16, 2048, dtype=torch.float32)),
    ("norm", "layer_norm h768 bf16", True, _norm(8192, 768, False)),
    ("norm", "layer_norm h2048 bf16", True, _norm(8192, 2048, False)),
    ("norm", "layer_norm h4096 bf16", True, _norm(8192, 4096, False)),
    ("norm", "layer_norm h8192 bf16", True, _norm(8192, 8192, False)),
    ("norm", "layer_norm h16384 bf16", True, _norm(2048, 16384, False)),
    ("norm", "layer_norm h12288 fp32", True, _norm(2048, 12288, False, dtype=torch.float32)),
    ("norm", "rms_norm h2048 bf16", True, _norm(8192, 2048, True)),
    ("norm", "rms_norm h4096 bf16", True, _norm(8192, 4096, True)),
    ("norm", "rms_norm h8192 bf16", True, _norm(8192, 8192, True)),
    ("norm", "rms_norm h16384 bf16", True, _norm(2048, 16384, True)),
    ("ce", "vocab 50304 bf16", True, _ce(8192, 50304)),
    ("ce", "vocab 128256 bf16, label smoothing", True, _ce(8192, 128256, smooth=0.1)),
    ("ce", "vocab 128256 fp32", True, _ce(4096, 128256, dtype=torch.float32)),
    ("elementwise", "bias_gelu ffn 3072 bf16", True,
     lambda K: _fwd_bwd(K.bias_gelu(_t(8192, 3072, grad=True), _t(3072, grad=True)))),
    ("elementwise", "swiglu ffn 11008 bf16", True, lambda K: _fwd_bwd(K.swiglu(_t(8192, 22016, grad=True)))),
    ("elementwise", "rotary d128 full bf16", True, _rotary(1, 4096, 32, 128, 128)),
    ("elementwise", "rotary d64 half (rotary_percent 0.5) bf16", True, _rotary(1, 2048, 16, 64, 32)),
    ("adamw", "adamw fp32 grads", True, _adamw(1 << 24, torch.float32, None)),
    ("adamw", "adamw bf16 grads -> bf16 params", True, _adamw(1 << 24, torch.bfloat16, torch.bfloat16)),
    ("grouped", "grouped_gemm Mixtral fc1 8 x [28672, 4096], 16384 rows bf16", True,
     _grouped(8, 16384, 4096, 2 * 14336)),
    ("grouped", "grouped_gemm Mixtral fc2 8 x [4096, 14336], 16384 rows fp16", True,
     _grouped(8, 16384, 14336, 4096, dtype=torch.float16)),
    ("grouped", "grouped_gemm 8 x [2048, 1024], 4096 rows fp32", True, _grouped(8, 4096, 1024, 2048, torch.float32)),
    ("fp8", "fp8_cast e4m3 with amax, 8192 x 4096 bf16 (delayed)", True, _fp8_cast(torch.float8_e4m3fn, True)),
    ("fp8", "fp8_cast e5m2, 8192 x 4096 bf16 (a gradient, tensorwise)", True, _fp8_cast(torch.float8_e5m2, False)),
    ("fp8 gemm", "blockwise_mm x [8192, 4096] e4m3 . w^T [4096, 14336] e4m3 (forward)", True,
     _blockwise(8192, 4096, 14336, 128, torch.float8_e4m3fn)),
    ("fp8 gemm", "blockwise_mm dy [8192, 14336] e5m2 . w [14336, 4096] e4m3 (input gradient)", True,
     _blockwise(8192, 14336, 4096, 128, torch.float8_e5m2)),
    ("fp8 gemm", "blockwise_mm dy^T [14336, 8192] e5m2 . x [8192, 4096] e4m3 (weight gradient)", True,
     _blockwise(14336, 8192, 4096, 1, torch.float8_e5m2)),
] + SM90_REPORT_CASES
SM90_REPORT_ONLY = {label for _, label, _, _ in SM90_REPORT_CASES}


def build(arch, only=None, sass_dir=None):
    """Compile every case for sm_<arch>; returns one row per distinct compiled kernel (with its constexpr
    arguments and SASS statistics, tests/kernels/cubin_stats.py), the cases built (each with the rows it
    launched: a build several cases launch is one row), and errors. sass_dir: write each kernel's SASS there."""
    if "kernels" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("gpu_compile.build: kernels was imported under TRITON_INTERPRET=1; run in a fresh process")
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's notice; its default
    triton.runtime.driver.set_active(_TargetOnlyDriver(arch))
    _warmup_instead_of_launch()
    K = importlib.import_module("kernels")
    mods = [importlib.import_module(f"kernels.{m}") for m in KERNEL_MODULES]
    for mod in mods:  # the host code takes its Triton path for these (meta) tensors
        if hasattr(mod, "use_triton"):
            mod.use_triton = lambda *tensors, kernel=None: True
    rows, errors, kerns, seen, cases = [], [], [], {}, []
    for group, label, hot, fn in CASES:
        if only and only not in group and only not in label:
            continue
        if group == "fp8 gemm" and arch < 89:  # (FP8 tensor cores: Ada and Hopper on; megalite's FP8 needs them)
            continue
        if label in SM90_REPORT_ONLY and arch != 90:
            continue
        _BUILT.clear()
        t0 = time.time()
        try:
            fn(K)
        except Exception as e:  # noqa: BLE001 - reported, and the test fails on it
            errors.append({"arch": arch, "case": label, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            continue
        launched = []  # this case's builds (indices into rows) in launch order, those of earlier cases too
        for name, kern, constexprs in _BUILT:
            if id(kern) not in seen:
                regs, local = cubin_stats.resources(kern.asm["cubin"])
                md = kern.metadata
                seen[id(kern)] = len(rows)
                rows.append({"arch": arch, "kernel": name, "case": label, "group": group, "hot": hot,
                             "regs": regs, "spill_bytes": local, "shared": md.shared, "num_warps": md.num_warps,
                             "num_stages": md.num_stages, "constexprs": constexprs,
                             "seconds": round(time.time() - t0, 2)})
                kerns.append(kern)
                t0 = time.time()
            launched += [seen[id(kern)]] if seen[id(kern)] not in launched else []
        cases.append({"case": label, "group": group, "hot": hot, "rows": launched})
    _add_sass(rows, kerns, arch, sass_dir)
    built = {r["kernel"] for r in rows}
    unbuilt = [] if only else sorted(set(_launchable(mods)) - built - (FP8_GEMMS if arch < 89 else set()))
    return {"arch": arch, "triton": triton.__version__, "smem_limit": SMEM_LIMIT[arch], "rows": rows,
            "cases": cases, "errors": errors, "unbuilt": unbuilt}


def _add_sass(rows, kernels, arch, sass_dir):
    """Every row's SASS statistics, from one disassembly of all the cubins (nvdisasm's start-up is the cost)."""
    if not kernels:
        return
    listings = cubin_stats.disassemble([k.asm["cubin"] for k in kernels], arch)
    for i, (row, listing) in enumerate(zip(rows, listings)):
        row["sass"] = cubin_stats.stats(listing)
        if sass_dir:
            os.makedirs(sass_dir, exist_ok=True)
            with open(os.path.join(sass_dir, f"sm{arch}_{i:03d}{row['kernel']}.sass"), "w") as f:
                f.write(f"// {row['kernel']}: {row['case']}\n// {row['constexprs']}\n")
                f.write(cubin_stats.listing_text(listing) + "\n")


def _launchable(mods):
    """Names of the @triton.jit kernels the host code launches: those no other jit function calls."""
    jits = {}
    for mod in mods:
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and obj.__module__ == mod.__name__:
                jits[name] = obj.src
    return [n for n in jits if not any(re.search(rf"\b{n}\(", src) for m, src in jits.items() if m != n)]


def table(results):
    lines = ["| arch | kernel | case (first to need this build) | regs | spill B | shared B | warps | stages |",
             "|---|---|---|--:|--:|--:|--:|--:|"]
    for res in results:
        for r in res["rows"]:
            lines.append(f"| sm_{r['arch']} | {r['kernel']} | {r['case']} | {r['regs']} | {r['spill_bytes']} | "
                         f"{r['shared']} | {r['num_warps']} | {r['num_stages']} |")
        for e in res["errors"]:
            lines.append(f"| sm_{e['arch']} | FAILED | {e['case']} | {e['error'][:200]} | | | | |")
    return "\n".join(lines)


def _per_arch_processes(archs, only, sass_dir):
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for arch in archs:
            cmd = [sys.executable, os.path.abspath(__file__), "--arch", str(arch), "--json", f"{tmp}/{arch}.json"]
            cmd += (["--only", only] if only else []) + (["--sass-dir", sass_dir] if sass_dir else [])
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        for p in procs:
            p.wait()
        results = []
        for arch, p in zip(archs, procs):
            try:
                with open(f"{tmp}/{arch}.json") as f:
                    results += json.load(f)
            except OSError:
                results.append({"arch": arch, "triton": triton.__version__, "smem_limit": SMEM_LIMIT[arch],
                                "rows": [], "unbuilt": [], "errors": [{"arch": arch, "case": "(all)",
                                                        "error": f"build process exited {p.returncode}"}]})
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(SMEM_LIMIT),
                    help="several: one process per arch, run side by side (a target is fixed per process)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", help="only cases whose group or label contains this")
    ap.add_argument("--sass-dir", help="write every built kernel's SASS here, one file each")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # triton has read it already: start afresh
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run([sys.executable, os.path.abspath(__file__)] + (sys.argv[1:] if argv is None else argv),
                              env=env).returncode
    if len(a.arch) == 1:
        results = [build(a.arch[0], a.only, a.sass_dir)]
    else:
        results = _per_arch_processes(a.arch, a.only, a.sass_dir)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f)
    print(f"triton {triton.__version__}")
    print(table(results))
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
