#!/bin/bash
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
b() { # name env...
  name=$1; shift
  env "$@" timeout 120 python -m replaylm bench decode --model $M --batch-sizes 1 --modes ragged --json $OUT/$name.json > $OUT/$name.log 2>&1
  echo "== $name $*"; grep -E "^\[bench\]|^ragged |Error|error" $OUT/$name.log | tail -3
}
M=qwen3-0.6b
b q06_c8k REPLAYLM_L2_PREFETCH_CHUNK=8192
b q06_c4k REPLAYLM_L2_PREFETCH_CHUNK=4096
b q06_off REPLAYLM_L2_PREFETCH=0
b q06_c16k REPLAYLM_L2_PREFETCH_CHUNK=16384
b q06_c8k_40 REPLAYLM_L2_PREFETCH_CHUNK=8192 REPLAYLM_L2_PREFETCH_MB=40
