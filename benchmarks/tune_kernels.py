"""Re-tune the kernels' launch configurations on this GPU and rewrite kernels/tuned_configs.json for it.

    python benchmarks/tune_kernels.py [--budget 110] [--dtypes bfloat16 float16] [--only rms_norm] [--out PATH]
    python benchmarks/tune_kernels.py --cpu-smoke     # the interpreter on tiny shapes: checks the script runs

Every space registered with kernels/tuned.py (the norms' today; attention's once it registers one), for each of
its buckets and dtypes: the valid configurations are timed with triton.testing.do_bench on the space's own
inputs, the default first, then the others nearest the default first, and the fastest is kept. The search
stops at the budget (compiles included; the whole command stays under two minutes), each key given a share of
what is left in proportion to its space's size: a key it did not reach keeps its previous entry, a key cut
short keeps the best it timed. Only this device's entries are rewritten;
other devices' stay. One line per key: the choice, its time, the default's, the gain. Without CUDA it prints
one line naming the missing GPU and exits 0 (the table unchanged).
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before this folder: its kernels.py would shadow the `kernels` package


def _keys(spaces, dtypes, only, smoke):
    """(space, dtype, bucket) in the order searched: per kernel, its buckets, each dtype."""
    keys = []
    for name, space in sorted(spaces.items()):
        if only and not any(name.startswith(o) for o in only):
            continue
        buckets = space.buckets[:1] if smoke else space.buckets
        for dtype in dtypes or space.dtypes:
            keys += [(space, dtype, b) for b in buckets]
    return keys


def _cpu_timer(fn):
    """Wall milliseconds of one call: the smoke exercises the search, it measures nothing."""
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def search(keys, device, budget_s, smoke):
    """{(kernel, dtype, bucket): (config, ms, default ms, timed)} within budget_s seconds overall."""
    from kernels import tuned
    found = {}
    deadline = time.perf_counter() + budget_s
    sizes = [len(space.candidates(bucket, dtype)) for space, dtype, bucket in keys]
    for i, (space, dtype, bucket) in enumerate(keys):
        left = deadline - time.perf_counter()
        if left <= 0:
            print(f"{space.kernel} {tuned.dtype_key(dtype)} {bucket}: not reached (budget spent)")
            continue
        share = left * sizes[i] / sum(sizes[i:])  # what is left, shared by the keys to come, by their space's size
        cfg, ms, default_ms, timed = tuned.autotune(space, bucket, dtype, device, budget_s=share,
                                                    timer=_cpu_timer if smoke else None, small=smoke,
                                                    limit=2 if smoke else None)
        found[(space.kernel, tuned.dtype_key(dtype), bucket)] = (cfg, ms, default_ms, timed)
        total = len(space.candidates(bucket, dtype))
        print(f"{space.kernel} {tuned.dtype_key(dtype)} {bucket}: {cfg} {ms:.4f} ms, default {default_ms:.4f} ms "
              f"(x{default_ms / ms:.2f}); {timed} of {total} configurations timed", flush=True)
    return found


def _commit():
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or None
    except OSError:
        return None


def write(path, device_name, found):
    """Merge this device's results into the table at path (other devices kept) and write it."""
    import torch
    import triton

    from kernels import tuned
    table = tuned.load_table(path)
    entry = table["devices"].setdefault(device_name, {})
    configs, measured = entry.setdefault("configs", {}), entry.setdefault("measured", {})
    for (kernel, dtype, bucket), (cfg, ms, default_ms, timed) in found.items():
        configs.setdefault(dtype, {}).setdefault(kernel, {})[str(bucket)] = cfg
        measured.setdefault(dtype, {}).setdefault(kernel, {})[str(bucket)] = {
            "ms": round(ms, 5), "default_ms": round(default_ms, 5), "configs_timed": timed}
    entry["meta"] = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "triton": triton.__version__,
                     "commit": _commit()}
    with open(path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=110, help="seconds for the whole search (compiles included)")
    ap.add_argument("--dtypes", nargs="+", help="dtypes to tune (default: each space's own, bfloat16)")
    ap.add_argument("--only", nargs="+", help="kernels whose name starts with one of these")
    ap.add_argument("--out", help="the table to rewrite (default: kernels/tuned_configs.json; smoke: a temp file)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under the Triton interpreter, on CPU")
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels is imported: triton reads it then
    import torch
    if not a.cpu_smoke and not torch.cuda.is_available():
        print(f"tune_kernels.py needs a CUDA GPU: torch {torch.__version__} sees none; the table is unchanged "
              "(--cpu-smoke checks the script on CPU)")
        return 0
    import kernels  # noqa: F401  (imports every kernel module: each registers its space)
    from kernels import tuned
    dtypes = [getattr(torch, d) for d in a.dtypes] if a.dtypes else None
    if a.cpu_smoke:
        dtypes, device, name = [torch.float32], torch.device("cpu"), "cpu-smoke"
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        name = tuned.device_name(device)
    keys = _keys(tuned.spaces(), dtypes, a.only, a.cpu_smoke)
    print(f"# {name} | torch {torch.__version__} | {len(keys)} keys over {len(tuned.spaces())} spaces | "
          f"budget {a.budget:.0f} s", flush=True)
    start = time.perf_counter()
    found = search(keys, device, a.budget, a.cpu_smoke)
    out = a.out or (None if a.cpu_smoke else tuned.TABLE_PATH)
    if out is None:  # the smoke never touches the committed table: it writes and reads back a scratch copy
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            n = _write_and_count(os.path.join(tmp, "tuned_configs.json"), name, found)
    else:
        n = _write_and_count(out, name, found)
    gain = [d / m for c, m, d, t in found.values() if m == m and d == d and m > 0]
    print(f"SUMMARY {len(found)} of {len(keys)} keys tuned in {time.perf_counter() - start:.0f} s; {n} entries for "
          f"{name} in {out or 'a scratch table'}" + (f"; best gain x{max(gain):.2f}" if gain else ""))
    return 0


def _write_and_count(path, name, found):
    from kernels import tuned
    write(path, name, found)
    back = tuned.load_table(path)["devices"][name]["configs"]  # what a run will read
    return sum(len(b) for d in back.values() for b in d.values())


if __name__ == "__main__":
    sys.exit(main())
