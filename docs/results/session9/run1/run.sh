#!/bin/bash
# session 9 run 1: profile of the final session-8 code, 0.6B batch 1 ragged; full mode beside it.
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
timeout 150 python -m replaylm bench decode --model qwen3-0.6b --batch-sizes 1 --modes ragged,full --profile $OUT/prof --json $OUT/prof.json > $OUT/prof.log 2>&1
echo rc=$?
grep -v capturing $OUT/prof.log | grep -E "^\[|^ragged|^full"
python - <<'PY'
import glob, json, os, sys
sys.path.insert(0, '.')
from replaylm.bench.profile import chain_share
for p in sorted(glob.glob(os.environ['OUT'] + '/prof/*.json')):
    print('==', p)
    from replaylm.bench.profile import _device_spans, _launch_label
    import statistics
    own = {}
    for e in _device_spans(p):
        own.setdefault(_launch_label(e), []).append(float(e.get('dur', 0.0)))
    for name, us, n in chain_share(p, 64, n=40):
        print(f'{us:9.2f} {n:7.2f} own-median {statistics.median(own[name]):7.2f} {name}')
PY
rm -f $OUT/prof/*.trace.json
cp .device_cache/linear_tuning.json $OUT/
