"""The drafter interface: ``propose(requests) -> per-request draft tokens``, and what a
drafter reads of a request. Every drafter module imports it from here, below
``speculative.drafter`` (which picks the drafter a configuration asks for)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class DraftRequest(Protocol):
    """What a drafter reads of a request: its known tokens (prompt + output)."""

    @property
    def all_token_ids(self) -> list[int]: ...


class Drafter(Protocol):
    def propose(self, requests: Sequence[DraftRequest], max_lens: Sequence[int]
                ) -> list[list[int]]:
        """Up to ``max_lens[i]`` draft tokens continuing ``requests[i]`` (possibly none)."""
        ...
