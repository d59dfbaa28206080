#!/usr/bin/env bash
# On the GPU machine, from the checkout (nothing installed): the GPU tests, then the
# eager decode baseline on the named shapes. Logs and JSON go to ${OUT:-.}.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-.}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 300 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu tests/test_sampler.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
for shape in qwen3-0.6b llama3.2-1b llama3-8b; do
  timeout 150 python -m replaylm bench decode --model "$shape" --batch-sizes "${BATCHES:-1}" \
    --modes "${MODES:-eager}" --json "$OUT/bench_${shape}.json" 2>&1 | grep -v "it/s\]" | tail -12
done
