"""Sleep and wake on CUDA: the address-stable arena (CUDA virtual memory management), an
engine that sleeps and wakes without recapture, and the pointer audit of captured graphs.

Each step asserts on its own with a message naming it, so one failing run says which driver
call, view or replay went wrong. Run alone: ``pytest -m gpu tests/gpu/test_sleep_gpu.py -s``
(``-s`` shows the audit's seconds)."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.exclusive,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GIB = 2**30


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_arena_probe_unmap_and_remap_at_the_same_address():
    """(a) reserve + map, a tensor view, a graph reading it; unmap frees the mapped size;
    map again at the same address with new contents; the replay reads the new contents."""
    from replaylm.graphs.graph import Graph
    from replaylm.memory import vmm
    from replaylm.memory.arena import Arena

    dev = _device()
    try:
        arena = Arena(dev)
    except vmm.VMMError as e:
        pytest.fail(f"step 1 (driver: granularity): {e}")
    g = arena.granularity
    assert g > 0 and g & (g - 1) == 0, f"step 1: granularity {g} is not a power of two"
    try:
        region = arena.region("probe", 16 * g)
    except vmm.VMMError as e:
        pytest.fail(f"step 2 (cuMemAddressReserve/cuMemCreate/cuMemMap/cuMemSetAccess): {e}")
    assert region.size == 16 * g and region.mapped, "step 2: region not fully mapped"
    x = region.take(torch.float32, (4096,))
    assert x.device == dev, f"step 3: the view is on {x.device}, not {dev}"
    assert x.data_ptr() == region.ptr, (
        f"step 3: __cuda_array_interface__ view at {x.data_ptr():#x}, mapped at {region.ptr:#x}")
    x.fill_(1.0)
    assert x.sum().item() == 4096.0, "step 4: the mapped memory does not hold what was written"

    graph = Graph("probe:4096", dev, None, {})
    out = graph.capture(lambda t=x: [t.mul(2.0).sum().reshape(1)])[0]
    graph.replay()
    torch.cuda.synchronize()
    assert out.item() == 8192.0, f"step 5: the first replay read {out.item()}, not 8192"

    before = _free()
    region.poison()
    region.release()
    freed = _free() - before
    assert not region.mapped, "step 6: the region still counts as mapped"
    assert freed >= region.size, (
        f"step 6: unmap + release freed {freed} bytes by mem_get_info, mapped {region.size}")

    region.remap()
    assert region.mapped and x.data_ptr() == region.ptr, "step 7: remapped elsewhere"
    assert _free() <= before + g, "step 7: mapping back did not take the memory again"
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert out.item() == 3.0 * 2 * 4096, (
        f"step 8: the replay after the remap read {out.item()}, not {3.0 * 2 * 4096}: the "
        "graph does not read the new physical memory at the old address")
    del graph, out, x
    arena.close()


def test_audit_refuses_a_graph_that_reads_an_unmapped_chunk(monkeypatch):
    """(c) a graph captured against a view of an arena chunk that is then unmapped: the audit
    names the mode, tier, kernel and parameter; after the chunk is mapped back it passes."""
    from replaylm.graphs.audit import AddressBook, GraphAuditError, audit_graphs
    from replaylm.graphs.graph import Graph
    from replaylm.memory import arena as arena_mod

    dev = _device()
    arena = arena_mod.Arena(dev)
    g = arena.granularity
    monkeypatch.setattr(arena_mod, "CHUNK_BYTES", g)  # one chunk per granule
    region = arena.region("victim", 4 * g)
    assert len(region.chunks) == 4, f"step 1: {len(region.chunks)} chunks, not 4"
    y = region.view(2 * g, torch.float32, (1024,))  # inside chunk 2
    y.fill_(1.0)
    graph = Graph("ragged:8", dev, None, {})
    graph.capture(lambda t=y: [t.add(1.0)])
    torch.cuda.synchronize()

    ok = audit_graphs([graph], AddressBook(arena))
    print(f"\naudit of one graph: {ok.seconds * 1e3:.2f} ms, {ok.kernels} kernels, "
          f"{ok.pointers} arena pointers")
    assert ok.kernels >= 1, f"step 2: the audit found no kernel node ({ok})"
    assert ok.unreadable == 0, f"step 2: kernel parameters unreadable ({ok})"
    assert ok.pointers >= 1, f"step 2: the audit saw no pointer into the arena ({ok})"

    arena.unmap_chunk(region, 2)
    with pytest.raises(GraphAuditError) as err:
        audit_graphs([graph], AddressBook(arena))
    msg = str(err.value)
    print(f"audit refusal: {msg}")
    for part in ("mode ragged", "tier 8", "parameter", "kernel", "'victim'", "[2]"):
        assert part in msg, f"step 3: the refusal does not name {part!r}: {msg}"
    assert "kernel '?'" not in msg, f"step 3: kernel name unavailable: {msg}"

    region.remap()
    assert audit_graphs([graph], AddressBook(arena)).pointers >= 1, "step 4: remapped"
    del graph, y
    arena.close()


def test_engine_sleeps_frees_its_memory_and_wakes_to_the_same_outputs():
    """(b) llama3.2-1b (dummy weights) with enable_sleep_mode: sleep(1) frees at least 95%
    of the weight and KV bytes, wake restores the outputs bit for bit without recapture, and
    the audit passes (and refuses while asleep)."""
    from replaylm import LLM, SamplingParams
    from replaylm.graphs.audit import GraphAuditError

    llm = LLM("llama3.2-1b", load_format="dummy", enable_sleep_mode=True,
              skip_tokenizer_init=True, dtype="bfloat16", max_num_seqs=4, num_kv_blocks=64,
              max_model_len=512, max_num_batched_tokens=512, cuda_graph_mode="full",
              graph_tiers="1,2,4", graph_check=2)
    core = llm.engine
    runner = core.runner
    weights = runner.arena.regions["weights"]
    emb = runner.model.embed_tokens.weight
    assert weights.ptr <= emb.data_ptr() < weights.ptr + weights.size, \
        "step 1: the weights are not in the arena"
    kv = runner.kv_caches[0][0]
    assert runner.arena.locate(kv.data_ptr()) is not None, "step 1: the KV pool is not in it"

    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1 + (7 * i + j) % 1000 for j in range(20 + 9 * i)] for i in range(4)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    stats = llm.graph_stats()
    graphs = (stats["num_graphs"], stats["capture_seconds"])
    assert stats["hits"], f"step 2: no step replayed a graph ({stats})"

    t0 = time.perf_counter()
    audit = llm.audit_graphs()
    print(f"\naudit of {audit.graphs} graphs: {time.perf_counter() - t0:.3f} s "
          f"({audit.kernels} kernels, {audit.params} params, {audit.pointers} pointers, "
          f"{audit.unreadable} unreadable)")
    assert audit.kernels > 0 and audit.pointers > 0, f"step 3: the audit saw nothing ({audit})"

    report = llm.sleep(level=1)
    arena_bytes = report.weight_bytes + report.kv_bytes
    print(f"sleep: freed {report.freed_bytes / GIB:.3f} GiB of {arena_bytes / GIB:.3f} GiB "
          f"in {report.seconds:.2f} s")
    assert report.freed_bytes >= 0.95 * arena_bytes, (
        f"step 4: mem_get_info shows {report.freed_bytes} bytes freed, under 95% of the "
        f"{arena_bytes} bytes of weights and KV")
    with pytest.raises(GraphAuditError):  # the graphs point into unmapped memory now
        llm.audit_graphs()
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompts[:1], sp, use_tqdm=False)

    wake = llm.wake_up()
    print(f"wake: {wake.seconds:.2f} s, audit {wake.audit}")
    assert wake.audit is not None and wake.audit["kernels"] > 0, \
        "step 5: graph_check is on, so the wake must have audited the graphs"
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert after == before, "step 6: outputs after wake differ from those before sleep"
    stats = llm.graph_stats()
    assert (stats["num_graphs"], stats["capture_seconds"]) == graphs, "step 7: recaptured"
    assert core.block_manager.num_used_blocks == 0
