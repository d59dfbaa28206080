"""Adapters beyond the device slots: they wait on the host (or on disk past
``max_cpu_loras``) and take turns in the slots, with every output still PEFT's; the prefix
cache never shares blocks across adapters; bad adapters and settings are clear errors."""

from __future__ import annotations

import json
import shutil

import pytest

from replaylm import LLM, LoRARequest, SamplingParams
from tests.lora.helpers import GREEDY, PROMPTS
from tests.lora.test_lora_engine import engine, tokens


@pytest.fixture(scope="module")
def setup(lora_setup):
    return lora_setup("llama")


@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
@pytest.mark.parametrize("max_loras,max_cpu_loras", [(1, 1), (2, 3)])
def test_more_adapters_than_slots(setup, mode, max_loras, max_cpu_loras):
    """Three adapters and the base in one generate call with fewer slots: requests wait for
    a slot, adapters swap in and out (read again from disk past max_cpu_loras), and every
    output is PEFT's."""
    base, loras, expected = setup
    llm = engine(base, mode, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    choices = [*loras, None]
    prompts, reqs, want = [], [], []
    for i, p in enumerate(PROMPTS):
        for j in range(len(choices)):
            prompts.append(p)
            reqs.append(choices[(i + j) % len(choices)])
            want.append(expected[reqs[-1]][i])
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)) == want
    manager = llm.engine.lora
    assert manager.loads > len(loras) - max_loras  # slots were reused
    assert len(manager.host) <= max_cpu_loras
    assert sum(manager.holders) == 0  # every request gave its slot back
    llm.engine.scheduler.check_integrity()


def test_prefix_cache_keyed_by_adapter(setup):
    """A prompt of two full blocks, under the base, then an adapter, then another, then the
    first again: only the repeat reuses blocks, and each output is that adapter's."""
    base, loras, expected = setup
    llm = engine(base, "eager", enable_prefix_caching=True)
    prompt = [3 + (11 * j) % 250 for j in range(40)]
    cache = llm.engine.block_manager.cache
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    runs = {}
    for lora in [None, loras[0], loras[1], None, loras[0]]:
        before = cache.hit_tokens
        out = tokens(llm.generate([prompt], params, use_tqdm=False, lora_request=lora))[0]
        runs.setdefault(lora, []).append((out, cache.hit_tokens - before))
    for lora, seen in runs.items():
        assert seen[0][1] == 0, f"first run of {lora} reused another adapter's blocks"
        if len(seen) > 1:
            assert seen[1][1] == 32 and seen[1][0] == seen[0][0]  # its own blocks, reused
    outs = {lora: seen[0][0] for lora, seen in runs.items()}
    assert len({tuple(o) for o in outs.values()}) == 3


def test_bad_adapters(setup, tmp_path):
    base, loras, _ = setup
    llm = engine(base, "eager", max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16 is above max_lora_rank=8"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=loras[1])
    with pytest.raises(ValueError, match="needs adapter_config.json"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("x", 9, str(tmp_path)))
    # An unsupported target module.
    bad = tmp_path / "bad"
    shutil.copytree(loras[0].lora_path, bad)
    conf = json.loads((bad / "adapter_config.json").read_text())
    conf["target_modules"] = ["q_proj", "lm_head"]
    (bad / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"target modules \['lm_head'\] are not supported"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("bad", 5, str(bad)))
    # Another id under a known name, and a list of the wrong length.
    llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=loras[0])
    with pytest.raises(ValueError, match="already in use"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest(loras[0].lora_name, 7, loras[0].lora_path))
    with pytest.raises(ValueError, match="got 2 lora_requests for 1 prompts"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=[None, None])
    assert not llm.engine.has_unfinished()
    llm.engine.scheduler.check_integrity()


def test_adapter_for_another_base_model(tmp_path_factory, setup):
    """An adapter trained on another shape (qwen2's tiny checkpoint) is refused at load."""
    from tests.conftest import make_checkpoint
    from tests.lora.helpers import make_adapter

    base, _, _ = setup
    other = tmp_path_factory.mktemp("lora-other-base")
    make_checkpoint("qwen2", other)
    path = tmp_path_factory.mktemp("lora-other")
    make_adapter(other, path, 8, 0)
    llm = engine(base, "eager")
    with pytest.raises(ValueError, match="another base model"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("other", 1, str(path)))


def test_settings():
    with pytest.raises(ValueError, match="max_cpu_loras=1 is invalid"):
        LLM("default", enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="enable_dp_attention"):
        LLM("default", enable_lora=True, data_parallel_size=2, enable_dp_attention=True)
    with pytest.raises(ValueError, match="needs the engine started with enable_lora=True"):
        LLM("default", load_format="dummy", skip_tokenizer_init=True, num_kv_blocks=8,
            max_model_len=32, enforce_eager=True).generate(
            [[1, 2]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, "/nowhere"))


def test_manager_slots_and_removal(setup):
    """One slot, two adapters: the second waits while the first is held; an adapter removed
    with a request still queued is read again for it, and its slot empties after."""
    from types import SimpleNamespace

    import torch

    from replaylm.engine.loading import load_model_config
    from replaylm.lora.manager import LoRAManager
    from replaylm.lora.slots import LoRASlots

    base, loras, _ = setup
    cfg, _ = load_model_config(str(base))
    slots = LoRASlots(cfg, 1, 16, 32, torch.float32, torch.device("cpu"))
    manager = LoRAManager(cfg, slots, max_cpu_loras=1)
    manager.add(loras[0])  # rank 8
    manager.add(loras[1])  # rank 16; evicts loras[0] from the host
    first = SimpleNamespace(lora_int_id=1, lora_slot=-1)
    second = SimpleNamespace(lora_int_id=2, lora_slot=-1)
    assert manager.ready(first)
    manager.hold(first)
    assert first.lora_slot == 0 and int(slots.ranks.max()) == 8
    assert not manager.ready(second)  # the only slot is held
    manager.remove("a1")
    manager.release(first)
    assert manager.ready(second)  # read again from its path for the queued request
    manager.hold(second)
    assert int(slots.ranks.max()) == 16
    manager.release(second)
    assert manager.slot_adapter == [None] and int(slots.ranks.abs().sum()) == 0
    with pytest.raises(KeyError):
        manager.remove("a1")
