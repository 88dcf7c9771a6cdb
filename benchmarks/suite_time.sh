#!/usr/bin/env bash
# The test suite's wall time as CI meets it, for two commits side by side: each in a fresh clone,
# a fresh venv and a fresh HOME (no Triton kernel cache, no default-corpus cache), running
# exactly .ci/run's two commands. Prints install and pytest seconds per commit and the ratio.
#
#   bash benchmarks/suite_time.sh BEFORE_REV AFTER_REV [WORKDIR]
# Run it on an otherwise idle machine: the commits run one after the other, not at once.
set -u
before=$1; after=$2; work=${3:-$(mktemp -d)}
repo=$(cd "$(dirname "$0")/.." && pwd)

measure() {  # name rev
    local d=$work/$1
    rm -rf "$d"; mkdir -p "$d/home"
    git clone -q "$repo" "$d/repo" && git -C "$d/repo" checkout -q "$2"
    python -m venv "$d/venv"
    (
        . "$d/venv/bin/activate"; cd "$d/repo"; export HOME=$d/home
        s=$(date +%s); pip install -q torch==2.13.0 -e ".[test]" > "$d/install.log" 2>&1; e=$(date +%s)
        echo "install $((e - s))" > "$d/times"
        s=$(date +%s); python -m pytest -q tests --durations=25 -p no:cacheprovider > "$d/pytest.log" 2>&1
        rc=$?; e=$(date +%s)
        echo "pytest $((e - s)) $rc" >> "$d/times"
    )
}

measure before "$before"
measure after "$after"
read -r _ ib < <(grep install "$work/before/times"); read -r _ tb rcb < <(grep pytest "$work/before/times")
read -r _ ia < <(grep install "$work/after/times"); read -r _ ta rca < <(grep pytest "$work/after/times")
echo "| commit | install s | pytest s | pytest exit | summary |"
echo "|---|--:|--:|--:|---|"
echo "| $(git -C "$repo" rev-parse --short "$before") (before) | $ib | $tb | $rcb | $(tail -1 "$work/before/pytest.log") |"
echo "| $(git -C "$repo" rev-parse --short "$after") (after) | $ia | $ta | $rca | $(tail -1 "$work/after/pytest.log") |"
echo "pytest time after / before: $(python -c "print(f'{$ta / $tb:.2f}')")"
echo "logs: $work"
