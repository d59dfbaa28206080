"""Train the built-in default tokenizer (``replaylm/assets/default``): a 4096-entry byte-level BPE.

The corpus is text every Python install has, so the script needs no network: the stdlib's
``.py`` sources (code, docstrings and comments), files sorted by path and capped at
``--max-bytes`` so a rerun on the same Python version yields the same JSON. Only the JSON
files are committed; rerun this script only to change the tokenizer.

    python scripts/train_tokenizer.py [--out DIR] [--vocab-size 4096]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Ids 0..3 in this order: the model config and generation config rely on them.
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "replaylm" / "assets" / "default"


def corpus_files(max_bytes: int) -> list[Path]:
    """Stdlib sources in sorted path order, up to ``max_bytes``; tests and vendored code skipped
    because they are dominated by repetitive fixtures rather than prose and ordinary code."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "idle_test", "lib2to3", "__pycache__"}
    chosen: list[Path] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts):
            continue
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        chosen.append(path)
        total += size
    return chosen


def iter_text(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


def train(out: Path, vocab_size: int = 4096, max_bytes: int = 4_000_000) -> Tokenizer:
    """Train the BPE and write ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json`` into ``out``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        # Every byte is a base token, so no input is ever out of vocabulary.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = corpus_files(max_bytes)
    tok.train_from_iterator(iter_text(files), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # BOS is prepended at encode time, as Llama-3 does; ByteLevel offsets are kept intact.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0",
            pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
            special_tokens=[(BOS, bos_id)],
        ),
    ])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    print(f"trained on {len(files)} files; vocab {tok.get_vocab_size()}; wrote {out}")
    return tok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=4_000_000)
    args = parser.parse_args(argv)
    train(args.out, args.vocab_size, args.max_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
