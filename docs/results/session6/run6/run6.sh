#!/bin/bash
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
timeout 150 python -m replaylm bench decode --model qwen3-0.6b --batch-sizes 1 --modes ragged --profile $OUT/prof06 --json $OUT/prof06.json > $OUT/prof06.log 2>&1
grep -E "^\[bench\]|adds|^ragged " $OUT/prof06.log
rm -f $OUT/prof06/*.trace.json
for t in new old; do
  timeout 150 python docs/results/session5/run7/ab_attn.py $t --model qwen3-0.6b --batch-sizes 2,4,8,16 --modes ragged --json $OUT/b2_16_$t.json > $OUT/b2_16_$t.log 2>&1
  echo "== $t"; grep -E "^ragged " $OUT/b2_16_$t.log
done
