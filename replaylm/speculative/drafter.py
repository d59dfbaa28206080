"""The drafter interface: ``propose(requests) -> per-request draft tokens``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from replaylm.speculative.config import SpecConfig


class DraftRequest(Protocol):
    """What a drafter reads of a request: its known tokens (prompt + output)."""

    @property
    def all_token_ids(self) -> list[int]: ...


class Drafter(Protocol):
    def propose(self, requests: Sequence[DraftRequest], max_lens: Sequence[int]
                ) -> list[list[int]]:
        """Up to ``max_lens[i]`` draft tokens continuing ``requests[i]`` (possibly none)."""
        ...


def make_drafter(cfg: SpecConfig) -> Drafter:
    if cfg.method == "ngram":
        from replaylm.speculative.ngram import NgramDrafter

        return NgramDrafter(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    raise ValueError(f"no drafter for method {cfg.method!r}")
