#!/bin/bash
# session 8 run 4: final code (prefetch + idle exit + 4-wide merge in the batch-1 attention
# variant, by default) against session 7's attention, same machine; then the GPU tests.
# The A/B runs from /tmp so that each variant's PYTHONPATH picks its tree.
REPO=$PWD
export REPLAYLM_CACHE=$REPO/.device_cache
mkdir -p /tmp/old && cp -r replaylm /tmp/old/ && cp .device_cache/old_attention.py /tmp/old/replaylm/kernels/attention.py
for m in qwen3-0.6b llama3.2-1b; do
  (cd /tmp && timeout 200 env PYTHONPATH=$REPO python -m replaylm.bench.ab --rounds 1 \
      --json $OUT/ab4_$m.json --variant new:PYTHONPATH=$REPO --variant old:PYTHONPATH=/tmp/old \
      -- --model $m --batch-sizes 1 --modes ragged 2>&1 | grep -v capturing > $OUT/ab4_$m.log)
  tail -4 $OUT/ab4_$m.log
done
export PYTHONPATH=.
timeout 270 python -m pytest -m gpu tests/gpu/test_kernels_gpu.py tests/gpu/test_model_gpu.py -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "== gpu tests rc=$?"; tail -6 $OUT/gpu_tests.log
cp .device_cache/linear_tuning.json $OUT/
