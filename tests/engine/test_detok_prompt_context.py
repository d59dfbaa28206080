"""A SentencePiece-style (Metaspace) tokenizer keeps the completion's leading space: the
output reads as the continuation of the prompt, ``decode(prompt + output)[len(decode(prompt)):]``
(how vLLM primes incremental detokenization, and how OpenAI completions read)."""

from __future__ import annotations

import pytest

from replaylm import LLM, SamplingParams

WORDS = ["the", "cat", "sat", "Hello", "on", "mat", "a", "dog"]


def _metaspace_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS:
        vocab["\u2581" + w] = len(vocab)  # "▁the": the word after a space
    for w in WORDS:
        vocab[w] = len(vocab)  # "the": glued to the previous word
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>"), vocab


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.conftest import make_checkpoint

    tok, vocab = _metaspace_tokenizer()
    path = tmp_path_factory.mktemp("metaspace-llama")
    make_checkpoint("llama", path, seed=4, vocab_size=len(vocab))
    tok.save_pretrained(str(path))
    llm = LLM(str(path), num_kv_blocks=32, max_model_len=64, max_num_seqs=4)
    return llm, vocab


def _continuation(tok, prompt_ids, out_ids) -> str:
    full = tok.decode(prompt_ids + out_ids, skip_special_tokens=True)
    head = tok.decode(prompt_ids, skip_special_tokens=True)
    assert full.startswith(head)
    return full[len(head):]


def test_first_token_keeps_its_space(setup) -> None:
    llm, vocab = setup
    tok = llm.get_tokenizer()
    assert tok.decode([vocab["\u2581the"]]) == "the"  # alone, the space is dropped
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                        logit_bias={vocab["\u2581the"]: 100.0})
    out = llm.generate(["Hello"], sp, use_tqdm=False)[0].outputs[0]
    assert out.text == " the the the"


def test_text_is_the_continuation_of_the_prompt(setup) -> None:
    llm, _ = setup
    tok = llm.get_tokenizer()
    core = llm.engine
    for seed in range(4):
        prompt = "Hello the cat"
        sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
        core.add_request(f"r{seed}", prompt, sp)
        streamed, ids = "", []
        while core.has_unfinished():
            for d in core.step():
                streamed += d.new_text
                ids += d.new_token_ids
        assert streamed == _continuation(tok, tok.encode(prompt), ids), seed


def test_stop_string_with_leading_space_matches_the_first_token(setup) -> None:
    llm, vocab = setup
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=[" the"],
                        logit_bias={vocab["\u2581the"]: 100.0})
    out = llm.generate(["Hello"], sp, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", " the")
    assert out.token_ids == [vocab["\u2581the"]]
