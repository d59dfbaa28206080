"""Stop strings: caught across token boundaries, held back while forming, never streamed."""

from __future__ import annotations

import pytest

from replaylm import LLM, SamplingParams
from replaylm.engine.stop_strings import StopStringBuffer


def test_buffer_holds_back_a_forming_stop_and_cuts_it() -> None:
    buf = StopStringBuffer(["STOP", "xy"])
    assert buf.push("hello S") == "hello "  # "S" may start "STOP"
    assert buf.push("T") == ""  # "ST" still may
    assert buf.push("OP and more") == ""  # matched: nothing after it, the stop itself dropped
    assert buf.matched == "STOP" and buf.text == "hello "
    assert buf.push("later") == "" and buf.flush() == ""


def test_buffer_releases_a_false_start_and_flushes() -> None:
    buf = StopStringBuffer(["abc"])
    assert buf.push("xa") == "x"
    assert buf.push("bd") == "abd"  # "abd" cannot become "abc": released at once
    assert buf.push("ab") == ""
    assert buf.flush() == "ab" and buf.matched is None


def test_buffer_earliest_match_include_and_min_tokens() -> None:
    buf = StopStringBuffer(["cd", "bcde"], include_stop=True)
    assert buf.push("abcdef") == "abcd"  # "cd" completes first
    assert buf.matched == "cd"
    unchecked = StopStringBuffer(["ab"])
    assert unchecked.push("xab", check=False) == "x"  # before min_tokens: not a stop yet,
    assert unchecked.matched is None  # but held back, since it may begin a later one
    assert unchecked.push("ab") == "ab"  # now it counts: the held "ab" is released
    assert unchecked.matched == "ab" and unchecked.text == "xab"


def test_buffer_without_stops_streams_everything() -> None:
    buf = StopStringBuffer([])
    assert buf.push("abc") == "abc" and buf.flush() == ""


@pytest.fixture(scope="module")
def llm():
    return LLM("default", num_kv_blocks=48, max_num_seqs=4, max_model_len=256)


def _boundaries(tok, ids: list[int]) -> list[int]:
    return [len(tok.decode(ids[: i + 1], skip_special_tokens=True)) for i in range(len(ids))]


@pytest.mark.parametrize("include", [False, True])
def test_engine_stop_string_split_across_tokens(llm, include) -> None:
    tok = llm.get_tokenizer()
    sp = dict(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    base = llm.generate(["The engine"], SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    text, ids = base.text, base.token_ids
    ends = _boundaries(tok, ids)
    assert ends[-1] == len(text)
    # A stop string made of the last 2 characters of token 10 and the first 2 of token 11.
    b = ends[10]
    assert ends[11] - b >= 2 and b - ends[9] >= 2, "pick tokens with longer texts"
    stop = text[b - 2 : b + 2]
    first = text.find(stop)
    assert any(first < e < first + len(stop) for e in ends), "stop must straddle tokens"
    # The token that completes the stop string is the last one generated.
    last = next(i for i, e in enumerate(ends) if e >= first + len(stop))
    want_text = text[: first + len(stop)] if include else text[:first]

    core = llm.engine
    core.add_request("s", "The engine", SamplingParams(**sp, stop=[stop, "\x00never"],
                                                       include_stop_str_in_output=include))
    got_text, got_ids, finished = "", [], None
    while core.has_unfinished():
        for d in core.step():
            assert include or stop not in d.new_text
            got_text += d.new_text
            got_ids += d.new_token_ids
            if d.finished:
                finished = d
                # Finished: its blocks are free, or parked until the step in flight resolves.
                assert core.block_manager.num_used_blocks == 0 \
                    or core.scheduler.num_parked == 1
        core.scheduler.check_integrity()
    assert core.block_manager.num_used_blocks == 0
    assert got_text == want_text
    assert got_ids == ids[: last + 1]
    assert finished.finish_reason == "stop" and finished.stop_reason == stop

    out = llm.generate(["The engine"], SamplingParams(**sp, stop=stop,
                                                      include_stop_str_in_output=include),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (want_text, "stop", stop)


def test_stop_strings_need_a_tokenizer(tmp_path_factory) -> None:
    ids_only = LLM("default", num_kv_blocks=48, max_model_len=256, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="SamplingParams.stop needs a tokenizer"):
        ids_only.generate([[5, 6]], SamplingParams(stop=["x"]), use_tqdm=False)
