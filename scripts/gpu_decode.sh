#!/usr/bin/env bash
# Decode speed on the H200 (issue 6), one device call per argument:
#   bash scripts/gpu_decode.sh 1b      GPU tests; 1B batch 1 in every mode (eager included:
#                                      graph vs eager in one run) and 256 requests per mode
#   bash scripts/gpu_decode.sh others  0.6B and 8B batch 1 in every graph mode; 1B with
#                                      overlap scheduling off
#   bash scripts/gpu_decode.sh default the three shapes at batch 1 in the default mode (1B
#                                      also eager), 256 requests, GPU tests, 0.6B without PDL
# Batch-1 rows are profiled (--profile). JSON, per-step profiles and logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-.}
MODES=full,piecewise,full_and_piecewise,ragged
bench() { timeout "$1" python -m replaylm bench decode "${@:2}" 2>&1 \
  | grep --line-buffered -E "^\[bench\]|^\[profile\]|^(eager|full|piece|ragged)|Error|error" ; }
clean() { rm -f "$OUT"/prof_*/*.trace.json; }  # traces are large; the summaries stay
gpu_tests() {
  timeout "${GPU_TESTS_TIMEOUT:-300}" python -m pytest -m gpu -q -p no:cacheprovider \
    tests/gpu tests/test_sampler.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -4
}
if [ "${1:-1b}" = default ]; then
  # One call: batch 1 on 0.6B and 1B in the default mode (+ eager on 1B), 256 requests, the
  # GPU tests, then 8B. Bench lines go to $OUT/bench.log; REPLAYLM_CACHE may hold earlier
  # kernel tuning.
  log() { tee -a "$OUT/bench.log"; }
  bench 80 --model qwen3-0.6b --batch-sizes 1 --modes ragged --profile /tmp/prof_06 \
    --json "$OUT/b1_qwen3-0.6b.json" | log
  bench 90 --model llama3.2-1b --batch-sizes 1 --modes eager,ragged \
    --json "$OUT/b1_llama3.2-1b.json" | log
  bench 60 --model llama3.2-1b --batch-sizes 256 --modes ragged --json "$OUT/b256_1b.json" | log
  GPU_TESTS_TIMEOUT=250 gpu_tests
  bench 120 --model llama3-8b --batch-sizes 1 --modes ragged --profile /tmp/prof_8b \
    --json "$OUT/b1_llama3-8b.json" | log
  REPLAYLM_PDL=0 bench 40 --model qwen3-0.6b --batch-sizes 1 --modes ragged | log
elif [ "${1:-1b}" = 1b ]; then
  gpu_tests
  bench 200 --model llama3.2-1b --batch-sizes 1 --modes eager,$MODES \
    --profile "$OUT/prof_llama3.2-1b" --json "$OUT/b1_llama3.2-1b.json"
  bench 200 --model llama3.2-1b --batch-sizes 256 --modes $MODES --json "$OUT/b256_1b.json"
else
  for shape in qwen3-0.6b llama3-8b; do
    bench 250 --model $shape --batch-sizes 1 --modes $MODES --profile "$OUT/prof_$shape" \
      --json "$OUT/b1_$shape.json"
  done
  bench 60 --model llama3.2-1b --batch-sizes 1 --modes full --no-overlap-scheduling \
    --profile "$OUT/prof_1b_sync" --json "$OUT/b1_1b_sync.json"
fi
clean
