"""Pipelined verify steps: overlap scheduling with speculation on.

A verify step's next input is the last token it emits, and a host drafter needs the
accepted tokens before it can propose again, so a request's step N+1 cannot be built
before its step N resolves. Overlap comes from the other requests instead: the decoding
requests split into two cohorts that take turns. While the GPU verifies one cohort's
drafts, the host applies the other cohort's results, proposes its next drafts, schedules
and launches its step; then it waits for the first cohort's step, which the GPU has
finished by then unless the device is the bottleneck (``engine.speculation``).

The cost is a second pass over the weights per round (two steps of half the tokens each
instead of one), so it pays only where the host's share of a step is the larger:

* Synchronously, a step costs host time ``H`` plus device time ``G``, and the host waits
  about ``G`` of it.
* Pipelined, a round of both cohorts costs ``2·max(H/2, g)``, with ``g`` the device time of
  a cohort's step, between ``G/2`` (compute-bound) and ``G`` (weight-bound). At worst
  (``g = G``) that beats ``H + G`` exactly when ``H > G``. The host now waits
  ``g - H/2`` per step where that is positive, and pipelining still pays while the wait is
  below the host's own share.

Both cases come to one rule on measured times: pipeline while the host's time per step
exceeds its wait for the device (``VerifyPipeline.observe``, averaged over about the last
``1 / (1 - DECAY)`` steps, ``MARGIN`` either way). The rule assumes both modes replay
graphs. Where a synchronous verify of every request would pass the top graphed token tier
and a cohort's would not (fixed K at many requests: 64 requests with 8 drafts each are 576
tokens), the synchronous step runs eagerly, launching its kernels one by one at the cost of
several graphed steps, and its long wait for the device would keep the rule from
pipelining; there the engine pipelines whatever the times say (``sync_eager``). Leaving
the pipelined mode is followed by at least ``COOLDOWN`` synchronous steps, twice that after
each further exit (up to ``MAX_COOLDOWN``), so two rules that disagree near the boundary
cannot flip the mode every few steps.

``SpecConfig.pipeline``: ``auto`` (the rule above, on a GPU: on the CPU a step runs inside
its launch, so nothing would overlap), ``on`` (always split; tests and benchmarks) or
``off``. With the adaptive budget, each cohort's drafts are chosen by what pipelined steps
cost against plain decoding of every request (``speculative.adaptive``), and while drafts do
not pay the engine coasts with plain overlapped steps of every request.
"""

from __future__ import annotations

DECAY = 0.9  # weight left to the earlier steps' times per step
MARGIN = 0.1  # the host must exceed its wait by this share to switch (and fall below to leave)
WARMUP = 8  # steps measured in a mode before the rule may leave it
COOLDOWN = 64  # synchronous steps after the first exit before the rule may pipeline again
MAX_COOLDOWN = 4096


class VerifyPipeline:
    """Whether verify steps run as two alternating cohorts (``active``), and how large this
    step's cohort is (``cohort``)."""

    def __init__(self, mode: str) -> None:
        self.forced = mode == "on"
        self.active = self.forced
        self.host = 0.0  # decayed mean host time per step in the current mode (seconds)
        self.wait = 0.0  # decayed mean wait for the device per step
        self.measured = 0  # steps measured since the mode last changed
        self.cooldown = 0  # steps before the rule may enter the pipelined mode again
        self.next_cooldown = COOLDOWN
        self.switches = 0  # changes of mode made by the rule

    @staticmethod
    def cohort(busy: int, ready: int) -> int:
        """Of ``ready`` requests able to draft now, how many verify this step while ``busy``
        others have a step in flight: all of them up to half the total, so that two
        cohorts form from one and stay balanced as requests come and go."""
        return min(ready, -(-(busy + ready) // 2))

    def observe(self, host_s: float, wait_s: float, sync_eager: bool = False) -> None:
        """One step's host time (its wall time less ``wait_s``) and its wait for the device,
        in the current mode; ``active`` may change (never when ``forced``). ``sync_eager``:
        a synchronous verify of every request would run eagerly past the graphed tiers,
        while a cohort's replays a graph; the engine pipelines, and measures afresh once
        that no longer holds."""
        if self.forced:
            return
        if sync_eager:
            if not self.active:
                self._switch(True)
            self.measured = self.cooldown = 0
            return
        if self.cooldown:
            self.cooldown -= 1
            return
        if self.measured:
            self.host = DECAY * self.host + (1 - DECAY) * host_s
            self.wait = DECAY * self.wait + (1 - DECAY) * wait_s
        else:
            self.host, self.wait = host_s, wait_s
        self.measured += 1
        if self.measured < WARMUP:
            return
        if not self.active and self.host > (1 + MARGIN) * self.wait:
            self._switch(True)
        elif self.active and self.host < (1 - MARGIN) * self.wait:
            self._switch(False)
            self.cooldown = self.next_cooldown
            self.next_cooldown = min(2 * self.next_cooldown, MAX_COOLDOWN)

    def _switch(self, active: bool) -> None:
        self.active = active
        self.measured = 0
        self.switches += 1
