#!/bin/bash
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
for e in 1 0; do REPLAYLM_PDL_EARLY=$e timeout 200 python .device_cache/s7_micro2.py 2>&1 | grep -v Warn | sed "s/^/early=$e /" | tee $OUT/micro2_early$e.log | grep -E "best|4x1024 w4|16x1024 w4|8x1024 w4"; done
REPLAYLM_PDL_EARLY=1 timeout 240 python -m replaylm bench decode --model qwen3-0.6b --batch-sizes 1 --modes ragged --json $OUT/early.json > $OUT/early.log 2>&1; echo "== early bench"; grep -E "^\[bench\] mode=ragged batch|^ragged " $OUT/early.log | tail -2
