"""Plot a run's metrics from its --log-json file: loss (train and validation), learning rate,
throughput.

    python tools/plot_metrics.py run.jsonl -o run.png

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


def series(rows, key):
    pts = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot loss, validation loss, learning rate and throughput of a run")
    p.add_argument("log_json", help="the file given to pretrain_*.py --log-json")
    p.add_argument("-o", "--output", default=None, help="image to write (default: LOG_JSON with .png)")
    a = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_metrics: error: needs matplotlib: pip install 'megalite[plot]'", file=sys.stderr)
        return 2
    if not os.path.isfile(a.log_json):
        print(f"plot_metrics: error: {a.log_json} does not exist", file=sys.stderr)
        return 2
    rows = read(a.log_json)
    losses = sorted({k for r in rows for k in r if k.endswith("loss") and not k.startswith(("validation", "test"))})
    if not losses:
        print(f"plot_metrics: error: {a.log_json} holds no logged iteration", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for k in losses:
        ax[0].plot(*series(rows, k), label=f"train {k}")
        x, y = series(rows, f"validation {k}")
        if x:
            ax[0].plot(x, y, "o-", label=f"validation {k}")
    ax[0].set_title("loss")
    ax[0].legend()
    ax[1].plot(*series(rows, "learning-rate"))
    ax[1].set_title("learning rate")
    ax[2].plot(*series(rows, "throughput"))
    ax[2].set_title("throughput (TFLOP/s per GPU)")
    for x in ax:
        x.set_xlabel("iteration")
    fig.tight_layout()
    out = a.output or os.path.splitext(a.log_json)[0] + ".png"
    fig.savefig(out, dpi=80)
    print(f"plot_metrics: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
