#!/bin/bash
# session 6 run 1: L2 prefetch A/B
export REPLAYLM_CACHE=$PWD/.device_cache PYTHONPATH=.
python -c "import torch; p=torch.cuda.get_device_properties(0); print('L2', p.L2_cache_size, 'SMs', p.multi_processor_count)"
timeout 100 python -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py -k "l2_prefetch or rotary_fused" 2>&1 | tail -4
b() { # name env...
  name=$1; shift
  env "$@" timeout 120 python -m replaylm bench decode --model $M --batch-sizes 1 --modes ragged --json $OUT/$name.json > $OUT/$name.log 2>&1
  echo "== $name $*"; grep -E "^\[bench\]|^ragged " $OUT/$name.log
}
M=qwen3-0.6b
b q06_off REPLAYLM_L2_PREFETCH=0
b q06_on REPLAYLM_L2_PREFETCH=1
b q06_on40 REPLAYLM_L2_PREFETCH=1 REPLAYLM_L2_PREFETCH_MB=40
b q06_off2 REPLAYLM_L2_PREFETCH=0
