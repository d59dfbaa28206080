#!/bin/bash
# session 8 run 3: prefetch + idle exit with 32-key splits, batched merges, 2 warps; interleaved
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
P=REPLAYLM_ATTN_PREFETCH=1,REPLAYLM_ATTN_IDLE_EXIT=1
S=REPLAYLM_ATTN_BLOCK_N=32,REPLAYLM_ATTN_MIN_SPLIT=32
timeout 580 python -m replaylm.bench.ab --rounds 2 --json $OUT/ab3.json \
    --variant pe:$P --variant pe32:$P,$S --variant pe32m4:$P,$S,REPLAYLM_ATTN_MERGE_BATCH=4 \
    --variant pe32m8:$P,$S,REPLAYLM_ATTN_MERGE_BATCH=8 --variant pem4:$P,REPLAYLM_ATTN_MERGE_BATCH=4 \
    --variant pew2:$P,REPLAYLM_ATTN_WARPS=2 \
    -- --model qwen3-0.6b --batch-sizes 1 --modes ragged 2>&1 | grep -v "capturing" > $OUT/ab3.log
echo "rc=$?"; tail -30 $OUT/ab3.log
