"""``bench decode`` times every repeat on prompts of its own: no repeat is served from the
prefix cache (caching stays on, as in a real run)."""

from __future__ import annotations

from replaylm import LLM
from replaylm.bench.decode import bench_batch1, bench_batched


def test_repeats_never_hit_the_prefix_cache() -> None:
    llm = LLM("default", max_num_seqs=4, num_kv_blocks=64, max_model_len=128)
    assert llm.engine_args.enable_prefix_caching
    row = bench_batch1(llm, prompt_len=32, new_tokens=4, repeats=3)
    assert len(row.all_wall_s) == 3
    assert llm.stats().prefix_cache_hit_tokens == 0
    bench_batched(llm, 2, prompt_len=32, new_tokens=4, repeats=2)
    stats = llm.stats()
    assert stats.prefix_cache_queried_tokens > 0 and stats.prefix_cache_hit_tokens == 0
