#!/usr/bin/env bash
# One device call: the GPU test suite, kernel launches per step with and without the fused
# kernels, and every graph mode on the 1B shape (with capture time and graph memory).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-.}
timeout 320 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu tests/test_sampler.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -15
for f in fused-kernels no-fused-kernels; do
  timeout 60 python -m replaylm.bench.launches --model llama3.2-1b --$f \
    --json "$OUT/launches_$f.json" 2>&1 | grep -E "kernels_per|fused" 
  timeout 60 python -m replaylm bench decode --model llama3.2-1b --batch-sizes 1 --modes eager \
    --repeats 2 --$f --json "$OUT/eager_$f.json" 2>&1 | grep -E "^eager"
done
timeout 200 python -m replaylm bench decode --model llama3.2-1b --batch-sizes 1 \
  --modes full,piecewise,full_and_piecewise,ragged --repeats 2 --json "$OUT/modes_1b_b1.json" \
  2>&1 | grep -E "^\[bench\]|^(full|piece|ragged)"
