#!/bin/bash
# session 8 run 1: attention experiments + wide gemv tiles, interleaved A/B at batch 1
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
timeout 570 python -m replaylm.bench.ab --rounds 2 --json $OUT/ab1.json \
    --variant base --variant wide:REPLAYLM_GEMV_WIDE=1 --variant exit:REPLAYLM_ATTN_IDLE_EXIT=1 \
    --variant prefetch:REPLAYLM_ATTN_PREFETCH=1 --variant merge4:REPLAYLM_ATTN_MERGE_BATCH=4 \
    -- --model qwen3-0.6b --batch-sizes 1 --modes ragged 2>&1 | grep -v "capturing" > $OUT/ab1.log
echo "rc=$?"; tail -40 $OUT/ab1.log
cp .device_cache/linear_tuning.json $OUT/
