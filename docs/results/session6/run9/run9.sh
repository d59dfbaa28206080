#!/bin/bash
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
for m in llama3.2-1b llama3-8b; do
timeout 140 python -m replaylm bench decode --model $m --batch-sizes 1 --modes ragged --profile $OUT/prof_$m --json $OUT/prof_$m.json > $OUT/prof_$m.log 2>&1
echo "== $m"; grep -E "^\[bench\] mode=ragged batch|^\[profile\] mode|adds|^ragged " $OUT/prof_$m.log
rm -f $OUT/prof_$m/*.trace.json
done
