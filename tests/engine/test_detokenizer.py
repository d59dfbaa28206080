"""``decoder_for``: the Rust backend's decode where it gives the wrapper's text, the wrapper's
where its space cleanup would change it; the incremental text equals a whole decode.

transformers is imported inside the tests: importing it imports Triton, which must not happen
before ``tests/kernels`` turns the interpreter on in the same process."""

from __future__ import annotations

import random

from replaylm.engine.detokenizer import IncrementalDetokenizer, decoder_for
from replaylm.model.shapes import DEFAULT_MODEL_DIR


def test_the_default_tokenizer_decodes_through_its_backend_with_the_same_text():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    decode = decoder_for(tok)
    assert decode is decoder_for(tok)  # probed once per tokenizer
    assert decode.__name__ == "direct"
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def _cleaning_tokenizer():
    """A word-level tokenizer whose wrapper removes the space before punctuation."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1, ".": 2, "b": 3, ",": 4, "c": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                   clean_up_tokenization_spaces=True)


def test_a_tokenizer_whose_wrapper_cleans_spaces_keeps_the_wrapper():
    tok = _cleaning_tokenizer()
    ids = tok.encode("a . b , c", add_special_tokens=False)
    assert tok.decode(ids) != tok._tokenizer.decode(ids)  # the cleanup is on
    decode = decoder_for(tok)
    assert decode.__name__ == "wrapped"
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    text = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
