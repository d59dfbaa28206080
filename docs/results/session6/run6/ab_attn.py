"""A/B of the batch-1 attention tile (session 5, run 7): the `bench decode` CLI with the
latency-bound tile switched off (session 4's tile: 128-key blocks, 2 stages, 256-key splits)
when the first argument is "old", unchanged when it is "new"; the rest goes to the CLI."""
import sys

import replaylm.kernels.attention as A
from replaylm.cli.main import main

if sys.argv[1] == "old":
    pick = A.pick_config
    A.pick_config = lambda max_q_len, g_pad, head_dim, latency_bound=False: pick(
        max_q_len, g_pad, head_dim)
    A.paged_attention.__kwdefaults__["min_split_keys"] = 256
sys.exit(main(["bench", "decode", *sys.argv[2:]]))
