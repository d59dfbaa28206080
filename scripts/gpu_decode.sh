#!/usr/bin/env bash
# One device call for decode speed (issue 6): batch 1 on the three named shapes in the whole-
# model graph modes with the per-step profile, graph vs eager and overlap on/off on 1B, and
# 256 requests on 1B. Results (JSON, profiles, traces) go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-.}
bench() { timeout "$1" python -m replaylm bench decode "${@:2}" 2>&1 \
  | grep -E "^\[bench\]|^\[profile\]|^(eager|full|piece|ragged)|Error|error" ; }
for shape in qwen3-0.6b llama3.2-1b llama3-8b; do
  bench 150 --model $shape --batch-sizes 1 --modes full,ragged --profile "$OUT/prof_$shape" \
    --json "$OUT/b1_$shape.json"
done
bench 60 --model llama3.2-1b --batch-sizes 1 --modes eager --json "$OUT/b1_1b_eager.json"
bench 60 --model llama3.2-1b --batch-sizes 1 --modes full --no-overlap-scheduling \
  --profile "$OUT/prof_1b_sync" --json "$OUT/b1_1b_sync.json"
bench 150 --model llama3.2-1b --batch-sizes 256 --modes full,ragged --json "$OUT/b256_1b.json"
