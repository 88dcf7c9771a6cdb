#!/usr/bin/env bash
# Every check that needs a GPU, in parts that each finish well under 8 minutes, so one part fits
# one call on a lent GPU machine (10 minutes a command there):
#   bash benchmarks/gpu_checks.sh --list                 # the parts, one a line, with what they run
#   bash benchmarks/gpu_checks.sh --out DIR [PART ...]   # run these parts (default: all, in order)
# Each part writes DIR/PART.txt (its whole output; pytest parts also DIR/PART.junit.xml) and a
# line "PART status seconds" to DIR/summary.txt. A part is cut off after PART_TIMEOUT seconds
# (default 470). Exit status: 0 when every part run passed, 1 when any failed or timed out,
# 2 on a usage error. The GPU machine has its own torch/triton (torch 2.11, triton 3.6):
# the env part installs megalite over them without dependencies.
set -uo pipefail
cd "$(dirname "$0")/.."

PARTS=(first-light env cuda-kernels cuda-model compile bench-kernels-rowwise bench-kernels-attention bench-adamw bench-mfu bench-ring bench-moe bench-mixed-memory bench-muon bench-peers bench-fp8)

describe() {
    case "$1" in
        first-light) echo "python benchmarks/first_light.py (env, CUDA tests, MFU vs plain PyTorch, flash vs SDPA, FP8 GEMM, bandwidth; 8 min)" ;;
        env) echo "pip install --no-deps -e . ; versions, GPU name, nvidia-smi" ;;
        cuda-kernels) echo "pytest -m cuda tests/kernels (every kernel vs a float reference on the GPU)" ;;
        cuda-model) echo "pytest -m cuda tests --ignore=tests/kernels (GPT on the GPU: fused vs unfused, ...)" ;;
        compile) echo "pytest tests/kernels/test_gpu_compile.py with this machine's triton" ;;
        bench-kernels-rowwise) echo "python benchmarks/kernels.py --only layer_norm rms_norm softmax bias_gelu swiglu rotary" ;;
        bench-kernels-attention) echo "python benchmarks/kernels.py --only cross_entropy flash_attention" ;;
        bench-adamw) echo "python benchmarks/adamw_flat.py (flat AdamW vs per-tensor / torch fused)" ;;
        bench-mfu) echo "python benchmarks/mfu.py" ;;
        bench-ring) echo "python benchmarks/context_parallel.py --gpu-blocks --seq 32768 (ring blocks on Triton vs CP=1)" ;;
        bench-moe) echo "python benchmarks/moe.py --gpu (grouped GEMM vs a per-expert loop, bf16)" ;;
        bench-mixed-memory) echo "python benchmarks/mixed_memory.py --gpu (per-sample memory; offloaded step with / without overlap)" ;;
        bench-muon) echo "python benchmarks/muon.py --gpu-ns (Newton-Schulz of a 4096x4096 matrix, bf16 and fp32)" ;;
        bench-peers) echo "python benchmarks/peers.py --device cuda (megalite vs FSDP2 on the GPUs there: one rank per GPU)" ;;
        bench-fp8) echo "python benchmarks/fp8_training.py (whole training steps: bf16 vs FP8 tensorwise / delayed / rowwise); python benchmarks/kernels.py --only fp8_cast fp8_blockwise (the fused cast vs torch's ops; the blockwise GEMM vs bf16 and tensorwise)" ;;
        *) return 1 ;;
    esac
}

run_part() {
    local part=$1 out=$2
    case "$part" in
        first-light) python benchmarks/first_light.py --out "$out/first-light" --budget 450 ;;
        env) pip install --no-deps --use-pep517 --no-build-isolation -e . -q && python -c "import torch, triton; print('torch', torch.__version__, \
'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() \
else 'NO GPU')" && (nvidia-smi || true) && python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ;;
        cuda-kernels) python -m pytest -q -m cuda tests/kernels --junitxml="$out/$part.junit.xml" ;;
        cuda-model) python -m pytest -q -m cuda tests --ignore=tests/kernels --junitxml="$out/$part.junit.xml" ;;
        compile) python -m pytest -q -s tests/kernels/test_gpu_compile.py --junitxml="$out/$part.junit.xml" ;;
        bench-kernels-rowwise) python benchmarks/kernels.py --only layer_norm rms_norm softmax bias_gelu swiglu rotary ;;
        bench-kernels-attention) python benchmarks/kernels.py --only cross_entropy flash_attention ;;
        bench-adamw) python benchmarks/adamw_flat.py ;;
        bench-mfu) python benchmarks/mfu.py ;;
        bench-ring) python benchmarks/context_parallel.py --gpu-blocks --seq 32768 ;;
        bench-moe) python benchmarks/moe.py --gpu ;;
        bench-mixed-memory) python benchmarks/mixed_memory.py --gpu --hidden 768 --layers 12 --seq 1024 --batch 8 ;;
        bench-muon) python benchmarks/muon.py --gpu-ns --size 4096 ;;
        bench-peers) python benchmarks/peers.py --device cuda --layers 8 --hidden 1024 --heads 16 --kv-heads 4 \
            --ffn 2816 --seq 1024 --global-batch 16 --micro-batch 4 --iters 10 --warmup 3 --reps 2 ;;
        bench-fp8) python benchmarks/fp8_training.py && python benchmarks/kernels.py --only fp8_cast fp8_blockwise --no-compile ;;
    esac
}

export -f run_part

OUT=""
SELECTED=()
while [ $# -gt 0 ]; do
    case "$1" in
        --list) for p in "${PARTS[@]}"; do printf '%-24s %s\n' "$p" "$(describe "$p")"; done; exit 0 ;;
        --out) [ $# -ge 2 ] || { echo "gpu_checks.sh: --out needs a folder" >&2; exit 2; }; OUT=$2; shift 2 ;;
        --out=*) OUT=${1#--out=}; shift ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        -*) echo "gpu_checks.sh: unknown option $1 (use --list, --out DIR, PART ...)" >&2; exit 2 ;;
        *) describe "$1" > /dev/null || { echo "gpu_checks.sh: unknown part '$1'; parts: ${PARTS[*]}" >&2; exit 2; }
           SELECTED+=("$1"); shift ;;
    esac
done
[ -n "$OUT" ] || { echo "gpu_checks.sh: give the report folder with --out DIR (see --list for the parts)" >&2; exit 2; }
[ ${#SELECTED[@]} -gt 0 ] || SELECTED=("${PARTS[@]}")
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TIMEOUT=${PART_TIMEOUT:-470}

failed=0
for part in "${SELECTED[@]}"; do
    start=$(date +%s)
    echo "== $part: $(describe "$part")"
    # timeout runs the part in its own process group and ends the whole group when time is up
    timeout -k 15 "$TIMEOUT" bash -c 'run_part "$0" "$1"' "$part" "$OUT" > "$OUT/$part.txt" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    if [ "$rc" -eq 0 ]; then status=passed; elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="timed-out(${TIMEOUT}s)"; else status="failed(rc=$rc)"; fi
    [ "$rc" -eq 0 ] || failed=1
    echo "$part $status ${secs}s" | tee -a "$OUT/summary.txt"
    tail -n 5 "$OUT/$part.txt" | sed 's/^/    /'
done
exit "$failed"
