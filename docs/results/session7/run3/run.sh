#!/bin/bash
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
for pin in 0 1; do REPLAYLM_GEMV_PIN=$pin timeout 200 python .device_cache/s7_micro2.py 2>&1 | grep -v Warn | tee $OUT/micro2_pin$pin.log; done
timeout 240 python -m replaylm bench decode --model qwen3-0.6b --batch-sizes 1 --modes ragged --json $OUT/pin1.json > $OUT/pin1.log 2>&1; echo "== pin1 bench"; grep -E "^\[bench\] mode=ragged batch|^ragged " $OUT/pin1.log | tail -2
grep -i "linear .*: unfused" $OUT/pin1.log | head -20
