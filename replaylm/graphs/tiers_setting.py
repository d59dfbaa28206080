"""The ``graph_tiers`` setting (``--graph-tiers``): the default tiers, a given list, or
``auto:TRACE.json``, tiers fitted to a traffic trace."""

from __future__ import annotations

from replaylm.graphs.tiers import validate_tiers
from replaylm.graphs.tiers_fit import expected_waste, load_trace, outside_share, tiers_from_trace

__all__ = ["parse_graph_tiers"]

# Graph budget for "auto:" when the caller sets none: about what vLLM/SGLang capture
# below 128 rows, and a few seconds of capture at most.
_DEFAULT_AUTO_GRAPHS = 16


def parse_graph_tiers(
    spec: str | None,
    *,
    default: list[int],
    limit: int,
    max_graphs: int | None,
    what: str = "limit",
) -> tuple[list[int], str]:
    """Resolve a ``--graph-tiers`` value to a tier list and a one-line report.

    * ``None``: ``default``;
    * ``"1,2,4,8"``: that list, validated against ``limit`` (named ``what`` in errors)
      and, when set, ``max_graphs``;
    * ``"auto:TRACE.json"``: :func:`tiers_from_trace` on the trace with
      ``max_graphs`` (16 when unset) graphs and ``limit`` as the cap. The report compares
      the expected padding with that of ``default``.
    """
    if spec is None:
        tiers = list(default)
        return tiers, f"default tiers: {len(tiers)} graphs, top tier {tiers[-1]}"
    spec = spec.strip()
    if spec.startswith("auto:"):
        path = spec[len("auto:") :].strip()
        if not path:
            raise ValueError("graph tiers 'auto:' needs a trace file: auto:TRACE.json")
        budget = _DEFAULT_AUTO_GRAPHS if max_graphs is None else max_graphs
        hist = load_trace(path)
        tiers = tiers_from_trace(hist, budget, limit)
        report = (
            f"tiers from {path}: {len(tiers)} graphs, expected waste "
            f"{expected_waste(hist, tiers):.1f} tokens/step vs "
            f"{expected_waste(hist, default):.1f} with the defaults ({len(default)} graphs)"
        )
        out_auto, out_default = outside_share(hist, tiers), outside_share(hist, default)
        if out_auto or out_default:
            # Steps above the cap run eagerly whatever the list; say how many.
            report += (
                f"; {100 * out_auto:.1f}% of steps run without a graph "
                f"({100 * out_default:.1f}% with the defaults)"
            )
        return tiers, report

    parts = [p.strip() for p in spec.split(",")]
    if not spec or any(not p for p in parts):
        raise ValueError(f"graph tiers {spec!r}: expected comma-separated integers like 1,2,4,8")
    values: list[int] = []
    for p in parts:
        try:
            values.append(int(p))
        except ValueError:
            raise ValueError(f"graph tier {p!r} is not an integer") from None
    tiers = validate_tiers(values, limit=limit, what=what)
    if max_graphs is not None and len(tiers) > max_graphs:
        raise ValueError(f"{len(tiers)} graph tiers given but max_graphs={max_graphs}")
    return tiers, f"tiers given: {len(tiers)} graphs, top tier {tiers[-1]}"
