"""``resize_kv_cache`` on CUDA: llama3.2-1b's KV pool grows and shrinks under the range
reserved for ``max_num_kv_blocks``; the device's free memory moves by the bytes mapped or
unmapped, the graph audit passes after each resize, ``graph_check`` replays stay bit-identical
and greedy outputs are the same as before, with no graph recaptured.

Run alone: ``pytest -m gpu tests/gpu/test_kv_resize_gpu.py -s`` (``-s`` prints the sizes and
seconds)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.exclusive,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MIB = 2**20


@pytest.mark.parametrize("mode", ["full_and_piecewise", "ragged"])
def test_resize_moves_free_memory_and_keeps_graphs_and_outputs(mode):
    from replaylm import LLM, SamplingParams

    llm = LLM("llama3.2-1b", load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_num_seqs=8, num_kv_blocks=512, max_num_kv_blocks=8192, max_model_len=512,
              max_num_batched_tokens=512, cuda_graph_mode=mode, graph_tiers="1,2,4,8,64",
              max_graph_tokens=64, graph_check=2, enable_prefix_caching=False)
    # No prefix cache: every run computes its prompts whole. In bf16, a prompt prefilled on
    # top of cached blocks rounds differently from one prefilled whole, and a random-weight
    # model's greedy tokens then part ways; the comparison is about the resized pool alone.
    core = llm.engine
    runner = core.runner
    region = runner.arena.regions["kv"]
    k0 = runner.kv_caches[0][0]
    assert k0.shape[0] == 8192 and region.ptr <= k0.data_ptr() < region.ptr + region.size
    ptrs = [(k.data_ptr(), v.data_ptr()) for k, v in runner.kv_caches]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1 + (7 * i + j) % 1000 for j in range(20 + 9 * i)] for i in range(6)]

    def run() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    before = run()
    stats = llm.graph_stats()
    graphs = (stats["num_graphs"], stats["capture_seconds"])
    assert stats["hits"], f"no step replayed a graph ({stats})"

    for size in (8192, 256, 3000, 512):
        mapped = region.chunk_bytes
        report = llm.resize_kv_cache(size)
        change = report.mapped_bytes - mapped
        moved = report.taken_bytes - report.freed_bytes
        print(f"\n{mode}: resize to {size} blocks: mapped {change / MIB:+.1f} MiB, device free "
              f"memory {-moved / MIB:+.1f} MiB, {report.seconds * 1e3:.2f} ms, audit "
              f"{report.audit}")
        assert report.audit is not None and report.audit["kernels"] > 0, "no audit ran"
        assert abs(moved - change) <= max(0.02 * abs(change), 4 * MIB), (
            f"resize to {size}: the device's free memory moved by {-moved} bytes, the pool's "
            f"mapping by {change}")
        assert run() == before, f"outputs differ after resizing to {size} blocks"
    assert [(k.data_ptr(), v.data_ptr()) for k, v in runner.kv_caches] == ptrs
    stats = llm.graph_stats()
    assert (stats["num_graphs"], stats["capture_seconds"]) == graphs, "a resize recaptured"
    assert stats["checks"] > 0, f"graph_check compared no replay ({stats})"  # a mismatch raises
    core.scheduler.check_integrity()
