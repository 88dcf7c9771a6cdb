"""megalite side by side with PyTorch's native parallelism (the stack torchtitan composes): the same
Llama-shaped model, the same initial weights, the same batches, on 4 CPU ranks (gloo) or, with --device cuda,
on GPUs (NCCL; a layout's ranks each need a GPU: `one` on a single GPU), in one run.

Both stacks run as a user runs them, under `torchrun`: megalite through `pretrain_gpt.py` (its data
loader, logging, --log-json), PyTorch-native through `benchmarks/peers_native.py` (FSDP2 `fully_shard`,
DTensor `parallelize_module`, `torch.distributed.pipelining`, `context_parallel`), each wrapped by
`benchmarks/peers_meter.py`, which measures both alike: peak RSS per rank; in separate metered runs
(so the timed runs carry no hooks) the bytes each rank sends per step (every c10d op either stack
issues, as ring wire bytes; one step = a run of --iters + 1 iterations minus one of --iters) and the
peak of the activation bytes autograd keeps saved for backward (weights left out: see the meter).

Initial weights: a seeded `transformers` LlamaForCausalLM (peers_native.save_initial) that the native
model loads directly and megalite loads after `tools/convert_checkpoint.py --loader hf` (with
`--finetune --use-checkpoint-args`: no model-size flags). Batches: megalite's own training samples
of the default corpus (pretrain_gpt.datasets_provider, as the sampler reads them), handed to the
native script as one tensor. AdamW, constant LR, no clipping, fp32, no dropout on both.

Per layout, alternating megalite / native for --reps repetitions: median step time after --warmup
iterations, peak RSS per rank (largest rank) with glibc's default allocator and with
MALLOC_MMAP_THRESHOLD_=131072, saved-for-backward peak and bytes per step (largest rank), and the
losses of both over the steps (largest relative difference). On a GPU the memory figure is the device's
peak allocated bytes (torch.cuda.max_memory_allocated) and the mmap run is left out.

    python benchmarks/peers.py [--layouts fsdp tp_sp pp tp_pp cp --reps 2 --iters 8]
    python benchmarks/peers.py --device cuda --layouts one [sizes]     # one GPU
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import functools
import glob
import json
import math
import shutil
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}
ZERO1, ZERO3 = ("--use-distributed-optimizer",), ("--use-distributed-optimizer", "--zero-stage", "3")
# name: (shown, megalite's parallel flags, peers_native.py --layout). Under PP torchtitan keeps FSDP2's
# parameters unsharded through the step (no resharding after forward, one gradient reduce-scatter per step):
# what megalite's ZeRO-1 does; pp_zero3 shows megalite's ZeRO-3 against the same native run.
LAYOUTS = {
    "fsdp": ("DP4, ZeRO-3 / FSDP2", ZERO3, "fsdp"),
    "tp_sp": ("TP2 + SP x DP2, ZeRO-3 / FSDP2", ("--tensor-model-parallel-size", "2", "--sequence-parallel") + ZERO3,
              "tp_sp"),
    "pp": ("PP2 1F1B x DP2, ZeRO-1 / FSDP2 unsharded in the step", ("--pipeline-model-parallel-size", "2") + ZERO1,
           "pp"),
    "pp_zero3": ("PP2 1F1B x DP2, ZeRO-3 / FSDP2 unsharded in the step",
                 ("--pipeline-model-parallel-size", "2") + ZERO3, "pp"),
    "tp_pp": ("TP2 + SP x PP2", ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--pipeline-model-parallel-size", "2"), "tp_pp"),
    "cp": ("CP2 x DP2, ZeRO-3 / FSDP2", ("--context-parallel-size", "2") + ZERO3, "cp"),
    "one": ("one rank, ZeRO-3 / FSDP2", ZERO3, "one"),
}


def _hyper(a):
    """The optimizer's flags, the same for both stacks."""
    return ["--lr", str(a.lr), "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--adam-eps", "1e-8"]


def _megalite_flags(a, init, iters, layout, log_json):
    return ["--load", init, "--finetune", "--use-checkpoint-args", "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(a.global_batch),
            "--train-iters", str(iters), "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--clip-grad", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234", "--log-interval", "1",
            "--eval-iters", "0", "--num-workers", "0", "--log-json", log_json,
            "--distributed-backend", "nccl" if a.device == "cuda" else "gloo"] + _hyper(a) + list(LAYOUTS[layout][1])


