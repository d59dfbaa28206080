#!/bin/bash
# session 9 run 4: final norm folded into the LM head's launch (norm_logits) against the
# separate norm (REPLAYLM_NORM_IN_HEAD=0); extra one-row tiles for the LM head
# (REPLAYLM_GEMV_EXTRA=1). 0.6B batch 1, 2 rounds; all GPU kernel tests first.
REPO=$PWD
export PYTHONPATH=$REPO
mkdir -p /tmp/c_main /tmp/c_extra
cp .device_cache/linear_tuning.json /tmp/c_main/; cp .device_cache/linear_tuning.json /tmp/c_extra/
REPLAYLM_CACHE=/tmp/c_main timeout 200 python -m pytest -m gpu tests/gpu/test_kernels_gpu.py -q -p no:cacheprovider > $OUT/gpu_kernels.log 2>&1; echo "== gpu kernel tests rc=$?"; tail -2 $OUT/gpu_kernels.log
(cd /tmp && timeout 380 python -m replaylm.bench.ab --rounds 2 --json $OUT/ab4.json \
    --variant head:REPLAYLM_CACHE=/tmp/c_main --variant sep:REPLAYLM_NORM_IN_HEAD=0,REPLAYLM_CACHE=/tmp/c_main \
    --variant extra:REPLAYLM_GEMV_EXTRA=1,REPLAYLM_CACHE=/tmp/c_extra \
    -- --model qwen3-0.6b --batch-sizes 1 --modes ragged 2>&1 | grep -v capturing > $OUT/ab4.log)
tail -6 $OUT/ab4.log
cp /tmp/c_main/linear_tuning.json $OUT/; cp /tmp/c_extra/linear_tuning.json $OUT/extra_tuning.json
