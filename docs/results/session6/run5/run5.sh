#!/bin/bash
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
timeout 150 python -m replaylm bench decode --model qwen3-0.6b --batch-sizes 1 --modes ragged --profile $OUT/prof06 --json $OUT/prof06.json > $OUT/prof06.log 2>&1
grep -E "^\[bench\]|^\[profile\]|^ragged " $OUT/prof06.log
rm -f $OUT/prof06/*.trace.json
timeout 200 python -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py tests/test_sampler.py -x 2>&1 | tail -4
