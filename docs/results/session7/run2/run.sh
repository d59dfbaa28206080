#!/bin/bash
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
timeout 200 python .device_cache/s7_micro.py 2>&1 | tee $OUT/micro.log | grep -v Warn
timeout 200 python -m replaylm.bench.chain --model qwen3-0.6b --layers 1 --passes 0 --confirm 3 --json $OUT/chain_l1.json > $OUT/chain_l1.log 2>&1; echo "== chain layers=1 rc=$?"; tail -3 $OUT/chain_l1.log
