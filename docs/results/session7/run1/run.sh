#!/bin/bash
# session 7 run 1: baseline, rotary placement variants, projection chain search
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
b() { tag=$1; shift; env "$@" timeout 150 python -m replaylm bench decode --model qwen3-0.6b --batch-sizes 1 --modes ragged --json $OUT/$tag.json > $OUT/$tag.log 2>&1; echo "== $tag $*"; grep -E "^\[bench\] mode=ragged batch|^ragged " $OUT/$tag.log | tail -3; }
b base X=1
b rope_attn REPLAYLM_ROPE_IN_ATTENTION=1
b rope_qkv REPLAYLM_ROPE_IN_QKV=1
b base2 X=1
timeout 330 python -m replaylm.bench.chain --model qwen3-0.6b --json $OUT/chain.json > $OUT/chain.log 2>&1; echo "== chain rc=$?"; tail -25 $OUT/chain.log
rm -f $OUT/*.json.tmp
