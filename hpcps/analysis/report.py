"""``hpcps report``: plots and tables comparing runs, from their HDF5 files alone.

Offline by design: h5py, numpy and matplotlib (Agg backend), never MPI, so
it runs on a login node or a laptop. Writes into ``--out DIR``:

* ``accuracy.png``   held-out accuracy and loss against wall time, one line per run
* ``throughput.png`` iterations/s of every worker, grouped by run
* ``breakdown.png``  mean time per iteration per worker: compute, push, pull waited for, grant
                     wait; the part of a pull hidden behind compute (eager) is written beside
* ``staleness.png``  staleness histogram of the applied gradients, per run
* ``thresholds.png`` DSSP bounds over time (only when a dssp run is given)
* ``transfers.png``  which worker streamed its gradient into shard 0 when (only for runs with
                     serial transfers, hsp): the first TRANSFER_SHOWN transfers, one lane per worker
* ``phases.md`` and ``phases.csv`` (runs with ``--timeline``): per rank, seconds and share of its time
  per phase (a shard's wait, receive, scan, sum, step, publish, notify; a worker's compute, push, grant,
  pull), and the share the named phases explain (all but ``other``)
* ``timeline.png`` (runs with ``--timeline``): a few steps in the middle of each run across its ranks,
  one lane per rank, coloured by phase
* ``timeline-RUN.json`` (runs with ``--timeline``): every span as a Chrome trace, for
  ``chrome://tracing`` or https://ui.perfetto.dev (the format of Horovod's timeline)
* ``scalars.png``, ``scalars.md`` and ``scalars.csv`` (runs whose loop logged its own numbers, ``ps.log``):
  each name's values against wall time, one line per worker of each run, and per run and name the
  count, first, last, lowest and highest value
* ``summary.md`` and ``summary.csv``: time-to-target, final accuracy and loss, iterations/s, mean wait per
  run (``-`` where a run evaluated nothing, as a step-API loop without test data: ``never`` is only for
  a target its evaluations never reached)
* ``ranks.md`` and ``ranks.csv``: every rank of every run (its ``/ranks`` row): role, host, peak
  resident memory, samples read, clock offset to rank 0 and its uncertainty, device; also how a stopped
  run ended (``stopped_by``) and, for a run in a cluster in a box (``hpcps emulate``), the
  emulated cluster (``cluster``: nodes, link rates, ranks per node, switch buffer) and, for a run
  under ``--paradigm auto``, its trials and choice (``paradigm_auto``) in ``summary.md``;
  a rank's ``host`` there is ``HOST/nK``, its emulated node
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from hpcps.box.spec import describe_record
from hpcps.options.config import DEFAULT_STALENESS
from hpcps.options.paradigm_choice import describe as describe_choice
from hpcps.errors import UserError
from hpcps.analysis.timeline import PHASE_ORDER, chrome_trace, explained, phase_totals, window
from hpcps.metrics.schema import JOIN, RANK, SCALAR, TIMELINE, TRANSFER
from hpcps.metrics.timeline import PHASES

#: transfers drawn in transfers.png (a whole run's are too many bars to read)
TRANSFER_SHOWN = 120


@dataclass
class Run:
    """One metrics file, loaded."""

    name: str
    paradigm: str
    config: dict
    iterations: np.ndarray
    updates: np.ndarray
    evals: np.ndarray
    summary: dict
    transfers: np.ndarray = field(default_factory=lambda: np.zeros(0, TRANSFER))
    ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, RANK))
    timeline: np.ndarray = field(default_factory=lambda: np.zeros(0, TIMELINE))
    scalars: np.ndarray = field(default_factory=lambda: np.zeros(0, SCALAR))  # the loop's own (ps.log)
    cluster: dict = field(default_factory=dict)  # the emulated cluster (hpcps emulate), {} or emulated=False
    joins: np.ndarray = field(default_factory=lambda: np.zeros(0, JOIN))  # spares in dead workers' places
    choice: dict = field(default_factory=dict)  # --paradigm auto's trials and choice (hpcps.options.paradigm_choice)

    @property
    def label(self) -> str:
        return self.name if self.paradigm in self.name else f"{self.name} ({self.paradigm})"

    @property
    def roles(self) -> dict[int, str]:
        """Each rank's role (server, group, worker), from ``/ranks``; empty for files without it."""
        return {int(x["rank"]): x["role"].decode() for x in self.ranks}

    def time_to(self, target: float) -> float:
        return time_to(self.evals, target)

    def worker_rates(self) -> dict[int, float]:
        return worker_rates(self.iterations)

    def place_rates(self) -> dict[int, float]:
        """Iterations per second of each worker's place (a spare's rows counted in the place it took)."""
        return worker_rates(self.iterations, places(self.joins))


