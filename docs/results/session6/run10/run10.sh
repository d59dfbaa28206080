#!/bin/bash
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
timeout 100 python -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py -k "attn or attention or split or decode or long_context or rope" 2>&1 | tail -2
b() { name=$1; shift
  timeout 120 python -m replaylm bench decode "$@" --modes ragged --json $OUT/$name.json > $OUT/$name.log 2>&1
  echo "== $name"; grep -E "^ragged " $OUT/$name.log; }
b q06_b1 --model qwen3-0.6b --batch-sizes 1
b l1b_b1 --model llama3.2-1b --batch-sizes 1
b q06_b2_16 --model qwen3-0.6b --batch-sizes 2,4,8,16
b l8b_b1 --model llama3-8b --batch-sizes 1
