"""torchrun on two GPUs: the ranks it starts (NCCL inside the captured graphs, messages over
the gloo control group) give the tokens of the same two ranks spawned on one host."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from replaylm import LLM
from tests.conftest import make_checkpoint
from tests.distributed.test_torchrun import GREEDY, PROMPTS, SCRIPT, launch_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

KW = dict(num_kv_blocks=128, max_model_len=256, skip_tokenizer_init=True, max_num_seqs=8,
          max_graph_tokens=64, cuda_graph_mode="ragged", dtype="bfloat16",
          distributed_timeout_s=300, tensor_parallel_size=2)


def test_torchrun_tp2_equals_spawned_tp2(tmp_path):
    ckpt = tmp_path / "ckpt"
    make_checkpoint("llama", ckpt, seed=11, vocab_size=1024, hidden_size=512,
                    intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4)
    with LLM(str(ckpt), **KW) as llm:  # same kernels and shapes: identical bits
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    script, out = tmp_path / "ranks.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(ckpt), str(out), json.dumps(KW)],
        env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(out.read_text())["tokens"] == want
