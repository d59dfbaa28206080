#!/bin/bash
# session 9 run 3: LM head through the tuned linear (skinny kernel or cuBLAS) against 611b66d
# (cuBLAS always); decode attention tile of one token's GQA group (no tensor cores) with 4
# or 8 warps. 0.6B batch 1, 2 rounds; GPU tests of the touched kernels.
REPO=$PWD
export PYTHONPATH=$REPO REPLAYLM_CACHE=$REPO/.device_cache
timeout 120 python -m pytest -m gpu tests/gpu/test_kernels_gpu.py -q -p no:cacheprovider -k "lm_head or rope_gpu or argmax or step_inputs or fused_kernels or long_context" > $OUT/gpu_tests.log 2>&1; echo "== gpu tests rc=$?"; tail -2 $OUT/gpu_tests.log
REPLAYLM_DECODE_TILE_WARPS=4 timeout 100 python -m pytest -m gpu tests/gpu/test_kernels_gpu.py -q -p no:cacheprovider -k "rope_gpu or long_context or mixed_batch" > $OUT/gpu_tests_dt4.log 2>&1; echo "== gpu tests dt4 rc=$?"; tail -2 $OUT/gpu_tests_dt4.log
mkdir -p /tmp/s9_611 && cp -r .device_cache/s9_611/replaylm /tmp/s9_611/
(cd /tmp && timeout 420 python -m replaylm.bench.ab --rounds 2 --json $OUT/ab3.json \
    --variant lmhead --variant cublas_head:PYTHONPATH=/tmp/s9_611 \
    --variant dt4:REPLAYLM_DECODE_TILE_WARPS=4 --variant dt8:REPLAYLM_DECODE_TILE_WARPS=8 \
    -- --model qwen3-0.6b --batch-sizes 1 --modes ragged 2>&1 | grep -v capturing > $OUT/ab3.log)
tail -7 $OUT/ab3.log
grep -h "linear 1x151936" $OUT/ab3.log | head -3
cp .device_cache/linear_tuning.json $OUT/
