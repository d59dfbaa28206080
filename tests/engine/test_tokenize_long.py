"""Long prompt texts are counted piece by piece and refused early, never refused wrongly:
whatever ``tokenize_text`` returns is exactly ``tokenizer.encode``, and it refuses only texts
that really have at least ``max_model_len`` tokens."""

from __future__ import annotations

import random
import time

import pytest

from replaylm.config import EngineArgs
from replaylm.engine.loading import load_model_config, load_tokenizer, tokenize_text


@pytest.fixture(scope="module")
def tok():
    _, model_dir = load_model_config("default")
    return load_tokenizer(EngineArgs(), model_dir)


def _texts() -> list[str]:
    rng = random.Random(0)
    words = ["def", "return", "self", "x", "  ", "\n", "\n\n    ", "é", "日本", "\t", "(", "):"]
    texts = []
    for n in (2000, 12000):
        texts.append("".join(rng.choice(words) + rng.choice(["", " ", "  "]) for _ in range(n)))
    texts.append("a" * 30_000)  # no whitespace at all: cut anywhere
    texts.append(" " * 15_000 + "x" * 15_000)  # one huge whitespace run, then one word
    texts.append(("word " * 30 + "\n") * 300)
    return texts


@pytest.mark.parametrize("i", range(5))
def test_never_refuses_what_fits_and_returns_exact_ids(tok, i, monkeypatch) -> None:
    import replaylm.engine.loading as loading

    monkeypatch.setattr(loading, "_LONG_TEXT_CHARS_PER_TOKEN", 0)  # count every text in pieces
    text = _texts()[i]
    exact = tok.encode(text)
    n = len(exact)
    for limit in {max(1, n - 1), n, n + 17, 64}:
        try:
            got = tokenize_text(tok, text, limit)
        except ValueError as e:
            assert n >= limit, (limit, n, str(e))
            assert str(e).startswith("prompt has more than")
        else:
            assert got == exact


def test_megabytes_are_refused_quickly(tok) -> None:
    text = "def foo(x):\n    return x + 1\n" * 150_000  # 4.4 MB
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="max_model_len=2048"):
        tokenize_text(tok, text, 2048)
    assert time.perf_counter() - t0 < 2.0
