"""First light on a lent GPU: everything that must run on one, in one command of at most 8 minutes.

    python benchmarks/first_light.py --out DIR [--budget 450]

Steps, in order, each in its own process with its own time limit (a step that fails or hangs does
not stop the next), each writing DIR/STEP.txt as it goes and one line to DIR/summary.txt:
  env        install megalite over the machine's torch/triton (no dependencies); versions, GPU name
  selfcheck  every kernel's self-check (kernels/self_check.py) on this GPU, bf16 and fp32: verdicts, seconds
  tests      every CUDA-marked test (pytest -m cuda), failures listed, not stopping at the first
  mfu        whole training steps of the 1.7B GPT of Megatron's H100 table, bf16: megalite (fused),
             megalite --no-fused-kernels, a plain PyTorch GPT (SDPA, autocast, fused AdamW); MFU
             against the bf16 matmul ceiling measured in the same run; where megalite's step goes
  attention  flash attention vs F.scaled_dot_product_attention, 4k and 16k tokens, d 128, causal, GQA
  fp8        torch._scaled_mm (tensorwise, row-wise) against the bf16 GEMM (FP8 training: issue 65)
  bandwidth  the memory-bound kernels' % of copy bandwidth (benchmarks/kernels.py)
Without CUDA it exits at once, naming the missing GPU (exit 3). Exit 0 when every step passed.
"""

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before this folder: its kernels.py would shadow the `kernels` package
STEPS = {  # name: the seconds it may take at most
    "env": 60, "selfcheck": 60, "tests": 170, "mfu": 150, "attention": 45, "fp8": 25, "bandwidth": 70,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="report folder (one file per step, summary.txt)")
    ap.add_argument("--budget", type=float, default=450, help="seconds for all steps together")
    ap.add_argument("--only", nargs="+", choices=list(STEPS), help="run these steps only")
    ap.add_argument("--step", choices=list(STEPS), help=argparse.SUPPRESS)  # one step, in this process
    a = ap.parse_args()
    if a.step:
        return STEP_FNS[a.step]()
    if not a.out:
        ap.error("give the report folder with --out DIR")
    import torch
    if not torch.cuda.is_available():
        print(f"first-light needs a CUDA GPU: torch {torch.__version__} sees none "
              f"(CUDA build: {torch.version.cuda or 'no'}); nothing was run", file=sys.stderr)
        return 3
    os.makedirs(a.out, exist_ok=True)
    deadline = time.time() + a.budget
    failed = 0
    for name, cap in STEPS.items():
        if a.only and name not in a.only:
            continue
        limit = min(cap, deadline - time.time())
        if limit < 10:
            line = f"{name} not-run (budget spent)"
        else:
            start = time.time()
            with open(os.path.join(a.out, f"{name}.txt"), "w") as f:
                env = dict(os.environ, PYTHONUNBUFFERED="1",
                           PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
                try:
                    rc = subprocess.run([sys.executable, os.path.abspath(__file__), "--step", name], cwd=ROOT,
                                        stdout=f, stderr=subprocess.STDOUT, env=env, timeout=limit).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            status = "passed" if rc == 0 else f"timed-out({limit:.0f}s)" if rc == "timeout" else f"failed(rc={rc})"
            line = f"{name} {status} {time.time() - start:.0f}s | {_summary(a.out, name)}"
        failed |= not line.split()[1] == "passed"
        print(line, flush=True)
        with open(os.path.join(a.out, "summary.txt"), "a") as f:
            f.write(line + "\n")
    return 1 if failed else 0


def _summary(out, name):
    """A step's summary line: its last line starting with 'SUMMARY'."""
    lines = [ln for ln in open(os.path.join(out, f"{name}.txt"), errors="replace") if ln.startswith("SUMMARY")]
    return lines[-1][len("SUMMARY"):].strip() if lines else "(no summary line)"


def step_env():
    # no registry there: build with the machine's own setuptools (--use-pep517: setup.py develop re-runs pip
    # with build isolation, which fetches setuptools)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--use-pep517",
                          "--no-build-isolation",
                          "-e", ROOT],
                         capture_output=True, text=True)
    print(pip.stdout + pip.stderr)
    import torch
    import triton
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True)
    print(smi.stdout + smi.stderr)
    p = torch.cuda.get_device_properties(0)
    print(f"SUMMARY {torch.cuda.get_device_name()} sm_{p.major}{p.minor} {p.multi_processor_count} SMs | "
          f"python {sys.version.split()[0]} torch {torch.__version__} cuda {torch.version.cuda} triton "
          f"{triton.__version__} | pip install -e: {'ok' if pip.returncode == 0 else 'FAILED (PYTHONPATH used)'}")
    return 0


def step_selfcheck():
    import torch
    from kernels import self_check
    from kernels.self_check import KERNELS
    bad, times = [], {}
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter, fp32 only
    for dtype in (torch.bfloat16, torch.float32) if dev.type == "cuda" else (torch.float32,):
        start = time.perf_counter()
        for name in KERNELS:
            t = time.perf_counter()
            why = self_check._check(name, dev, dtype)
            print(f"{name:<16}{str(dtype)[6:]:<10}{time.perf_counter() - t:7.2f}s  {why or 'trusted'}", flush=True)
            if why:
                bad.append(f"{name} {str(dtype)[6:]}: {why}")
        times[str(dtype)[6:]] = time.perf_counter() - start
    print(f"SUMMARY {len(KERNELS)} kernels on {dev} in " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items())
          + (" | NOT TRUSTED: " + "; ".join(bad) if bad else " | all trusted"))
    return 1 if bad else 0


def step_tests():
    files = ["tests/kernels", "tests/test_gpt_cuda.py", "tests/test_mappings.py", "tests/test_context_parallel.py"]
    try:
        import xdist  # noqa: F401  (the Triton builds are CPU work: spread them over the cores)
        par = ["-n", "8"]
    except ImportError:
        par = []
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-rfE", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", *par, *files]
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    print(r.stdout[-200000:] + r.stderr[-50000:])
    tail = [ln for ln in r.stdout.splitlines() if ln.startswith("=") or " passed" in ln or " failed" in ln]
    fails = [ln.split(" ")[1] for ln in r.stdout.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    print(f"SUMMARY {tail[-1].strip('= ') if tail else 'no result'}"
          + (f" | failed: {', '.join(fails)}" if fails else ""))
    return r.returncode


def step_mfu():
    from first_light_mfu import run_all
    return run_all()


def step_attention():
    from first_light_kernels import attention
    return attention()


def step_fp8():
    from first_light_kernels import fp8
    return fp8()


def step_bandwidth():
    names = ["layer_norm", "rms_norm", "softmax", "bias_gelu", "swiglu", "rotary", "cross_entropy", "adamw"]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernels.py"), "--no-compile", "--only",
                        *names],
                       capture_output=True, text=True)
    print(r.stdout + r.stderr[-20000:])
    rows = [c for c in (ln.split("|") for ln in r.stdout.splitlines() if ln.startswith("| "))
            if c[6].strip().endswith("%")]
    pct = [f"{c[1].strip()} {c[3].strip()} {c[6].strip()} (x{c[8].strip()} eager)" for c in rows]
    print("SUMMARY % of copy bandwidth: " + ("; ".join(pct) if pct else "no rows"))
    return r.returncode


STEP_FNS = {"env": step_env, "selfcheck": step_selfcheck, "tests": step_tests, "mfu": step_mfu,
            "attention": step_attention, "fp8": step_fp8,
            "bandwidth": step_bandwidth}

if __name__ == "__main__":
    sys.exit(main())
