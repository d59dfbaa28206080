#!/bin/bash
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
timeout 120 python .device_cache/pf_micro.py 20000 2>&1 | tail -12
b() { # name env...
  name=$1; shift
  env "$@" timeout 120 python -m replaylm bench decode --model $M --batch-sizes 1 --modes ragged --json $OUT/$name.json > $OUT/$name.log 2>&1
  echo "== $name $*"; grep -E "^\[bench\]|^ragged |Error|error" $OUT/$name.log | tail -4
}
M=qwen3-0.6b
b q06_on REPLAYLM_L2_PREFETCH=1
b q06_off REPLAYLM_L2_PREFETCH=0
b q06_on24 REPLAYLM_L2_PREFETCH=1 REPLAYLM_L2_PREFETCH_MB=24
