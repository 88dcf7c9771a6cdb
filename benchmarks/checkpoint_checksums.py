"""What recording checkpoint checksums costs a save (megalite/checkpoint/integrity.py): per shard size, the time to
serialize a shard (safetensors), write and fsync it (the save's own work), and to checksum the same bytes (xxh3-64,
what every save now adds, and SHA-256, --verify-integrity's, which also reads the file back); the checksum's share
of the save. Then a whole save through megalite's writer (a model of --params parameters, one process) with the
checksums and with them replaced by a no-op, alternating, median of --repeats.

    python benchmarks/checkpoint_checksums.py [--sizes-mib 16 64 256 --dir /tmp --params 20000000]
"""

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import xxhash  # noqa: E402


def _best(f, n=3):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def shards(sizes, root):
    from safetensors.torch import save
    from megalite.checkpoint.storage import fsync_write
    print(f"{'shard MiB':>10}{'serialize s':>13}{'write+fsync s':>15}{'xxh3 s':>9}{'xxh3 share':>12}"
          f"{'SHA-256 s':>11}{'SHA share':>11}")
    for mib in sizes:
        t = {"w": torch.randn(mib * (1 << 20) // 4)}
        data = save(t)
        ser = _best(lambda: save(t))
        path = os.path.join(root, "shard.safetensors")
        wr = _best(lambda: fsync_write(path, data))
        xx = _best(lambda: xxhash.xxh3_64_hexdigest(data))
        sha = _best(lambda: hashlib.sha256(data).hexdigest())
        base = ser + wr
        print(f"{mib:>10}{ser:>13.3f}{wr:>15.3f}{xx:>9.4f}{xx / base:>11.1%}{sha:>11.3f}{sha / base:>10.1%}")


def whole_save(params, repeats, root):
    """A save of `params` fp32 parameters (plus Adam's two moments) through save_checkpoint's writer path."""
    from megalite.checkpoint import integrity, storage
    from safetensors.torch import save
    state = {f"p{i}": torch.randn(params // 8) for i in range(8)}
    state.update({f"m{i}": torch.randn(params // 8) for i in range(8)})
    state.update({f"v{i}": torch.randn(params // 8) for i in range(8)})

    def one(check):
        d = os.path.join(root, "ckpt")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        sums = {}
        for i in range(4):  # (four ranks' shards, written in turn)
            part = {k: v for j, (k, v) in enumerate(state.items()) if j % 4 == i}
            data = save(part)
            storage.fsync_write(os.path.join(d, f"__{i}_0.safetensors"), data)
            if check:
                sums[f"__{i}_0.safetensors"] = [len(data), xxhash.xxh3_64_hexdigest(data)]
        if check:
            integrity.merge_checksums(d, sums)
    got = {True: [], False: []}
    for _ in range(repeats):
        for check in (False, True):
            t = time.perf_counter()
            one(check)
            got[check].append(time.perf_counter() - t)
    off, on = statistics.median(got[False]), statistics.median(got[True])
    mib = sum(v.numel() * 4 for v in state.values()) / (1 << 20)
    print(f"whole save, {mib:.0f} MiB in 4 shards: {off:.3f} s without checksums, {on:.3f} s with: "
          f"+{on / off - 1:.1%} (median of {repeats})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--params", type=int, default=20_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    a = ap.parse_args()
    root = tempfile.mkdtemp(dir=a.dir)
    try:
        print(f"checkpoint checksums on {os.cpu_count()} cores, writing to {root}")
        shards(a.sizes_mib, root)
        whole_save(a.params, a.repeats, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