def _native_flags(a, hf, batches, layout):
    return ["--layout", LAYOUTS[layout][2], "--init", hf, "--batches", batches, "--device", a.device,
            "--micro-batch-size", str(a.micro_batch)] + _hyper(a)


def _ranks(layout):
    """How many ranks a layout takes (the product of its mesh sizes in peers_native.py)."""
    return math.prod(_native_module().LAYOUTS[LAYOUTS[layout][2]].values())


class Refused(Exception):
    """peers_native.py cannot run a layout here; its rank 0 said why in one line (the message)."""


def _launch(work, tag, script, flags, meter=(), env=None, nproc=4):
    """torchrun nproc ranks of `script` under the meter; -> (stdout, [per-rank meter dicts])."""
    out = os.path.join(work, tag)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(BENCH, "peers_meter.py"), "--out", out, *meter, "--", script, *flags]
    p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    last = (p.stdout.strip().splitlines() or [""])[-1]
    if p.returncode != 0 and script.endswith("peers_native.py") and last and not last.startswith("{"):
        raise Refused(last)
    if p.returncode != 0:
        raise SystemExit(f"{tag} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    ranks = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "rank*.json")))]
    return p.stdout, ranks


def _prepare(a, work):
    """The initial HF checkpoint, its megalite conversion and the batches megalite will read."""
    import torch

    peers_native = _native_module()
    hf, init = os.path.join(work, "hf"), os.path.join(work, "megalite_init")
    batches_file = os.path.join(work, "batches.pt")
    import pretrain_gpt
    from megalite.cli.parser import parse_args
    model = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
             "--max-position-embeddings", str(a.seq)]
    args = parse_args(model + _megalite_flags(a, init, a.iters, "fsdp", os.devnull)[4:], world_size=1)  # samples only
    train = pretrain_gpt.datasets_provider(args, [a.iters * a.global_batch, 0, 0])[0]
    samples = [torch.as_tensor(train[i]["text"]) for i in range(a.iters * a.global_batch)]
    torch.save(torch.stack(samples).view(a.iters, a.global_batch, a.seq + 1), batches_file)
    peers_native.save_initial(hf, a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, args.vocab_size, a.seq, seed=0)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--loader", "hf",
                        "--saver", "megalite", "--load-dir", hf, "--save-dir", init], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"conversion failed: {p.stderr[-2000:]}")
    return hf, init, batches_file


