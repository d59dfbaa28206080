"""The drafter a ``speculative_config`` asks for (:func:`make_drafter`); the interface every
drafter meets is ``speculative.protocol.Drafter``."""

from __future__ import annotations

from replaylm.speculative.config import SpecConfig
from replaylm.speculative.ngram import NgramDrafter
from replaylm.speculative.protocol import Drafter


def make_drafter(cfg: SpecConfig) -> Drafter:
    if cfg.method == "ngram":
        return NgramDrafter(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    raise ValueError(f"no drafter for method {cfg.method!r}")
