"""Stop strings: the first to complete wins whatever the chunking, matching costs time in
proportion to the new text, the list is bounded, and min_tokens gates them as in vLLM."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replaylm import LLM, SamplingParams
from replaylm.engine.stop_strings import StopStringBuffer


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Reference: the earliest end position at which the text ends with a stop string, and
    the longest such stop string."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return end, max(hits, key=len)
    return None


def _feed(stops: list[str], pieces: list[str], include: bool) -> tuple[str, StopStringBuffer]:
    buf = StopStringBuffer(stops, include)
    out = ""
    for p in pieces:
        got = buf.push(p)
        out += got
        if buf.matched is None:
            # Held back: exactly the longest tail that may still become a stop string.
            text = buf.text
            tail = max((k for k in range(len(text) + 1)
                        if any(len(s) > k and s.startswith(text[len(text) - k:])
                               for s in stops)), default=0)
            assert len(text) - len(out) == tail
    out += buf.flush()
    return out, buf


@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
def test_buffer_matches_reference_for_any_chunking(text, stops, cuts, include) -> None:
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, buf = _feed(stops, pieces, include)
    ref = _first_stop(text, stops)
    if ref is None:
        assert out == text and buf.matched is None
    else:
        end, stop = ref
        assert buf.matched == stop
        assert out == (text[:end] if include else text[: end - len(stop)])
    # The same text in one piece gives the same answer.
    assert _feed(stops, [text], include)[0] == out


def test_earliest_end_wins_then_longest() -> None:
    buf = StopStringBuffer(["cd", "bcde"], include_stop=True)
    assert buf.push("abcdef") == "abcd" and buf.matched == "cd"
    buf = StopStringBuffer(["bcd", "cd"])
    assert buf.push("abcdx") == "a" and buf.matched == "bcd"


def test_push_cost_does_not_grow_with_the_stop_list() -> None:
    rng = random.Random(0)
    alphabet = "abcdefghij "
    worst = ["".join(rng.choice(alphabet) for _ in range(256)) for _ in range(32)]
    pieces = ["".join(rng.choice(alphabet) for _ in range(4)) for _ in range(3000)]

    def cost(stops: list[str]) -> float:
        StopStringBuffer(stops)  # build (cached) outside the timing
        best = float("inf")
        for _ in range(3):
            buf = StopStringBuffer(stops)
            t0 = time.perf_counter()
            for p in pieces:
                buf.push(p)
            best = min(best, time.perf_counter() - t0)
        return best

    one = cost(["zz"])
    assert cost(worst) < 3 * one + 0.01, (cost(worst), one)


@pytest.fixture(scope="module")
def llm():
    return LLM("default", num_kv_blocks=64, max_num_seqs=8, max_model_len=256,
               max_stop_strings=4, max_stop_string_length=8)


def test_stop_list_limits_name_the_field(llm) -> None:
    with pytest.raises(ValueError, match=r"^SamplingParams\.stop=.*max_stop_strings=4"):
        llm.engine.add_request("x", "hi", SamplingParams(stop=["a", "b", "c", "d", "e"]))
    with pytest.raises(ValueError, match=r"^SamplingParams\.stop=.*max_stop_string_length=8"):
        llm.engine.add_request("x", "hi", SamplingParams(stop=["123456789"]))
    assert not llm.engine.has_unfinished()


def test_stop_string_counts_only_after_min_tokens(llm) -> None:
    """A stop string completed by exactly the min_tokens-th token does not stop the request
    (vLLM checks stop strings once more than min_tokens tokens exist); one token later it
    does."""
    tok = llm.get_tokenizer()
    sp = dict(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    base = llm.generate(["Once"], SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    ends = [len(tok.decode(base.token_ids[: i + 1])) for i in range(len(base.token_ids))]
    # Token m (1-based) completes a stop string that occurs nowhere else in the text.
    for m in range(4, len(ends)):
        stop = base.text[max(0, ends[m - 1] - 3): ends[m - 1]]
        if len(stop) >= 2 and base.text.count(stop) == 1 and ends[m - 2] < ends[m - 1]:
            break
    else:
        pytest.skip("no unique stop string in this text")
    at = llm.generate(["Once"], SamplingParams(**sp, stop=[stop], min_tokens=m),
                      use_tqdm=False)[0].outputs[0]
    assert at.finish_reason == "length" and at.token_ids == base.token_ids
    before = llm.generate(["Once"], SamplingParams(**sp, stop=[stop], min_tokens=m - 1),
                          use_tqdm=False)[0].outputs[0]
    assert before.finish_reason == "stop" and before.token_ids == base.token_ids[:m]
    assert before.text == base.text[: base.text.index(stop)]
