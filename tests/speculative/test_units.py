"""The spec package's pure parts: settings, the n-gram drafter, device acceptance."""

from __future__ import annotations

import argparse

import pytest
import torch

from replaylm.config import EngineArgs
from replaylm.speculative.acceptance import emitted_rows
from replaylm.speculative.config import SpecConfig
from replaylm.speculative.ngram import NgramDrafter


@pytest.mark.parametrize("cfg, needle", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "['method']='eagle'"),
    ({"method": "draft_model", "model": "no-such-model", "num_speculative_tokens": 2},
     "['model']='no-such-model' is invalid"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "draft_model", "model": "llama3.2-1b", "num_speculative_tokens": 0},
     "['num_speculative_tokens']=0"),
    ({"method": "draft_model", "model": "llama3.2-1b", "num_speculative_tokens": 2,
      "draft_confidence": 1.0}, "['draft_confidence']=1.0 is invalid"),
    ({"method": "draft_model", "model": "llama3.2-1b", "num_speculative_tokens": 2,
      "draft_confidence": 0}, "['draft_confidence']=0 is invalid"),
    ({"method": "draft_model", "model": "llama3.2-1b", "num_speculative_tokens": 2,
      "num_draft_kv_blocks": 1}, "['num_draft_kv_blocks']=1 is invalid"),
    ({"method": "draft_model", "model": "llama3.2-1b", "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, "['prompt_lookup_max'] is only for method 'ngram'"),
    ({"method": "ngram", "model": "llama3.2-1b", "num_speculative_tokens": 2},
     "['model'] is only for method 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "['num_speculative_tokens']=0"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "['prompt_lookup_min']=3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key 'lookahead'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "budget": "magic"}, "['budget']='magic'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "pipeline": "always"},
     "['pipeline']='always'"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config_names_the_field(cfg, needle):
    with pytest.raises(ValueError, match="EngineArgs.speculative_config") as e:
        EngineArgs(speculative_config=cfg)
    assert needle in str(e.value)


def test_num_speculative_tokens_above_the_top_tier_is_refused():
    cfg = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 8})
    cfg.check_fits(max_num_batched_tokens=64, top_tier=16)
    with pytest.raises(ValueError, match=r"\['num_speculative_tokens'\]=8 .*\(8 tokens"):
        cfg.check_fits(max_num_batched_tokens=64, top_tier=8)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        cfg.check_fits(max_num_batched_tokens=5, top_tier=0)


def test_cli_takes_speculative_config_as_json():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 3}'])
    args = EngineArgs.from_cli_args(ns)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert EngineArgs.from_cli_args(parser.parse_args([])).speculative_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{not json"])


def _lookup(tokens, k, n_min, n_max):
    """The prompt-lookup rule, spelled out: for n from n_max down, the earlier occurrences of
    the last n tokens; the latest followed by k tokens, else the earliest."""
    total = len(tokens)
    if k < 1 or total < n_min + 1:
        return []
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        hits = [i for i in range(total - n) if tokens[i:i + n] == tokens[total - n:]]
        if hits:
            whole = [i for i in hits if i + n + k <= total]
            start = (whole[-1] if whole else hits[0]) + n
            return tokens[start:start + k]
    return []


class _Req:
    def __init__(self, t):
        self.all_token_ids = t


def _ngram(toks, k, n_min, n_max):
    return NgramDrafter(n_min, n_max).propose([_Req(toks)], [k])[0]


def test_ngram_takes_the_longest_then_latest_match():
    # Suffix [1, 2, 3]: its 3-gram occurs at 0 (then 9) and the 1-gram 3 later at 6 (then 7).
    toks = [1, 2, 3, 9, 5, 4, 3, 7, 8, 1, 2, 3]
    assert _ngram(toks, 2, 1, 3) == [9, 5]
    assert _ngram(toks, 2, 1, 1) == [7, 8]  # only 1-grams: the latest 3 is at 6
    assert _ngram(toks, 6, 1, 1) == [9, 5, 4, 3, 7, 8]  # the latest with 6 tokens after
    assert _ngram(toks, 5, 4, 4) == []  # no earlier 4-gram match
    # No match has k tokens after it: the earliest, whose continuation is the longest.
    assert _ngram([1, 2, 1, 2, 1], 10, 1, 2) == [2, 1]
    assert _ngram([7, 7, 7, 7], 4, 1, 1) == [7, 7, 7]
    assert _ngram([4, 4], 0, 1, 2) == [] and _ngram([4], 3, 1, 2) == []
    drafts = NgramDrafter(1, 3).propose([_Req(toks), _Req([5, 6, 7])], [2, 3])
    assert drafts == [[9, 5], []]


def test_ngram_index_grows_with_the_request():
    """A request's index, extended token by token across calls, drafts what the rule says
    on the whole sequence every time (random sequences over a small vocabulary)."""
    g = torch.Generator().manual_seed(5)
    for n_min, n_max in ((1, 3), (2, 4), (1, 1)):
        drafter = NgramDrafter(n_min, n_max)
        req = _Req([])
        for _ in range(120):
            req.all_token_ids = req.all_token_ids + torch.randint(
                0, 4, (int(torch.randint(1, 3, (1,), generator=g)),), generator=g).tolist()
            k = int(torch.randint(0, 6, (1,), generator=g))
            toks = req.all_token_ids
            assert drafter.propose([req], [k]) == [_lookup(toks, k, n_min, n_max)], (toks, k)


def test_emitted_rows_stop_after_the_first_mismatch():
    # Request A verifies 3 drafts (rows 0-3), B decodes (row 4), C verifies 2 (rows 5-7).
    tokens = torch.tensor([10, 11, 99, 13, 20, 30, 31, 32])
    draft_next = torch.tensor([10, 11, 12, -1, -1, 30, 31, -1])
    seg_start = torch.tensor([0, 0, 0, 0, 4, 5, 5, 5])
    got = emitted_rows(tokens, draft_next, seg_start).tolist()
    assert got == [True, True, True, False, True, True, True, True]
    # A first draft rejected: only its correction is emitted.
    tokens[0] = 7
    assert emitted_rows(tokens, draft_next, seg_start).tolist()[:4] == [True, False, False, False]
