"""Per-step profile of the engine: CPU time, GPU busy and idle time, graph nodes.

``StepProfiler`` hooks into ``EngineCore.step`` (``core.step_observer``). On CUDA it records
one event right before a step's first launch and one after its last; with the events' device
timestamps:

- GPU busy of step N = ``end_N - start_N`` (the device executing step N's copies, replay and
  sampling, all enqueued back to back);
- GPU idle before step N = ``start_N - end_{N-1}``, floored at 0: the device had finished step
  N-1 before the host got to launch step N (while it scheduled, built the batch, or processed
  outputs). The Chrome trace shows every kernel, for gaps between a graph's own nodes;
- CPU time = host wall time of the ``step()`` call; CPU wait = the part of it spent waiting
  for the previous step's samples (with overlap scheduling the host then has nothing left to
  do: the device is the bottleneck). CPU time minus CPU wait is the host's own work per step.

``profile_run`` drives a ``generate`` under the observer and, when a path is given, a second
short run under ``torch.profiler`` that writes a Chrome/Perfetto trace; ``kernel_busy_share``
reads such a trace back and measures the device's busy share over the decode window from the
kernels and copies themselves; ``chain_share`` splits the busy time among the kernels, each
charged only what it adds past the ones before it (PDL launches overlap their predecessors).
The traced run marks each step (``replaylm.bench.timeline``), and one steady decode step of it
is kept as a timeline: its kernels on a time axis, the launch gaps between them.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from typing import Any

import torch

from replaylm.bench.observer import StepObserver, observing
from replaylm.bench.timeline import StepMarks, trace_timeline


@dataclasses.dataclass
class StepSample:
    index: int
    mode: str
    tier: int | None
    tokens: int
    cpu_ms: float
    cpu_wait_ms: float = 0.0
    gpu_busy_ms: float | None = None
    gpu_idle_ms: float | None = None
    graph_nodes: int | None = None


class StepProfiler(StepObserver):
    """Collects one ``StepSample`` per launched step; ``finish()`` resolves the GPU times."""

    def __init__(self, device: torch.device, node_counts: dict[str, int]) -> None:
        self.cuda = device.type == "cuda"
        self.node_counts = node_counts
        self.samples: list[StepSample] = []
        self._events: list[tuple[Any, Any]] = []
        self._t0 = 0.0
        self._wait = 0.0
        self._start = None

    # Hooks called by EngineCore.step ------------------------------------------------------

    def begin(self) -> None:
        self._t0 = time.perf_counter()
        self._wait = 0.0

    def launching(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def launched(self, mode: str, tier: int | None, tokens: int) -> None:
        nodes = self.node_counts.get(f"{mode}:{tier}") if tier is not None else None
        self.samples.append(StepSample(len(self.samples), mode, tier, tokens, 0.0,
                                       graph_nodes=nodes))
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))

    def waited(self, seconds: float) -> None:
        self._wait += seconds

    def end(self, launched: bool) -> None:
        if launched:
            self.samples[-1].cpu_ms = (time.perf_counter() - self._t0) * 1e3
            self.samples[-1].cpu_wait_ms = self._wait * 1e3

    # Results ---------------------------------------------------------------------------------

    def finish(self) -> list[StepSample]:
        if self.cuda and self._events:
            torch.cuda.synchronize()
            prev_end = None
            for s, (start, end) in zip(self.samples, self._events):
                s.gpu_busy_ms = start.elapsed_time(end)
                if prev_end is not None:
                    s.gpu_idle_ms = max(0.0, prev_end.elapsed_time(start))
                prev_end = end
        return self.samples


def summarize(samples: list[StepSample], skip: int = 1) -> dict[str, Any]:
    """Medians over the steady state (the first ``skip`` steps, the prefill, left out)."""
    steady = samples[skip:] or samples

    def med(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return round(statistics.median(vals), 4) if vals else None

    busy = sum(s.gpu_busy_ms or 0.0 for s in steady)
    idle = sum(s.gpu_idle_ms or 0.0 for s in steady)
    return {
        "steps": len(samples),
        "steady_steps": len(steady),
        "cpu_ms_median": med([s.cpu_ms for s in steady]),
        "cpu_work_ms_median": med([s.cpu_ms - s.cpu_wait_ms for s in steady]),
        "gpu_busy_ms_median": med([s.gpu_busy_ms for s in steady]),
        "gpu_idle_ms_median": med([s.gpu_idle_ms for s in steady]),
        "gpu_idle_share": round(idle / (busy + idle), 4) if busy + idle > 0 else None,
        "graph_nodes": med([s.graph_nodes for s in steady]),
        "modes": sorted({f"{s.mode}:{s.tier}" if s.tier is not None else s.mode
                         for s in steady}),
    }


def profile_run(llm: Any, prompts: list[list[int]], params: Any,
                trace_path: str | None = None, trace_tokens: int = 64,
                **generate_kw: Any) -> dict[str, Any]:
    """One ``generate`` under the step profiler; optionally a short traced one as well.
    ``generate_kw``: more arguments of both ``generate`` calls (``lora_request``)."""
    core = llm.engine
    prof = StepProfiler(core.runner.device, core.runner.graphs.stats.nodes)
    with observing(core, prof):
        llm.generate(prompts, params, use_tqdm=False, **generate_kw)
    samples = prof.finish()
    result = {"summary": summarize(samples), "steps": [dataclasses.asdict(s) for s in samples]}
    if trace_path is not None:
        from torch.profiler import ProfilerActivity, profile

        short = dataclasses.replace(params, max_tokens=min(trace_tokens, params.max_tokens))
        activities = [ProfilerActivity.CPU]
        if core.runner.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with observing(core, StepMarks()), profile(activities=activities) as p:
            llm.generate(prompts, short, use_tqdm=False, **generate_kw)
        p.export_chrome_trace(trace_path)
        result["trace"] = trace_path
        timeline = trace_timeline(trace_path, str(llm.graph_mode))
        result["timeline"] = timeline.as_dict() if timeline is not None else None
        result["trace_gpu_busy_share"] = kernel_busy_share(trace_path)
        result["top_kernels_us_per_token"] = top_kernels(trace_path, short.max_tokens)
        result["chain_share_us_per_token"] = chain_share(trace_path, short.max_tokens)
    return result


def _device_spans(trace_path: str) -> list[dict[str, Any]]:
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    return [e for e in events
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def top_kernels(trace_path: str, tokens: int, n: int = 15) -> list[tuple[str, float, float]]:
    """The ``n`` kernels with the most device time in a trace: (name, µs and launches per
    generated token). Prefill kernels are included, spread over the tokens."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in _device_spans(trace_path):
        name = str(e.get("name", "?"))[:90]
        total[name] = total.get(name, 0.0) + float(e.get("dur", 0.0))
        count[name] = count.get(name, 0) + 1
    top = sorted(total, key=total.get, reverse=True)[:n]
    per = max(1, tokens)
    return [(k, round(total[k] / per, 2), round(count[k] / per, 2)) for k in top]


