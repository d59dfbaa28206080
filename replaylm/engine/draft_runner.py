"""The draft model's runner (``DraftModelRunner``): a second ``ModelRunner`` that drafts for the
target (``engine.draft_model``), loaded and checked against the target before the target's
KV pool is sized."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from replaylm.batch import BLOCK_SIZE
from replaylm.config import EngineArgs
from replaylm.engine.model_runner import ModelRunner
from replaylm.engine.runner_setup import make_attention_backend
from replaylm.memory.sleep import Sleeper
from replaylm.model.config import ModelConfig
from replaylm.speculative.config import FIELD, SpecConfig


class DraftModelRunner(ModelRunner):
    """The draft model, its KV pool and graphs (the target's graph policy, attention and
    dtype settings), built in two steps: loaded first (on CUDA with its activation peak
    profiled), so the target sizes its own pool around this one's memory (``partner_*``),
    then started with its block count.

    Its pool holds, by default, as many tokens as the target's (one draft block per target
    block) plus ``num_speculative_tokens`` per request slot: the draft then has room for
    every request the target runs except where the target shares blocks (prefix-cache hits,
    n > 1 siblings), whose excess requests go undrafted for the step.
    """

    split_tails = False  # drafts are never constrained: no tail graphs
    samples_in_tail = False

    def __init__(self, args: EngineArgs, cfg: ModelConfig, model_dir: Path | None,
                 max_model_len: int, spec: SpecConfig) -> None:
        self._setup(args, cfg, max_model_len)
        self.spec = None
        self.rows_per_req = 1
        self.kv_partner = None
        self.verify_accept = None
        self.attn = make_attention_backend(args.attention_backend, self.device, self.graph_mode)
        self._load(model_dir)
        # Sleep mode: the draft's weights and KV pool sleep and wake with the target's.
        self.arena, self._weights_region = self._adopt_weights()
        self.sleeper: Sleeper | None = None
        self.fixed_blocks = spec.num_draft_kv_blocks
        self.slack_blocks = args.max_num_seqs * -(-spec.num_speculative_tokens // BLOCK_SIZE)
        self._graph_bytes = 0
        if self.device.type == "cuda":
            self._graph_bytes = self._estimate_graph_bytes(self._profile_activation_peak())

    @property
    def partner_block_bytes(self) -> int:
        """Bytes added to each target KV block: a draft block per target block."""
        return 0 if self.fixed_blocks is not None else self.block_bytes

    @property
    def partner_fixed_bytes(self) -> int:
        """Bytes reserved besides: the draft graphs and the fixed part of the draft pool."""
        blocks = self.fixed_blocks if self.fixed_blocks is not None else self.slack_blocks
        return self._graph_bytes + blocks * self.block_bytes

    def start(self, target_blocks: int) -> None:
        useful = self.args.max_num_seqs * self.max_blocks_per_req + 1
        self.num_blocks = (self.fixed_blocks if self.fixed_blocks is not None
                           else min(useful, target_blocks + self.slack_blocks))
        self.kv_caches = self._allocate_kv(self.num_blocks, self.arena)
        if self._weights_region is not None:
            self.sleeper = Sleeper(self.arena, [self._weights_region],
                                   [self.arena.regions["kv"]])
        self._start_graphs()


def load_draft_runner(args: EngineArgs, spec: SpecConfig, target: ModelConfig,
                      target_tokenizer: Any, max_model_len: int) -> DraftModelRunner:
    """Load ``speculative.model`` after checking it can draft for ``target`` (start-up errors name
    ``speculative_config['model']``)."""
    from replaylm.engine.loading import load_model_config, resolve_weights_dir

    draft_args = dataclasses.replace(
        args, model=spec.model, speculative_config=None, num_kv_blocks=None,
        max_num_kv_blocks=None,
        enable_prefix_caching=False, skip_tokenizer_init=True, tokenizer=None,
        max_model_len=max_model_len, tensor_parallel_size=1, data_parallel_size=1,
        all_reduce_backend="nccl", enable_dp_attention=False)  # unsharded, no collective
    name = spec.model
    if name is None:  # SpecConfig.from_dict requires it for this method
        raise ValueError(f"{FIELD}['model'] is missing: the draft_model method needs a model")
    try:
        cfg, model_dir = load_model_config(name)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{FIELD}['model']={spec.model!r} is invalid: {e}") from e
    check_draft_model(name, cfg, model_dir, target, target_tokenizer, max_model_len)
    weights = resolve_weights_dir(model_dir, cfg, args.load_format)
    return DraftModelRunner(draft_args, cfg, weights, max_model_len, spec)


def check_draft_model(name: str, cfg: ModelConfig, model_dir: Path | None, target: ModelConfig,
                      target_tokenizer: Any, max_model_len: int) -> None:
    """The draft model must share the target's vocabulary (its size, and where both have a
    tokenizer, every token's id) and reach ``max_model_len`` positions."""
    where = f"{FIELD}['model']={name!r} is invalid"
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: its vocabulary has {cfg.vocab_size} tokens, the target's "
                         f"{target.vocab_size}: a draft model must share the target's vocabulary")
    if cfg.max_position_embeddings < max_model_len:
        raise ValueError(f"{where}: it reaches {cfg.max_position_embeddings} positions, fewer "
                         f"than max_model_len={max_model_len}")
    draft_tokenizer = _tokenizer_of(model_dir, where) if target_tokenizer is not None else None
    if draft_tokenizer is not None:
        mine, theirs = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if mine != theirs:
            diff = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[0]
            raise ValueError(f"{where}: its tokenizer maps tokens to other ids than the "
                             f"target's (first difference: {diff[0]!r} -> {diff[1]})")


def _tokenizer_of(model_dir: Path | None, where: str) -> Any:
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if model_dir is None or not any((model_dir / f).is_file() for f in files):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises several types for bad tokenizer files
        raise ValueError(f"{where}: its tokenizer does not load: {e}") from e
