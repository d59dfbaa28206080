#!/bin/bash
# session 9 run 5: final code (node fusions, LM head through linear, tuner tie rule) against
# the session's start (d170602, with session 8's tuning decisions), 0.6B batch 1, 2 rounds;
# final code on 1B; GPU graph and model tests.
REPO=$PWD
export PYTHONPATH=$REPO
mkdir -p /tmp/c_final /tmp/c_start /tmp/start
cp .device_cache/start/linear_tuning.json /tmp/c_start/
cp -r .device_cache/start/replaylm /tmp/start/
REPLAYLM_CACHE=/tmp/c_final timeout 170 python -m pytest -m gpu tests/gpu/test_graphs_gpu.py tests/gpu/test_model_gpu.py -q -p no:cacheprovider > $OUT/gpu_graphs_model.log 2>&1; echo "== gpu graph+model tests rc=$?"; tail -3 $OUT/gpu_graphs_model.log
(cd /tmp && timeout 260 python -m replaylm.bench.ab --rounds 2 --json $OUT/ab5.json \
    --variant final:REPLAYLM_CACHE=/tmp/c_final \
    --variant start:PYTHONPATH=/tmp/start,REPLAYLM_CACHE=/tmp/c_start \
    -- --model qwen3-0.6b --batch-sizes 1 --modes ragged 2>&1 | grep -v capturing > $OUT/ab5.log)
tail -4 $OUT/ab5.log
REPLAYLM_CACHE=/tmp/c_final timeout 100 python -m replaylm bench decode --model llama3.2-1b --batch-sizes 1 --modes ragged --json $OUT/final_1b.json 2>&1 | grep -v capturing > $OUT/final_1b.log; tail -3 $OUT/final_1b.log
cp /tmp/c_final/linear_tuning.json $OUT/
