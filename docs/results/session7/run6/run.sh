#!/bin/bash
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
timeout 290 python -m pytest -m gpu tests/gpu -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "== gpu tests rc=$?"; tail -15 $OUT/gpu_tests.log
timeout 80 python -m replaylm bench decode --model llama3.2-1b --batch-sizes 1 --modes ragged --json $OUT/ra1b.json > $OUT/ra1b.log 2>&1; echo "== ra1b :: $(grep -E '^ragged ' $OUT/ra1b.log | tail -1)"
