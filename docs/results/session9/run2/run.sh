#!/bin/bash
# session 9 run 2: the three graph-node fusions (step inputs, final norm on logits rows,
# argmax into last_token) against session 8's code (d170602), 0.6B and 1B batch 1; LM head
# micro; GPU kernel tests of the touched kernels.
REPO=$PWD
mkdir -p /tmp/old /tmp/cache_new /tmp/cache_old
cp -r .device_cache/old_s9/replaylm /tmp/old/
cp .device_cache/linear_tuning.json /tmp/cache_new/; cp .device_cache/linear_tuning.json /tmp/cache_old/
export PYTHONPATH=$REPO REPLAYLM_CACHE=$REPO/.device_cache
timeout 100 python -m pytest -m gpu tests/gpu/test_kernels_gpu.py -q -p no:cacheprovider -k "fused_kernels or argmax or step_inputs" > $OUT/gpu_tests.log 2>&1; echo "== gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
timeout 120 python .device_cache/lmhead_micro.py > $OUT/lmhead.log 2>&1; echo "== lmhead rc=$?"; cat $OUT/lmhead.log
for m in qwen3-0.6b llama3.2-1b; do r=2; [ $m = llama3.2-1b ] && r=1
  (cd /tmp && timeout 330 env PYTHONPATH=$REPO python -m replaylm.bench.ab --rounds $r \
      --json $OUT/ab_$m.json --variant new:PYTHONPATH=$REPO,REPLAYLM_CACHE=/tmp/cache_new \
      --variant old:PYTHONPATH=/tmp/old,REPLAYLM_CACHE=/tmp/cache_old \
      -- --model $m --batch-sizes 1 --modes ragged 2>&1 | grep -v capturing > $OUT/ab_$m.log)
  tail -5 $OUT/ab_$m.log
done
cp /tmp/cache_new/linear_tuning.json $OUT/