@functools.cache
def _native_module():
    """benchmarks/peers_native.py by its path (benchmarks/ on sys.path would shadow the `kernels` package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("peers_native", os.path.join(BENCH, "peers_native.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _megalite_steps(log_json):
    rows = [json.loads(line) for line in open(log_json) if line.strip()]
    return [(r["lm loss"], r["iteration-time"] * 1e3) for r in rows if "lm loss" in r]


def _native_steps(stdout):
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return [(r["loss"], r["step_ms"]) for r in rows]


def _run(a, work, hf, init, batches, layout, stack, tag, iters, meter=(), env=None):
    """One launch of one stack; -> (steps [(loss, ms)], per-rank meter dicts)."""
    if stack == "megalite":
        log_json = os.path.join(work, f"{tag}.jsonl")
        if os.path.exists(log_json):
            os.remove(log_json)
        _, ranks = _launch(work, tag, os.path.join(ROOT, "pretrain_gpt.py"),
                           _megalite_flags(a, init, iters, layout, log_json), meter, env, _ranks(layout))
        return _megalite_steps(log_json), ranks
    flags = _native_flags(a, hf, batches, layout) + ["--iterations", str(iters)]
    stdout, ranks = _launch(work, tag, os.path.join(BENCH, "peers_native.py"), flags, meter, env, _ranks(layout))
    return _native_steps(stdout), ranks


def _largest(ranks, key):
    return max(r[key] for r in ranks)


def measure(a, work, hf, init, batches, layout):
    """Both stacks, or megalite alone where the native one refuses the layout (res["refused"]: its line)."""
    stacks = ["megalite", "native"]
    res = {s: {"ms": [], "rss": [], "losses": None} for s in stacks}
    res["refused"] = None
    for rep in range(a.reps):
        for stack in list(stacks):  # alternating, so drifts of the machine hit both
            try:
                steps, ranks = _run(a, work, hf, init, batches, layout, stack, f"{layout}_{stack}_{rep}", a.iters)
            except Refused as e:
                print(f"{layout}: PyTorch-native: {e}")
                res["refused"] = str(e)
                stacks.remove(stack)
                del res[stack]
                continue
            res[stack]["ms"] += [ms for _, ms in steps[a.warmup:]]
            res[stack]["rss"].append(_largest(ranks, "peak_cuda_bytes" if a.device == "cuda" else "peak_rss_bytes"))
            res[stack]["losses"] = [loss for loss, _ in steps]
    for stack in stacks:
        res[stack]["rss_mmap"] = None  # glibc's heap holds no device memory
        if a.device == "cpu":
            _, ranks = _run(a, work, hf, init, batches, layout, stack, f"{layout}_{stack}_mmap", a.warmup + 2, env=MMAP)
            res[stack]["rss_mmap"] = _largest(ranks, "peak_rss_bytes")
        per = []
        for iters in (2, 3):
            _, ranks = _run(a, work, hf, init, batches, layout, stack, f"{layout}_{stack}_bytes{iters}", iters,
                            meter=("--bytes", "--saved"))
            per.append(ranks)
        res[stack]["bytes"] = max(b["bytes"]["total_wire_bytes"] - s["bytes"]["total_wire_bytes"]
                                  for s, b in zip(*per))
        res[stack]["by_op"] = {op: v["wire_bytes"] for op, v in per[1][0]["bytes"]["by_op"].items()}
        res[stack]["saved"] = max(r["saved"]["peak_saved_bytes"] for r in per[1])
    return res


def _mib(b):
    return None if b is None else b / 2 ** 20


def report(results, a):
    print(f"\n{a.layers} layers, hidden {a.hidden}, {a.heads} heads ({a.kv_heads} kv), ffn {a.ffn}, seq {a.seq}, "
          f"global batch {a.global_batch}, micro-batch {a.micro_batch}; "
          f"{'GPUs (NCCL)' if a.device == 'cuda' else 'CPU ranks (gloo)'}; medians of "
          f"{a.reps} x {a.iters - a.warmup} steps; memory and bytes: the largest rank")
    memory = "peak GPU MiB allocated" if a.device == "cuda" else "peak RSS MiB"
    head = ("layout", "step ms (megalite / native = ratio)", memory, "RSS MiB, mmap'd blocks",
            "activations saved for backward MiB", "sent MiB per step", "losses: max rel. diff")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for layout, r in results.items():
        m, n = r["megalite"], r.get("native")
        cells = [LAYOUTS[layout][0]]
        for f in (lambda s: statistics.median(s["ms"]), lambda s: _mib(min(s["rss"])), lambda s: _mib(s["rss_mmap"]),
                  lambda s: _mib(s["saved"]), lambda s: _mib(s["bytes"])):
            x = f(m)
            if x is None:
                cells.append("-")
                continue
            cells.append(f"{x:.1f} / {f(n):.1f} = {x / f(n):.2f}" if n and f(n) else
                         f"{x:.1f} / {f(n):.1f}" if n else f"{x:.1f} / -")
        if n:
            diff = max(abs(p - q) / abs(q) for p, q in zip(m["losses"], n["losses"]))
            cells.append(f"{diff:.1e} ({m['losses'][0]:.4f} -> {m['losses'][-1]:.4f})")
        else:
            cells.append(f"- ({m['losses'][0]:.4f} -> {m['losses'][-1]:.4f}); PyTorch-native: {r['refused']}")
        print("| " + " | ".join(cells) + " |")


def _cuda_count():
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible")
    return torch.cuda.device_count()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=None, choices=list(LAYOUTS),
                   help="default: every layout but pp_zero3 that the ranks fit (4 CPU ranks; GPUs: one each)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: every rank on its own GPU (NCCL)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--keep", default=None, help="work in this directory and keep it")
    a = p.parse_args()
    if a.layouts is None:
        ranks = 4 if a.device == "cpu" or _cuda_count() >= 4 else 1
        a.layouts = [k for k in LAYOUTS if k != "pp_zero3" and _ranks(k) == ranks]
    if a.iters <= a.warmup:
        raise SystemExit(f"--iters {a.iters} must exceed --warmup {a.warmup}")
    work = a.keep or tempfile.mkdtemp(prefix="peers_")
    os.makedirs(work, exist_ok=True)
    hf, init, batches = _prepare(a, work)
    results = {}
    for layout in a.layouts:
        results[layout] = measure(a, work, hf, init, batches, layout)
        print(f"{layout}: done", flush=True)
    report(results, a)
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
