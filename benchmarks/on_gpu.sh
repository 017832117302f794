#!/usr/bin/env bash
# The GPU check, as one short script (a few minutes on one card):
#   1. fused-step throughput of the core on CUDA (K = 1..64),
#   2. plain Ray Tune vs chorus_tune vs the raw fused loop: 16 small CNNs on
#      synthetic CIFAR-sized data (3x32x32, 10 classes), 3 epochs, ASHA.
# Results (JSON, PNG, log) go to $OUT if set, else benchmarks/results/.
# Needs a CUDA build of torch in .venv (make setup installs the CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
py=.venv/bin/python
$py -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'; print(torch.cuda.get_device_name(0))" | tee "$out/gpu.txt"
$py benchmarks/fused_step.py --device cuda --ks 1,4,16,64 --json "$out/fused_step_cuda.json" | tee "$out/fused_step_cuda.txt"
$py benchmarks/vs_tune.py --device cuda --workload cifar-cnn --trials 16 --epochs 3 --bucket-size 16 \
    --gpu-trials 16 --repeats 1 --out "$out" | tee "$out/vs_tune_cuda.txt"