def time_to(evals: np.ndarray, target: float) -> float:
    """Time of the first evaluation at ``target`` accuracy or above (NaN: never)."""
    hits = evals["t"][evals["accuracy"] >= target]
    return float(hits.min()) if len(hits) else float("nan")


def worker_rates(iterations: np.ndarray, places: dict[int, int] | None = None) -> dict[int, float]:
    """Iterations per second of each worker rank, over its own active time; with ``places`` (a spare's
    rank -> the rank of the worker whose place it took, :func:`places`), of each place: its first
    worker's rows and its spares' together, over the time to the last of them."""
    it = iterations
    owner = it["rank"].copy()
    for spare, worker in (places or {}).items():
        owner[it["rank"] == spare] = worker
    return {int(r): float((owner == r).sum() / it["t_end"][owner == r].max()) for r in np.unique(owner)}


def timed_rows(iterations: np.ndarray, warmup: int):
    """Each worker's rank and its timed rows, in step order: all but the first ``warmup`` (at most a quarter
    of its steps). The one cut that every mean of a run's steps takes (:func:`step_means`,
    :func:`compute_means`, a tool's means of the phases)."""
    for r in np.unique(iterations["rank"]):
        mine = np.sort(iterations[iterations["rank"] == r], order="step")
        yield int(r), mine[min(warmup, len(mine) // 4):]


def step_means(iterations: np.ndarray, warmup: int = 0) -> dict[int, float]:
    """Each worker's mean step (s): its wall time over its steps, the start of its first timed step to the end
    of its last. ``warmup``: steps left out at each worker's start, at most a quarter of its steps (start-up
    and torch's first passes)."""
    return {r: float(timed["t_end"].max() - timed["t_start"].min()) / len(timed)
            for r, timed in timed_rows(iterations, warmup)}


def compute_means(iterations: np.ndarray, warmup: int = 0) -> dict[int, float]:
    """Each worker's mean compute a step (s: ``compute_s``, no waits), over the steps :func:`step_means`
    times."""
    return {r: float(timed["compute_s"].mean()) for r, timed in timed_rows(iterations, warmup)}


def applied_updates(updates: np.ndarray) -> np.ndarray:
    """The rows of ``servers/updates`` of the gradients applied, each once (shard 0's; a dropped gradient
    is not in the model, nor is its staleness)."""
    return updates[(updates["shard"] == 0) & (updates["applied"] == 1)]


def mean_step(iterations: np.ndarray, warmup: int = 0) -> float:
    """A run's mean step (s), what a user waits for: the slowest worker's (:func:`step_means`)."""
    return max(step_means(iterations, warmup).values(), default=0.0)


def places(joins: np.ndarray) -> dict[int, int]:
    """From ``/servers/joins``: each spare rank that took a dead worker's place -> the rank of the worker
    that held the place first (a spare that died in its turn, and was replaced, passes it on)."""
    took = {int(j["spare"]): int(j["worker"]) for j in joins}
    first = {}
    for spare in took:
        worker = took[spare]
        while worker in took:
            worker = took[worker]
        first[spare] = worker
    return first


def max_clock_gap(iterations: np.ndarray, updates: np.ndarray, steps: int) -> int:
    """The largest lead, at any iteration's start, of a worker over the slowest worker still running,
    from the timestamps alone: a worker's clock is its gradients recorded as applied (shard 0) before
    that start. ssp's bound (``--staleness s``) and dssp's (``--staleness-max``) must hold for it."""
    if not len(iterations):
        return 0
    up = updates[updates["shard"] == 0]
    workers = np.unique(iterations["rank"])
    rows, starts = np.arange(len(iterations)), iterations["t_start"]
    own = np.searchsorted(workers, iterations["rank"])  # each row's worker, as an index of ``workers``
    # applied[k, i]: worker k's gradients applied before row i began (one sorted search per worker, where
    # a loop over rows was O(rows x updates): this runs after every trial of --paradigm auto, not only in tests)
    applied = np.stack([np.searchsorted(np.sort(up["t"][up["worker"] == w]), starts, side="left") for w in workers])
    others = np.where(applied < steps, applied, np.iinfo(np.int64).max)  # those still running
    others[own, rows] = np.iinfo(np.int64).max
    slowest = np.minimum(others.min(axis=0), applied[own, rows])  # (a row's own worker always counts)
    return max(0, int((iterations["step"] - slowest).max()))


def load_run(path: str | os.PathLike) -> Run:
    path = Path(path)
    try:
        # no HDF5 file lock: the file may belong to a job that is still running or has just crashed
        with h5py.File(path, "r", locking=False) as f:
            return Run(name=path.stem, paradigm=str(f.attrs["paradigm"]),
                       config=json.loads(f.attrs["config"]),
                       iterations=f["workers/iterations"][()], updates=f["servers/updates"][()],
                       evals=f["eval"][()], summary=dict(f["summary"].attrs),
                       **({"transfers": f["servers/transfers"][()]} if "servers/transfers" in f else {}),
                       **({"ranks": f["ranks"][()]} if "ranks" in f else {}),
                       **({"timeline": f["timeline"][()]} if "timeline" in f else {}),
                       **({"scalars": f["workers/scalars"][()]} if "workers/scalars" in f else {}),
                       **({"joins": f["servers/joins"][()]} if "servers/joins" in f else {}),
                       cluster=json.loads(f.attrs.get("cluster", "{}")),
                       choice=json.loads(f.attrs.get("paradigm_choice", "{}")))
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (OSError, KeyError) as exc:
        raise UserError(f"{path}: not an hpcps metrics file ({exc})") from None


def local_steps(config: dict) -> int | None:
    """A run's local steps per outer round (``--local-steps``, or the presets' default), None: none."""
    from hpcps.options.config import DEFAULT_LOCAL_STEPS, FAMILY_OUTER

    if config.get("local_steps") is not None:
        return int(config["local_steps"])
    return DEFAULT_LOCAL_STEPS if config.get("paradigm") in FAMILY_OUTER else None


def summary_rows(runs: list[Run], target: float) -> list[dict]:
    """One row per run. ``workers`` counts places, not ranks (a spare in a dead worker's place is that place:
    :func:`places`). Under local steps a worker's row in the file is a round of H batches: the rate counts
    batches (H per round), ``mean_staleness`` is the pseudo-gradients' in outer versions, and
    ``outer_updates`` the updates the shards applied (rounds under the lock-step forms)."""
    rows = []
    for r in runs:
        it = r.iterations
        applied = applied_updates(r.updates)
        every = local_steps(r.config)
        rates = {w: rate * (every or 1) for w, rate in r.place_rates().items()}
        evaluated = len(r.evals) > 0  # a step-API loop without test data evaluates nothing: "-", not "never"
        rows.append({
            "run": r.name, "paradigm": r.paradigm, "workers": len(rates),
            f"time_to_{target:g}_s": round(r.time_to(target), 3) if evaluated else "-",
            "final_accuracy": round(float(r.summary.get("final_accuracy", float("nan"))), 4) if evaluated else "-",
            "final_loss": round(float(r.summary.get("final_loss", float("nan"))), 4) if evaluated else "-",
            "wall_s": round(float(r.summary.get("wall_s", float("nan"))), 3),
            "iterations_per_s_per_worker": round(float(np.mean(list(rates.values()))) if rates else float("nan"), 1),
            "mean_wait_ms": round(float(it["wait_s"].mean() * 1e3) if len(it) else float("nan"), 3),
            "mean_staleness": round(float(applied["staleness"].mean()) if len(applied) else float("nan"), 2),
            "gradients_applied": int(r.summary.get("gradients_applied", len(applied))),
            # run-through (Open MPI's ULFM): workers that died and went on without, their gradients never applied
            "workers_lost": int(r.summary.get("workers_lost", 0)),
            "gradients_lost": int(r.summary.get("gradients_lost", 0)),
            # --spare-workers: spares that took a dead worker's place (the run trained its planned amount)
            "workers_joined": int(r.summary.get("workers_joined", 0)),
            # "32, 24 overlapped": the outer step hidden behind the next round's first 24 (--overlap-steps)
            "local_steps": ("-" if every is None else f"{every}, {r.config['overlap_steps']} overlapped"
                            if r.config.get("overlap_steps") else every),
            "outer_updates": int(len(np.unique(applied["version"]))) if every is not None else "-",
            # a run that never wrote its summary ended without end(): it crashed or was killed
            "stopped_by": (str(r.summary.get("stopped_by", "")) or "-") if "wall_s" in r.summary else "no summary (crashed?)",
            "cluster": describe_record(r.cluster) if r.cluster.get("emulated") else "-",
            "paradigm_auto": describe_choice(r.choice) if r.choice else "-",
        })
    return rows


def rank_rows(runs: list[Run]) -> list[dict]:
    """One row per rank per run, from ``/ranks`` (runs written before it existed have none)."""
    return [{"run": r.name, "rank": int(x["rank"]), "role": x["role"].decode(), "host": x["host"].decode(),
             "peak_rss_mb": round(int(x["peak_rss_bytes"]) / 2 ** 20, 1),
             "samples_read": int(x["samples_read"]),
             "clock_offset_ms": round(float(x["clock_offset_s"]) * 1e3, 3),
             "clock_uncertainty_ms": round(float(x["clock_uncertainty_s"]) * 1e3, 3),
             "device": x["device"].decode() if "device" in x.dtype.names else "-"}
            for r in runs for x in np.sort(r.ranks, order="rank")]


def scalar_rows(runs: list[Run]) -> list[dict]:
    """Per run and name of the loop's own numbers (``ps.log``): how many, the first and last logged, the
    lowest and highest."""
    rows = []
    for r in runs:
        s = np.sort(r.scalars, order="t")
        for name in dict.fromkeys(s["name"].tolist()):  # in the order first logged
            v = s["value"][s["name"] == name]
            rows.append({"run": r.name, "name": name.decode(), "count": len(v), "first": round(float(v[0]), 6),
                         "last": round(float(v[-1]), 6), "min": round(float(np.nanmin(v)), 6),
                         "max": round(float(np.nanmax(v)), 6)})
    return rows


def phase_rows(runs: list[Run]) -> list[dict]:
    """One row per rank per run with a timeline: its role, its time, seconds per phase and the share
    of its time the named phases explain."""
    rows = []
    for r in runs:
        if not len(r.timeline):
            continue
        roles = r.roles
        for rank, totals in phase_totals(r.timeline).items():
            row = {"run": r.name, "rank": rank, "role": roles.get(rank, "-"), "span_s": round(totals["span_s"], 3)}
            row.update({f"{PHASES[c]}_s": round(totals.get(PHASES[c], 0.0), 4) for c in PHASE_ORDER})
            row["explained"] = round(explained(totals), 4)
            rows.append(row)
    return rows


def write_traces(runs: list[Run], out: Path) -> list[Path]:
    """Each run's timeline as a Chrome trace, ``timeline-RUN.json``."""
    written = []
    for r in runs:
        if len(r.timeline):
            path = out / f"timeline-{r.name.replace('/', '_')}.json"
            path.write_text(json.dumps(chrome_trace(r.timeline, r.roles, r.name)))
            written.append(path)
    return written


def write_tables(rows: list[dict], out: Path, name: str = "summary") -> list[Path]:
    md, cs = out / f"{name}.md", out / f"{name}.csv"
    keys = list(rows[0])
    with open(cs, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    def shown(key: str, v) -> str:  # NaN: a target never reached; elsewhere nothing to show
        if isinstance(v, float) and np.isnan(v):
            return "never" if key.startswith("time_to_") else "-"
        return str(v)
    lines += ["| " + " | ".join(shown(k, v) for k, v in row.items()) + " |" for row in rows]
    md.write_text("\n".join(lines) + "\n")
    return [md, cs]


# -- plots -----------------------------------------------------------------------------------------

def _figure(*args, **kwargs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(*args, **kwargs)


def plot_accuracy(runs: list[Run], out: Path, target: float) -> Path:
    plt, fig, (ax1, ax2) = _figure(1, 2, figsize=(12, 4.5))
    for r in runs:
        ax1.plot(r.evals["t"], r.evals["accuracy"], marker=".", label=r.label)
        ax2.plot(r.evals["t"], r.evals["loss"], marker=".", label=r.label)
    ax1.axhline(target, color="grey", linestyle=":", label=f"target {target:g}")
    ax1.set(xlabel="wall time (s)", ylabel="held-out accuracy", title="Accuracy against wall time")
    ax2.set(xlabel="wall time (s)", ylabel="held-out loss (cross-entropy)", title="Loss against wall time",
            yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(plt, fig, out / "accuracy.png")


def plot_scalars(runs: list[Run], out: Path) -> Path | None:
    """The loop's own numbers (``ps.log``) against wall time: one panel per name, one line per worker of
    each run (None when no run logged any)."""
    names = list(dict.fromkeys(n for r in runs for n in r.scalars["name"].tolist()))
    if not names:
        return None
    plt, fig, axes = _figure(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        for r in runs:
            rows = np.sort(r.scalars[r.scalars["name"] == name], order="t")
            for rank in np.unique(rows["rank"]):
                mine = rows[rows["rank"] == rank]
                ax.plot(mine["t"], mine["value"], marker=".", label=f"{r.label} rank {int(rank)}")
        ax.set(xlabel="wall time (s)", ylabel=name.decode(), title=f"{name.decode()} (ps.log)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(plt, fig, out / "scalars.png")


def slowdowns(config: dict) -> dict[int, float]:
    """``--slowdown`` of a run's config: worker rank -> factor (JSON keys are strings)."""
    return {int(rank): float(f) for rank, f in (config.get("slowdown") or {}).items()}


def plot_throughput(runs: list[Run], out: Path) -> Path:
    """One group of bars per run, each bar labelled with its own worker's rank; a straggler
    (``--slowdown``) is hatched and its factor written above it."""
    n_bars = sum(len(r.worker_rates()) for r in runs)
    plt, fig, ax = _figure(figsize=(max(6.0, 0.45 * n_bars + 2.5), 4.8))
    x0, ticks, tick_labels = 0.0, [], []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, r in enumerate(runs):
        rates, slow = r.worker_rates(), slowdowns(r.config)
        x = x0 + np.arange(len(rates))
        bars = ax.bar(x, list(rates.values()), 0.8, color=colors[k % len(colors)], label=r.label)
        for bar, rank in zip(bars, rates):
            if rank in slow:
                bar.set_hatch("//")
                bar.set_edgecolor("black")
                ax.annotate(f"{slow[rank]:g}x slower", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            xytext=(0, 2), textcoords="offset points", ha="center", fontsize="x-small")
        ticks += list(x)
        tick_labels += [str(w) for w in rates]
        x0 += len(rates) + 1  # a gap between runs
    ax.set_xticks(ticks, tick_labels, fontsize="small")
    ax.set(xlabel="worker rank (one group per run)", ylabel="iterations per second",
           title="Iteration throughput per worker")
    ax.margins(y=0.12)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(plt, fig, out / "throughput.png")


def plot_breakdown(runs: list[Run], out: Path) -> Path:
    """Stacked: what each iteration waits for. A pull that overlapped compute (eager) is on the
    critical path only for its waited part; the hidden rest is written beside the bar."""
    parts = [("compute_s", "compute"), ("push_s", "push"), ("pull_wait_s", "pull (waited for)"),
             ("wait_s", "wait (grant)")]
    labels, values, hidden = [], [], []
    for r in runs:
        for w in np.unique(r.iterations["rank"]):
            rows = r.iterations[r.iterations["rank"] == w]
            labels.append(f"{r.label} · rank {w}")
            values.append([rows[field].mean() * 1e3 for field, _ in parts])
            hidden.append(max(0.0, float((rows["pull_s"] - rows["pull_wait_s"]).mean() * 1e3)))
    plt, fig, ax = _figure(figsize=(10, 0.35 * len(labels) + 1.8))
    values = np.array(values).reshape(len(labels), len(parts))
    left = np.zeros(len(labels))
    for j, (_, name) in enumerate(parts):
        ax.barh(labels, values[:, j], left=left, label=name)
        left += values[:, j]
    for y, (end, h) in enumerate(zip(left, hidden)):
        if h >= 0.01:
            ax.annotate(f"+{h:.2f} ms pull hidden behind compute", (end, y), xytext=(4, 0),
                        textcoords="offset points", va="center", fontsize="x-small", color="dimgrey")
    ax.set_xlim(0, left.max() * 1.35 if len(left) else 1)
    ax.invert_yaxis()
    ax.set(xlabel="mean time per iteration on the critical path (ms)", title="Where each worker's iterations go")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    return _save(plt, fig, out / "breakdown.png")


def plot_staleness(runs: list[Run], out: Path) -> Path:
    """Shared bins, one filled bar per run in each: no run's outline hides another's."""
    top = max((int(r.updates["staleness"].max()) for r in runs if len(r.updates)), default=0)
    values = np.arange(0, top + 1)
    plt, fig, ax = _figure(figsize=(max(8.0, 0.5 * len(values) * max(1, len(runs)) ** 0.5 + 4), 4.5))
    width = 0.8 / max(1, len(runs))
    for k, r in enumerate(runs):
        applied = applied_updates(r.updates)["staleness"]
        share = np.bincount(np.clip(applied, 0, top), minlength=len(values)) / max(1, len(applied))
        ax.bar(values - 0.4 + width * (k + 0.5), share, width, label=r.label)
    ax.set_xticks(values if len(values) <= 25 else values[:: int(np.ceil(len(values) / 25))])
    ax.set(xlabel="staleness (server versions between read and apply)", ylabel="share of applied gradients",
           title="Staleness of applied gradients")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(plt, fig, out / "staleness.png")


def plot_thresholds(runs: list[Run], out: Path) -> Path | None:
    dssp = [r for r in runs if r.paradigm == "dssp"]
    if not dssp:
        return None
    plt, fig, axes = _figure(len(dssp), 1, figsize=(10, 3.2 * len(dssp)), squeeze=False)
    for ax, r in zip(axes[:, 0], dssp):
        up = r.updates[r.updates["shard"] == 0]
        for w in np.unique(up["worker"]):
            mine = up[up["worker"] == w]
            ax.step(mine["t"], mine["threshold"], where="post", label=f"rank {w}")
        s_lo, s_hi = r.config.get("staleness"), r.config.get("staleness_max")
        s_lo = DEFAULT_STALENESS if s_lo is None else s_lo  # absent or null in the config: the default
        s_hi = s_lo + 4 if s_hi is None else s_hi
        for bound, name in ((s_lo, "s_lo"), (s_hi, "s_hi")):  # labels outside the axes, clear of every line
            ax.axhline(bound, color="grey", linestyle=":")
            ax.text(1.01, bound, f"{name} = {bound}", transform=ax.get_yaxis_transform(), va="center",
                    ha="left", color="grey", fontsize="small", clip_on=False)
        ax.set_ylim(min(s_lo, float(up["threshold"].min()) if len(up) else s_lo) - 0.5,
                    max(s_hi, float(up["threshold"].max()) if len(up) else s_hi) + 0.5)
        ax.set(xlabel="wall time (s)", ylabel="clock-gap bound", title=f"DSSP bounds over time: {r.label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", ncol=4, loc="upper left", bbox_to_anchor=(0, -0.22))
    fig.subplots_adjust(right=0.88)
    return _save(plt, fig, out / "thresholds.png")


def plot_transfers(runs: list[Run], out: Path) -> Path | None:
    serial = [r for r in runs if len(r.transfers)]
    if not serial:
        return None
    plt, fig, axes = _figure(len(serial), 1, figsize=(10, 2.8 * len(serial)), squeeze=False)
    for ax, r in zip(axes[:, 0], serial):
        tr = np.sort(r.transfers[r.transfers["shard"] == 0], order="t_begin")[:TRANSFER_SHOWN]
        workers = sorted(np.unique(tr["worker"]).tolist())
        for lane, w in enumerate(workers):
            mine = tr[tr["worker"] == w]
            ax.broken_barh(list(zip(mine["t_begin"], mine["t_end"] - mine["t_begin"])), (lane - 0.4, 0.8))
        ax.set_yticks(range(len(workers)), [f"rank {w}" for w in workers])
        ax.set(xlabel="wall time (s)", title=f"gradients streaming into shard 0, first {len(tr)}: {r.label}")
        ax.grid(axis="x", alpha=0.3)
    return _save(plt, fig, out / "transfers.png")


def plot_timeline(runs: list[Run], out: Path) -> Path | None:
    """A few steps in the middle of each run with a timeline: one lane per rank, a bar per span,
    coloured by phase, as Horovod's timeline shows an allreduce."""
    traced = [r for r in runs if len(r.timeline)]
    if not traced:
        return None
    plt, fig, axes = _figure(len(traced), 1, figsize=(11, 1.2 + 0.45 * sum(
        len(np.unique(r.timeline["rank"])) for r in traced)), squeeze=False)
    colours = {c: plt.get_cmap("tab20")(k % 20) for k, c in enumerate(PHASE_ORDER)}
    colours[0] = "lightgrey"
    seen = set()
    for ax, r in zip(axes[:, 0], traced):
        t0, t1 = window(r.timeline[r.timeline["rank"] == r.timeline["rank"].max()])
        spans = r.timeline[(r.timeline["t_end"] > t0) & (r.timeline["t_begin"] < t1)]
        ranks = sorted(np.unique(r.timeline["rank"]).tolist())
        roles = r.roles
        for lane, rank in enumerate(ranks):
            mine = spans[spans["rank"] == rank]
            for code in np.unique(mine["phase"]).tolist():
                part = mine[mine["phase"] == code]
                begin = np.maximum(part["t_begin"], t0)
                ax.broken_barh(list(zip((begin - t0) * 1e3, (np.minimum(part["t_end"], t1) - begin) * 1e3)),
                               (lane - 0.4, 0.8), color=colours.get(code, "black"),
                               label=None if code in seen else PHASES.get(code, str(code)))
                seen.add(code)
        ax.set_yticks(range(len(ranks)), [f"rank {k} {roles.get(k, '')}".strip() for k in ranks])
        ax.invert_yaxis()
        ax.set(xlabel=f"ms from {t0:.3f} s", title=f"a few steps in the middle: {r.label}")
        ax.grid(axis="x", alpha=0.3)
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.tight_layout()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    path = out / "timeline.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend outside the lanes
    plt.close(fig)
    return path


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_report(paths: list[str], out: str | os.PathLike, *, target: float = 0.9) -> list[Path]:
    """Load ``paths``, write plots and tables into ``out``; return the files written."""
    runs = [load_run(p) for p in paths]
    names = [r.name for r in runs]
    for r, p in zip(runs, paths):  # keep labels unique when files share a name
        if names.count(r.name) > 1:
            r.name = f"{Path(p).parent.name}/{r.name}"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = write_tables(summary_rows(runs, target), out)
    ranks = rank_rows(runs)
    if ranks:
        written += write_tables(ranks, out, "ranks")
    scalars = scalar_rows(runs)
    if scalars:
        written += write_tables(scalars, out, "scalars")
    phases = phase_rows(runs)
    if phases:
        written += write_tables(phases, out, "phases") + write_traces(runs, out)
    written += [plot_accuracy(runs, out, target), plot_throughput(runs, out), plot_breakdown(runs, out),
                plot_staleness(runs, out)]
    optional = [plot_thresholds(runs, out), plot_transfers(runs, out), plot_timeline(runs, out),
                plot_scalars(runs, out)]
    return written + [p for p in optional if p is not None]
