"""The next step booked while a constrained step's masks fill (``EngineCore._book_next``):
its requests count as in flight, so an abort between steps parks them until the booked step
has run and resolved; nothing leaks and the other requests finish as usual."""

from __future__ import annotations

import re

from replaylm import LLM, SamplingParams
from replaylm.sampling_params import StructuredOutputsParams as SO


def test_abort_while_a_step_is_booked():
    llm = LLM("default", max_num_seqs=8, max_model_len=128, num_kv_blocks=40)
    core = llm.engine
    regex = "[a-z]{10}"
    for i in range(5):  # above apply_beside_rows: the apply (and the booking) on the worker
        core.add_request(f"so{i}", "hello", SamplingParams(
            temperature=1.0, seed=i, max_tokens=16, structured_outputs=SO(regex=regex)))
    core.add_request("free", "hi", SamplingParams(temperature=0.0, max_tokens=24,
                                                  ignore_eos=True))
    texts: dict[str, str] = {}
    finish: dict[str, str] = {}
    aborted = None
    while core.has_unfinished():
        for d in core.step():
            texts[d.request_id] = texts.get(d.request_id, "") + d.new_text
            if d.finished:
                finish[d.request_id] = d.finish_reason
        core.scheduler.check_integrity()
        booked = core.booked
        if aborted is None and booked is not None:
            victim = next(s.request for s in booked.out.scheduled
                          if s.request.request_id.startswith("so"))
            assert victim.inflight >= 1  # booked: counted as in flight
            aborted = victim.request_id
            assert core.abort(aborted)
            assert victim.is_finished
            assert victim.block_ids  # parked: the booked step still reads its blocks
    assert aborted is not None, "no step was booked"
    assert core.block_manager.num_used_blocks == 0
    for rid, text in texts.items():
        if rid.startswith("so") and rid != aborted:
            assert finish[rid] == "stop" and re.fullmatch(regex, text), (rid, text)
    assert aborted not in finish  # an aborted request gets no more deltas
    assert len(texts.get("free", "")) > 0 and finish["free"] == "length"
