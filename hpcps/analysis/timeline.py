"""Reading a run's ``/timeline`` (``--timeline``): where each rank's time went, phase by phase.

Three views, all from the spans alone (pure numpy and json, no MPI):

* :func:`phase_totals`: seconds per phase per rank, and each phase's share of the rank's time
  between its first and last span (``hpcps report``'s ``phases.md``);
* :func:`chrome_trace`: the spans as a Chrome trace (the JSON of ``chrome://tracing`` and
  https://ui.perfetto.dev, the format of Horovod's timeline), one process per rank;
* :func:`window`: the spans of a few steps in the middle of the run, for a drawing of one step
  across ranks (``timeline.png``).

A rank's spans tile its time (:mod:`hpcps.metrics.timeline`), so its shares add up to 1; what
the instrumented phases *explain* is 1 minus the share of ``other``.
"""

from __future__ import annotations

import numpy as np

from hpcps.metrics.timeline import PHASES

#: the order phases are listed and stacked in: a shard's, then a worker's, then other
PHASE_ORDER = [c for c in PHASES if c != 0] + [0]


def phase_totals(spans: np.ndarray) -> dict[int, dict[str, float]]:
    """``{rank: {phase name: seconds, ..., "span_s": first begin to last end}}``, phases with time only."""
    out = {}
    for rank in np.unique(spans["rank"]).tolist():
        mine = spans[spans["rank"] == rank]
        took = mine["t_end"] - mine["t_begin"]
        totals = {PHASES[c]: float(took[mine["phase"] == c].sum()) for c in PHASE_ORDER if (mine["phase"] == c).any()}
        totals["span_s"] = float(mine["t_end"].max() - mine["t_begin"].min())
        out[int(rank)] = totals
    return out


def explained(totals: dict[str, float]) -> float:
    """The share of a rank's time that its named phases account for (all but ``other``)."""
    span = totals["span_s"]
    return 1.0 - totals.get("other", 0.0) / span if span > 0 else float("nan")


def chrome_trace(spans: np.ndarray, roles: dict[int, str] | None = None, name: str = "hpcps") -> dict:
    """The spans as a Chrome trace: ``{"traceEvents": [...]}``, one complete event (``"ph": "X"``,
    microseconds) per span, one process per rank named by its role."""
    roles = roles or {}
    events = [{"name": "process_name", "ph": "M", "pid": int(r), "tid": 0,
               "args": {"name": f"rank {r}" + (f" ({roles[r]})" if r in roles else "")}}
              for r in np.unique(spans["rank"]).tolist()]
    for row in spans:
        events.append({"name": PHASES.get(int(row["phase"]), str(row["phase"])), "ph": "X",
                       "pid": int(row["rank"]), "tid": 0, "ts": round(float(row["t_begin"]) * 1e6, 3),
                       "dur": round(float(row["t_end"] - row["t_begin"]) * 1e6, 3),
                       "args": {"step": int(row["step"])}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"run": name}}


def window(spans: np.ndarray, steps: int = 2) -> tuple[float, float]:
    """``(t0, t1)``: about ``steps`` steps' worth of time in the middle of the run, measured on the
    ranks that recorded the most steps (the workers, or the shard's versions)."""
    if not len(spans):
        return 0.0, 0.0
    t_lo, t_hi = float(spans["t_begin"].min()), float(spans["t_end"].max())
    n_steps = len(np.unique(spans["step"]))
    per_step = (t_hi - t_lo) / n_steps
    middle = (t_lo + t_hi) / 2
    return middle - per_step * steps / 2, middle + per_step * steps / 2
