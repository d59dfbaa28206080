#!/bin/bash
# session 8 run 2: batch-1 attention knobs (prefetch + idle exit, split size, key block), interleaved
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
P=REPLAYLM_ATTN_PREFETCH=1,REPLAYLM_ATTN_IDLE_EXIT=1
timeout 580 python -m replaylm.bench.ab --rounds 2 --json $OUT/ab2.json \
    --variant base --variant pe:$P --variant pe128:$P,REPLAYLM_ATTN_MIN_SPLIT=128 \
    --variant pe128b:$P,REPLAYLM_ATTN_MIN_SPLIT=128,REPLAYLM_ATTN_BLOCK_N=128 \
    --variant ms128:REPLAYLM_ATTN_MIN_SPLIT=128 \
    --variant pe128b8:$P,REPLAYLM_ATTN_MIN_SPLIT=128,REPLAYLM_ATTN_BLOCK_N=128,REPLAYLM_ATTN_WARPS=8 \
    -- --model qwen3-0.6b --batch-sizes 1 --modes ragged 2>&1 | grep -v "capturing" > $OUT/ab2.log
echo "rc=$?"; tail -30 $OUT/ab2.log
