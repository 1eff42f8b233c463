"""The box's links over time (``hpcps emulate --link-trace FILE``): every node's bytes in and out, read
every millisecond through the job.

The drop and retransmission counters (:mod:`hpcps.box.counters`) say whether a link suffered; they do not
say when it sat idle. A step of a parameter server in the box carries a fixed number of bytes each way over
every node's link, so the step's time above those bytes at the line rate is time the link was idle: the
trace says where in the step that idle time falls (a node's link full while its worker pulls, then idle
while the last layers' forward and the first layers' backward compute, then full with the pushes).

The switch's port ``p<k>`` sends what node ``k`` receives (through the tbf that shapes it) and receives
what node ``k`` sends, so one process in the switch's namespace reads every node's both directions from its
counters (sysfs). That process (``python -m hpcps.box.trace``) samples until it is told to stop (SIGTERM
or SIGINT) and then writes an ``.npz``: ``t`` (wall-clock seconds, ``time.time()``, the run file's
``clock_start`` is on the same clock), ``received`` and ``sent`` (bytes so far, one column per node, in
node order) and ``rate_bps`` (each node's link). :func:`describe` is the summary :mod:`hpcps.box.launch`
prints at the job's end. The sampling costs a few percent of one core.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Sequence

import numpy as np

#: seconds between two reads of the counters
PERIOD = 0.001
#: a bin is idle below this share of the line rate
IDLE_SHARE = 0.1


def port_files(ports: Sequence[str], root: str = "/sys/class/net") -> list[tuple]:
    """Each port's received and transmitted byte counters (sysfs, in the namespace the process is in), opened
    once: a sample is a ``pread`` of each. (``/proc/net/dev``, all ports in one read, now and then left one
    port out while the job ran.)"""
    return [tuple(open(f"{root}/{port}/statistics/{what}_bytes", "rb", buffering=0) for what in ("rx", "tx"))
            for port in ports]


def read_counts(files: Sequence[tuple]) -> list[tuple[int, int]]:
    """The counters of :func:`port_files` now: ``(received, transmitted)`` per port, in their order."""
    return [(int(os.pread(rx.fileno(), 32, 0)), int(os.pread(tx.fileno(), 32, 0))) for rx, tx in files]


def shares(t: np.ndarray, count: np.ndarray, at: np.ndarray, rate_bps: float) -> np.ndarray:
    """A link's rate between consecutive times ``at``, as a share of its line rate, from its byte count at the
    sampled times ``t`` (interpolated between samples)."""
    return np.diff(np.interp(at, t, count)) * 8 / np.diff(at) / rate_bps


def busy(t: np.ndarray, count: np.ndarray, rate_bps: float, bin_s: float = 0.01) -> tuple[float, float]:
    """For one direction of one link, from its byte count at times ``t``: the mean rate as a share of the
    line rate, and the share of ``bin_s`` bins in which it carried under :data:`IDLE_SHARE` of it."""
    t, count = np.asarray(t, float), np.asarray(count, float)
    if len(t) < 2 or t[-1] - t[0] < bin_s:
        return 0.0, 0.0
    mean = (count[-1] - count[0]) * 8 / (t[-1] - t[0]) / rate_bps
    per_bin = shares(t, count, np.arange(t[0], t[-1], bin_s), rate_bps)
    return float(mean), float(np.mean(per_bin < IDLE_SHARE)) if len(per_bin) else 0.0


def traffic_span(trace: dict, bin_s: float = 0.01) -> tuple[float, float]:
    """The wall-clock times of the first and the last ``bin_s`` bin in which some link carried at least
    :data:`IDLE_SHARE` of its rate, either way (the job's traffic, without its ranks' start-up and teardown
    around it); the whole trace if none did."""
    t = np.asarray(trace["t"], float)
    edges = np.arange(t[0], t[-1], bin_s) if len(t) > 1 else np.array([])
    active = np.zeros(max(len(edges) - 1, 0), bool)
    for d in ("received", "sent"):
        for k, rate in enumerate(trace["rate_bps"]):
            active |= shares(t, np.asarray(trace[d][:, k], float), edges, rate) >= IDLE_SHARE
    hit = np.flatnonzero(active)
    return (float(edges[hit[0]]), float(edges[hit[-1] + 1])) if len(hit) else (float(t[0]), float(t[-1]))


def describe(trace: dict) -> list[str]:
    """A line per node for the job's end: how full its link was each way, and how often idle, over the job's
    traffic (:func:`traffic_span`)."""
    t = trace["t"]
    begin, end = traffic_span(trace)
    keep = (t >= begin) & (t <= end)
    lines = [f"hpcps emulate: the links from their first traffic to their last ({end - begin:.1f} s):"]
    for k, rate in enumerate(trace["rate_bps"]):
        (into, idle_in), (out, idle_out) = (busy(t[keep], trace[d][keep, k], rate) for d in ("received", "sent"))
        lines.append(f"  node {k}: {into:.0%} of its rate in, {out:.0%} out; idle (under {IDLE_SHARE:.0%}) "
                     f"{idle_in:.0%} and {idle_out:.0%} of the time, by 10 ms")
    return lines


def step_profile(t: np.ndarray, count: np.ndarray, rate_bps: float, starts: np.ndarray, length: float,
                 bin_s: float = 0.005) -> np.ndarray:
    """One direction of one link through the average step: its rate as a share of the line rate in each
    ``bin_s`` from the steps' ``starts`` (wall-clock) up to ``length`` seconds after, averaged over the steps
    the trace covers whole."""
    t, count = np.asarray(t, float), np.asarray(count, float)
    offsets = np.arange(0.0, length + bin_s / 2, bin_s)
    rows = [shares(t, count, start + offsets, rate_bps)
            for start in starts if start >= t[0] and start + length <= t[-1]]
    return np.mean(rows, axis=0) if rows else np.zeros(len(offsets) - 1)


#: a worker's phases (:data:`hpcps.metrics.timeline.PHASES`) as the profile's phase row writes them
PHASE_LETTERS = {"data": "d", "compute": "c", "emulated": "e", "push": "u", "grant": "g", "pull": "p",
                 "scan": "s", "other": "o"}


def phase_row(spans: np.ndarray, starts: np.ndarray, length: float, bin_s: float = 0.005,
              resolution: float = 0.0005) -> list[str]:
    """A worker's phase in each ``bin_s`` of its average step: the one it was in most often, over its steps
    (``starts``, on the run's clock), at points ``resolution`` apart; ``spans``: its rows of ``/timeline``."""
    from hpcps.metrics.timeline import PHASES

    n_bins = len(np.arange(0.0, length + bin_s / 2, bin_s)) - 1
    if not len(spans) or not len(starts):
        return ["?"] * n_bins
    spans = np.sort(spans, order="t_begin")
    points = np.arange(0.0, n_bins * bin_s, resolution)
    times = (np.asarray(starts, float)[:, None] + points[None, :]).ravel()
    at = np.searchsorted(spans["t_begin"], times, side="right") - 1
    inside = (at >= 0) & (times < spans["t_end"][np.clip(at, 0, None)])
    phases = np.where(inside, spans["phase"][np.clip(at, 0, None)], -1).reshape(len(starts), len(points))
    which = np.minimum((points / bin_s).astype(int), n_bins - 1)
    row = []
    for k in range(n_bins):
        seen = phases[:, which == k].ravel()
        seen = seen[seen >= 0]
        if not len(seen):
            row.append("?")
            continue
        values, counts = np.unique(seen, return_counts=True)
        row.append(PHASE_LETTERS.get(PHASES.get(int(values[np.argmax(counts)]), ""), "?"))
    return row


def profile_lines(trace: dict, run_path: str, bin_s: float = 0.005) -> list[str]:
    """For each emulated node with a worker of the run (its file at ``run_path``): its link's use each way
    through that worker's average step, a column per ``bin_s``, from the step's start (where the worker has
    its grant and its pull begins) to its mean length; with ``--timeline``, the worker's phase in each column
    above them."""
    import h5py

    from hpcps.analysis.report import mean_step

    with h5py.File(run_path, "r") as f:
        clock_start = float(f.attrs["clock_start"])
        iterations = f["workers/iterations"][:]
        ranks = f["ranks"][:]
        timeline = f["timeline"][:] if "timeline" in f else None
    lines = [f"link use through the average step, % of the line rate every {bin_s * 1e3:g} ms from its start"]
    if timeline is not None:
        lines.append("the worker's phase most of each column: " + ", ".join(
            f"{letter} {name}" for name, letter in PHASE_LETTERS.items()))
    for row in ranks:
        host = row["host"].decode()
        node = host.rsplit("/n", 1)[-1]
        if row["role"] != b"worker" or not node.isdigit() or int(node) >= len(trace["rate_bps"]):
            continue
        k, mine = int(node), iterations[iterations["rank"] == row["rank"]]
        if not len(mine):
            continue
        length, starts = mean_step(mine), np.sort(mine["t_start"])  # on the run's clock
        lines.append(f"node {k} (worker rank {row['rank']}, mean step {length * 1e3:.1f} ms, median grant wait "
                     f"{np.median(mine['wait_s']) * 1e3:.1f} ms at its end, pull waits "
                     f"{np.median(mine['pull_s']) * 1e3:.1f} ms in its forward pass):")
        if timeline is not None:
            spans = timeline[timeline["rank"] == row["rank"]]
            lines.append("  phase " + " ".join(f"{c:>3}" for c in phase_row(spans, starts, length, bin_s)))
        for d in ("received", "sent"):
            use = step_profile(trace["t"], trace[d][:, k], trace["rate_bps"][k], starts + clock_start, length, bin_s)
            lines.append(f"  {'in   ' if d == 'received' else 'out  '} " + " ".join(f"{v * 100:3.0f}" for v in use))
    return lines


def load(path: str) -> dict:
    """A trace as :func:`main`'s ``sample`` wrote it: ``t``, ``received``, ``sent``, ``rate_bps``."""
    with np.load(path) as saved:
        return dict(saved)


#: what the sampler prints once it has read the counters a first time (the job may start then)
READY = "sampling"


def sample(ports: Sequence[str], period: float = PERIOD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read the counters of ``ports`` every ``period`` seconds until SIGTERM or SIGINT; (t, received, sent).
    Prints :data:`READY` after the first read."""
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    times, received, sent = [], [], []
    files = port_files(ports)
    try:
        while not stop or not times:
            counts = read_counts(files)
            times.append(time.time())
            received.append([tx for _, tx in counts])  # the port sends what its node receives
            sent.append([rx for rx, _ in counts])
            if len(times) == 1:
                print(READY, flush=True)
            time.sleep(period)
    finally:
        for pair in files:
            for f in pair:
                f.close()
    return np.array(times), np.array(received, np.int64), np.array(sent, np.int64)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcps.box.trace")
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sample", help="(hpcps emulate's) sample the switch's ports, in its namespace, until "
                                      "SIGTERM, then write the trace")
    s.add_argument("--out", required=True)
    s.add_argument("--period", type=float, default=PERIOD)
    s.add_argument("--rates", type=float, nargs="+", required=True, help="each node's link rate, bit/s")
    r = sub.add_parser("profile", help="each node's link use through its worker's average step")
    r.add_argument("trace", help="the .npz hpcps emulate --link-trace wrote")
    r.add_argument("run", help="the run file of the job it traced")
    r.add_argument("--bin-ms", type=float, default=5.0, dest="bin_ms", help="the columns' width (default 5 ms)")
    a = p.parse_args(argv)
    if a.what == "sample":
        t, received, sent = sample([f"p{k}" for k in range(len(a.rates))], a.period)
        np.savez(a.out, t=t, received=received, sent=sent, rate_bps=np.array(a.rates))
        return 0
    print("\n".join(profile_lines(load(a.trace), a.run, a.bin_ms / 1e3)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
