"""Graph policy: every graph-relevant decision in one place.

The modes (``GRAPH_MODES``) are the known graph strategies, as switchable policies; what each
captures and which steps it serves with graphs is the table in ``docs/graphs.md``.

This module decides, from the settings, which mode runs, which tiers are captured, which
attention backend a mode can capture and how far the rotary work moves into attention; per
step, :meth:`GraphPolicy.dispatch` turns a batch's sizes into a :class:`Dispatch` (runner
and tier, or eager and why). Dispatch depends on three integers only, so ranks that
all-reduce them (max tokens, max requests, min uniform) and dispatch on the agreed values
all pick the same graph. The runners (``graphs.whole``, ``graphs.piecewise``) capture and
replay; they never choose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from replaylm.graphs.tiers import (
    default_decode_tiers,
    default_token_tiers,
    round_up,
    verify_token_tiers,
)
from replaylm.graphs.tiers_setting import parse_graph_tiers

log = logging.getLogger(__name__)

GRAPH_MODES = ("eager", "full", "piecewise", "full_and_piecewise", "ragged")
#: Modes that capture the dense links between attention calls (attention runs eagerly).
PIECEWISE_MODES = ("piecewise", "full_and_piecewise")
#: Modes that capture the whole model, attention included (it must be graph safe).
WHOLE_MODEL_MODES = ("full", "full_and_piecewise", "ragged")
#: The mode ``cuda_graph_mode=None`` picks on a GPU (eager on the CPU).
DEFAULT_GPU_MODE = "ragged"


@dataclass(frozen=True)
class Dispatch:
    """How one step runs: ``mode`` is the runner (``eager``, ``full``, ``piecewise`` or
    ``ragged``), ``tier`` the padded size of its graph, ``reason`` why a step that could
    have used a graph ran eagerly. ``pad_to``: the token count an eager step pads to when
    every rank's model must run the same shapes (data-parallel attention; 0: unpadded)."""

    mode: str
    tier: int | None = None
    reason: str | None = None
    pad_to: int = 0

    @property
    def graphed(self) -> bool:
        return self.mode != "eager"


def resolve_mode(cuda_graph_mode: str | None, enforce_eager: bool, device_type: str) -> str:
    """The mode that runs: ``eager`` when forced, else the setting, else the default for the
    device (graphs need CUDA)."""
    if enforce_eager:
        return "eager"
    if cuda_graph_mode is not None:
        return cuda_graph_mode
    return DEFAULT_GPU_MODE if device_type == "cuda" else "eager"


def attention_backend_name(requested: str, device_type: str, mode: str,
                           triton_available: bool) -> str:
    """The attention backend a mode can run with: whole-model graphs need one that reads no
    length on the host (``triton`` on CUDA, ``torch_dense`` on the CPU stand-in); ``auto``
    picks Triton on CUDA when it imports, else a torch backend."""
    whole = mode in WHOLE_MODEL_MODES
    if requested == "torch" and whole:
        raise ValueError(
            f"attention_backend='torch' cannot be captured in cuda_graph_mode={mode!r} "
            "(it reads lengths on the host): use triton, torch_dense or piecewise")
    if requested == "triton" and not triton_available:
        raise ValueError("attention_backend='triton' is unavailable: Triton does not import")
    if requested != "auto":
        return requested
    if device_type == "cuda" and triton_available:
        return "triton"
    if device_type == "cuda":
        log.warning("Triton attention unavailable; using the torch reference")
    return "torch_dense" if whole else "torch"


