#!/bin/bash
# session 7 run 5: PDL trigger before the wait (default now) vs after, interleaved; rotary in attention
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
b() { tag=$1; m=$2; shift 2; env "$@" timeout 170 python -m replaylm bench decode --model $m --batch-sizes 1 --modes ragged --json $OUT/$tag.json > $OUT/$tag.log 2>&1; echo "== $tag $m $* :: $(grep -E '^ragged ' $OUT/$tag.log | tail -1)"; }
b e1 qwen3-0.6b REPLAYLM_PDL_EARLY=1
b l1 qwen3-0.6b REPLAYLM_PDL_EARLY=0
b ra1 qwen3-0.6b REPLAYLM_PDL_EARLY=1 REPLAYLM_ROPE_IN_ATTENTION=1
b e2 qwen3-0.6b REPLAYLM_PDL_EARLY=1
b l2 qwen3-0.6b REPLAYLM_PDL_EARLY=0
b ra2 qwen3-0.6b REPLAYLM_PDL_EARLY=1 REPLAYLM_ROPE_IN_ATTENTION=1
b e1b llama3.2-1b REPLAYLM_PDL_EARLY=1
b l1b llama3.2-1b REPLAYLM_PDL_EARLY=0
b e8b llama3-8b REPLAYLM_PDL_EARLY=1
mkdir -p $OUT/logs; cat $OUT/*.log > $OUT/all_logs.txt; rm -f $OUT/*.log
grep -h "linear .*unfused" $OUT/all_logs.txt | sort | uniq | head -30
