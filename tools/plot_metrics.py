"""Plot a run's metrics from its --log-json file: loss (train and validation), learning rate,
throughput; several files overlay their runs (labelled by file name), against iterations or
wall-clock seconds (a row's "seconds", else the sum of the logged iteration times).

    python tools/plot_metrics.py run.jsonl -o run.png
    python tools/plot_metrics.py sync.jsonl local_sgd.jsonl --x seconds -o compare.png

Needs matplotlib (pip install 'megalite[plot]').
"""

import argparse
import json
import os
import sys


def read(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise SystemExit(f"plot_metrics: error: {path} line {n} is not JSON (a --log-json file?)")
    return rows


def series(rows, key, x="iteration"):
    pts = [(_x(rows, i, x), r[key]) for i, r in enumerate(rows) if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _x(rows, i, x):
    """Row i's position: its iteration, or its wall-clock seconds ("seconds" where the row has it,
    else the iteration times logged so far, each standing for the iterations since the row before)."""
    if x == "iteration":
        return rows[i]["iteration"]
    if "seconds" in rows[i]:
        return rows[i]["seconds"]
    total, prev = 0.0, 0
    for r in rows[:i + 1]:
        if r.get("iteration-time") is not None:
            total += r["iteration-time"] * (r["iteration"] - prev)
            prev = r["iteration"]
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot loss, validation loss, learning rate and throughput of a run")
    p.add_argument("log_json", nargs="+", help="the file(s) given to pretrain_*.py --log-json")
    p.add_argument("-o", "--output", default=None, help="image to write (default: the first LOG_JSON with .png)")
    p.add_argument("--x", choices=["iteration", "seconds"], default="iteration",
                   help="the horizontal axis: iterations, or wall-clock seconds")
    a = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_metrics: error: needs matplotlib: pip install 'megalite[plot]'", file=sys.stderr)
        return 2
    runs = []
    for path in a.log_json:
        if not os.path.isfile(path):
            print(f"plot_metrics: error: {path} does not exist", file=sys.stderr)
            return 2
        rows = read(path)
        keys = {k for r in rows for k in r if k.endswith("loss")}
        if not keys:
            print(f"plot_metrics: error: {path} holds no logged loss", file=sys.stderr)
            return 2
        runs.append((os.path.splitext(os.path.basename(path))[0], rows, keys))
    extra = [(k, title) for k, title in (("learning-rate", "learning rate"),
                                         ("throughput", "throughput (TFLOP/s per GPU)"))
             if any(r.get(k) is not None for _, rows, _ in runs for r in rows)]  # panels with something to show
    fig, ax = plt.subplots(1, 1 + len(extra), figsize=(5 * (1 + len(extra)) + (2 if not extra else 0), 4),
                           squeeze=False)
    ax = ax[0]
    for name, rows, keys in runs:
        label = f"{name}: " if len(runs) > 1 else ""
        for k in sorted(k for k in keys if not k.startswith(("validation", "test"))):
            ax[0].plot(*series(rows, k, a.x), label=f"{label}train {k}")
        for k in sorted(k for k in keys if k.startswith("validation")):
            x, y = series(rows, k, a.x)
            ax[0].plot(x, y, "o-", label=f"{label}{k}")
        for i, (k, _) in enumerate(extra, 1):
            ax[i].plot(*series(rows, k, a.x), label=name)
    ax[0].set_title("loss")
    ax[0].legend(fontsize=7)
    for i, (_, title) in enumerate(extra, 1):
        ax[i].set_title(title)
    for x in ax:
        x.set_xlabel("wall-clock seconds" if a.x == "seconds" else "iteration")
    fig.tight_layout()
    out = a.output or os.path.splitext(a.log_json[0])[0] + ".png"
    fig.savefig(out, dpi=80)
    print(f"plot_metrics: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