@dataclass
class GraphPolicy:
    """The resolved mode and tiers, and the per-step dispatch."""

    mode: str
    decode_tiers: list[int] = field(default_factory=list)  # ``full``: request counts
    token_tiers: list[int] = field(default_factory=list)  # ``piecewise``/``ragged``: tokens
    report: str = "eager: no graphs"

    @classmethod
    def resolve(cls, mode: str, *, graph_tiers: str | None, max_graph_tokens: int,
                max_graphs: int | None, max_num_seqs: int,
                max_num_batched_tokens: int, speculative: bool = False) -> GraphPolicy:
        """Tiers for ``mode`` from the settings: the defaults, a given list, or tiers fitted
        to a trace (``graph_tiers="auto:TRACE.json"``). With ``speculative`` the default
        token tiers also hold ``verify_token_tiers``."""
        if mode == "eager":
            return cls("eager")
        cap = max_graph_tokens
        decode_default = default_decode_tiers(min(max_num_seqs, cap))
        token_default = default_token_tiers(min(cap, max_num_batched_tokens))
        if speculative:
            token_default = sorted(set(token_default) | set(
                verify_token_tiers(min(cap, max_num_batched_tokens))))
        tiers, report = parse_graph_tiers(
            graph_tiers, default=decode_default if mode == "full" else token_default,
            limit=cap, max_graphs=max_graphs, what="max_graph_tokens",
        )
        if graph_tiers is None:
            decode, tokens = decode_default, token_default
        else:  # full graphs are keyed by request count: tiers above max_num_seqs never replay
            decode, tokens = [t for t in tiers if t <= max_num_seqs] or [1], tiers
        policy = cls(mode, decode if mode in ("full", "full_and_piecewise") else [],
                     tokens if mode != "full" else [], report)
        log.info("graph tiers (%s): %s", mode, report)
        return policy

    @property
    def uses_full(self) -> bool:
        return bool(self.decode_tiers)

    @property
    def token_runner(self) -> str | None:
        """The runner of the token tiers: ``piecewise``, ``ragged`` or None."""
        if not self.token_tiers:
            return None
        return "piecewise" if self.mode in PIECEWISE_MODES else "ragged"

    @property
    def uses_whole(self) -> bool:
        """Whether whole-model graphs are captured (``full`` or ``ragged`` tiers)."""
        return self.uses_full or self.token_runner == "ragged"

    @property
    def uses_piecewise(self) -> bool:
        return self.token_runner == "piecewise"

    @property
    def top_tier(self) -> int:
        return max(self.decode_tiers + self.token_tiers, default=0)

    def capture_order(self) -> list[tuple[str, int]]:
        """Every (runner, tier) to capture, largest first: smaller graphs then reuse the
        memory pool the largest one grew."""
        jobs = [("full", t) for t in self.decode_tiers]
        if self.token_runner:
            jobs += [(self.token_runner, t) for t in self.token_tiers]
        return sorted(jobs, key=lambda j: -j[1])

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool) -> Dispatch:
        """The graph a step of ``num_tokens`` tokens over ``num_reqs`` requests replays
        (``uniform_decode``: every request adds and samples exactly one token), or eager and
        why. Above the top tier a step runs eagerly; it never fails."""
        if self.mode == "eager":
            return Dispatch("eager")
        reason = None
        if self.uses_full:
            if uniform_decode:
                tier = round_up(self.decode_tiers, num_reqs)
                if tier is not None:
                    return Dispatch("full", tier)
                reason = f"decode batch {num_reqs} above top full tier {self.decode_tiers[-1]}"
            else:
                reason = "not a uniform decode batch"
        if self.token_runner:
            tier = round_up(self.token_tiers, num_tokens)
            if tier is not None:
                return Dispatch(self.token_runner, tier)
            reason = f"{num_tokens} tokens above top token tier {self.token_tiers[-1]}"
        return Dispatch("eager", reason=reason)

    def rope_in_attention_max_reqs(self, setting: int) -> int:
        """Up to how many request slots a decode step leaves q/k norm, rotary and the KV
        write to the attention launch (``EngineArgs.rope_in_attention_max_reqs``): only where
        attention is captured with the rest of the model (a piecewise graph fixes the
        attention input's shape, so piecewise modes never do)."""
        return 0 if self.mode in PIECEWISE_MODES else setting