def _launch_label(event: dict[str, Any]) -> str:
    """A kernel's name and grid (``name [x,y,z]``): launches of one kernel at different
    shapes (the projections) stay apart."""
    grid = (event.get("args") or {}).get("grid")
    name = str(event.get("name", "?"))[:90]
    return f"{name} {list(grid)}" if grid else name


def _launch_bytes(event: dict[str, Any]) -> int | None:
    """The bytes a traced launch moves, as its kernel recorded them (``kernels.launch_bytes``:
    the projections); None for other launches."""
    from replaylm.kernels import launch_bytes

    grid = (event.get("args") or {}).get("grid")
    return launch_bytes.lookup(str(event.get("name", "")), grid) if grid else None


def chain_share(trace_path: str, tokens: int, n: int = 15,
                ) -> list[tuple[str, float, float, float | None]]:
    """What each launch shape adds to the device's busy time: (kernel name and grid, µs and
    launches per generated token, GB/s) for the ``n`` largest.

    With PDL a kernel starts while its predecessor runs and waits inside, so its trace
    duration overlaps the one before it, and ``top_kernels``' sums exceed the step time. Here
    each moment of busy time goes to the span that first extends the covered window past it:
    a span adds ``end - max(start, latest end so far)``. The additions sum to the busy time;
    in a serial chain, a kernel's share approximates what the step would save without it.
    GB/s: the bytes the shape's launches move (the projections record theirs) over the time
    they add, the bandwidth the step gets from them; None for shapes without a record."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), _launch_label(e),
                    _launch_bytes(e)) for e in _device_spans(trace_path))
    added: dict[str, float] = {}
    count: dict[str, int] = {}
    moved: dict[str, int | None] = {}
    covered = float("-inf")
    for start, end, name, nbytes in spans:
        added[name] = added.get(name, 0.0) + max(0.0, end - max(start, covered))
        count[name] = count.get(name, 0) + 1
        before = moved.get(name, 0)
        moved[name] = None if before is None or nbytes is None else before + nbytes
        covered = max(covered, end)
    top = sorted(added, key=added.get, reverse=True)[:n]
    per = max(1, tokens)

    def gbs(k: str) -> float | None:
        b = moved[k]
        return round(b / added[k] / 1e3, 1) if b and added[k] > 0 else None

    return [(k, round(added[k] / per, 2), round(count[k] / per, 2), gbs(k)) for k in top]


def kernel_busy_share(trace_path: str) -> float | None:
    """Share of the window from the first to the last device activity that some kernel or
    copy was running, from a Chrome trace written by ``torch.profiler``."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
                   for e in _device_spans(trace_path))
    if not spans:
        return None
    busy, cur_start, cur_end = 0.0, spans[0][0], spans[0][1]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    window = max(e for _, e in spans) - spans[0][0]  # the last span to end, not to start
    return round(busy / window, 4) if window > 0 else None


def format_summary(label: str, summary: dict[str, Any], busy_share: float | None) -> str:
    def f(v: Any, unit: str = "") -> str:
        return "n/a" if v is None else f"{v}{unit}"

    idle = summary.get("gpu_idle_share")
    trace = "" if busy_share is None else f", trace GPU busy {100 * busy_share:.1f}%"
    return (f"[profile] {label}: {summary['steady_steps']} steps; per step CPU "
            f"{f(summary['cpu_ms_median'], ' ms')} "
            f"(work {f(summary['cpu_work_ms_median'], ' ms')}), "
            f"GPU busy {f(summary['gpu_busy_ms_median'], ' ms')}, "
            f"GPU idle {f(summary['gpu_idle_ms_median'], ' ms')} "
            f"({'n/a' if idle is None else f'{100 * idle:.1f}%'}), graph nodes "
            f"{f(summary['graph_nodes'])}{trace}; graphs {','.join(summary['modes'])}")
