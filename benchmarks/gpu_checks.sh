#!/usr/bin/env bash
# Every check that needs a GPU, in one call (for a session lent the GPU machine):
#   bash benchmarks/gpu_checks.sh > gpu_report.txt 2>&1
# The GPU machine has its own torch/triton; install megalite over them without deps.
set -uo pipefail
cd "$(dirname "$0")/.."
pip install --no-deps -e . -q
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python -m pytest -q -m cuda tests
python benchmarks/kernels.py
python benchmarks/mfu.py
