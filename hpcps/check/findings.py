"""``hpcps check``'s policy: which node pairs to measure, what the facts mean, the table and the verdict.

Pure (no MPI): :mod:`hpcps.check.probe` measures, this module decides. A check reads, for each rank,
:class:`RankFacts`; for the job, the passive-target :class:`Progress` probe and one :class:`Link` per
measured path. :func:`findings` turns them into one line per problem, each with what to do about it; a
finding of level ``fail`` means hpcps would not work there, and ``hpcps check`` then exits non-zero.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

#: a window's pulls that take longer than this share of the target's busy time waited for its CPU
WAITED_SHARE = 0.5
#: a path measured at less than this share of the median path is called out as slow
SLOW_SHARE = 0.5
#: node pairs measured one by one up to this many nodes; beyond, each node with its neighbour in a ring
ALL_PAIRS_UP_TO = 8


@dataclass(frozen=True)
class RankFacts:
    """What one rank sees of MPI and its devices."""

    rank: int
    node: str
    library: str          # the first line of MPI_Get_library_version
    implementation: str   # hpcps.transport.mpilib.implementation
    thread_level: str     # SINGLE, FUNNELED, SERIALIZED or MULTIPLE: what MPI provides
    gpus: tuple[str, ...] = ()  # the CUDA devices torch sees
    cuda_aware: bool = False
    cuda_why: str = ""


@dataclass(frozen=True)
class Progress:
    """Pulls from ``reader`` while ``target`` computes without calling MPI for ``busy_s`` seconds."""

    target: int
    reader: int
    same_node: bool
    busy_s: float
    slowest_pull_s: float
    median_pull_s: float
    intact: bool  # every pull returned the values published

    @property
    def progresses(self) -> bool:
        """Whether a pull completes while the target computes (passive-target progress)."""
        return self.slowest_pull_s < WAITED_SHARE * self.busy_s


@dataclass(frozen=True)
class Link:
    """One measured path: ``a`` to ``b`` (node labels), or every other node into ``b`` (``a`` is ``*``)."""

    a: str
    b: str
    bandwidth_bps: float
    latency_s: float | None = None  # half a round trip of a small message; None for fan-in

    @property
    def fan_in(self) -> bool:
        return self.a == "*"


@dataclass
class Report:
    """Everything a check found, ready for :func:`table` and :func:`findings`."""

    ranks: list[RankFacts]
    protocol: str                 # the window protocol hpcps picks here (pinned or locked)
    memory_model: str             # unified or separate
    progress: list[Progress] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)


@dataclass(frozen=True)
class Finding:
    level: str  # ok, warn or fail
    what: str
    fix: str = ""


def nodes_of(ranks: list[RankFacts]) -> dict[str, list[int]]:
    """The ranks on each node, nodes in the order of their lowest rank."""
    out: dict[str, list[int]] = {}
    for r in sorted(ranks, key=lambda f: f.rank):
        out.setdefault(r.node, []).append(r.rank)
    return out


def pair_plan(n_nodes: int) -> list[tuple[int, int]]:
    """The node pairs whose path is measured: every pair up to :data:`ALL_PAIRS_UP_TO` nodes, else a ring
    (each node and the next), so that the check stays about a minute on a large allocation."""
    if n_nodes < 2:
        return []
    if n_nodes <= ALL_PAIRS_UP_TO:
        return [(a, b) for a in range(n_nodes) for b in range(a + 1, n_nodes)]
    return [(a, (a + 1) % n_nodes) for a in range(n_nodes)]


def node_rates(links: list[Link]) -> dict[str, float]:
    """Each node's own link rate as the measurements bound it: the fastest path that touches it (a path
    runs at the slower of its two links; a fan-in into a node at its own link's rate, when the others
    can fill it)."""
    best: dict[str, float] = {}
    for link in links:
        if link.a == link.b:  # within a node: no link crossed
            continue
        for node in ((link.b,) if link.fan_in else (link.a, link.b)):
            best[node] = max(best.get(node, 0.0), link.bandwidth_bps)
    return best


def link_units(bps: float) -> str:
    """A rate in the units ``--link`` takes (``941mbit``, ``9.4gbit``), three significant digits."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g}{unit}"
    return f"{bps:.3g}bit"


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f} us"


def table(report: Report) -> str:
    """The check's table: MPI, threads, windows, progress, devices, ranks per node, the measured paths."""
    first = report.ranks[0]
    libraries = Counter(r.library for r in report.ranks)
    levels = Counter(r.thread_level for r in report.ranks)
    nodes = nodes_of(report.ranks)
    per_node = Counter(len(v) for v in nodes.values())
    rows = [("MPI library", first.library if len(libraries) == 1 else f"{len(libraries)} different (see below)"),
            ("implementation", first.implementation),
            ("thread level", ", ".join(f"MPI_THREAD_{k} on {n} rank(s)" for k, n in levels.items())),
            ("RMA memory model", f"{report.memory_model} (hpcps's window protocol here: {report.protocol})"),
            ("nodes", f"{len(nodes)}; ranks per node: "
                      + ", ".join(f"{k} on {n} node(s)" for k, n in per_node.items()))]
    for p in report.progress:
        where = "same node" if p.same_node else "another node"
        state = "progresses" if p.progresses else "waits for the target's CPU"
        rows.append((f"passive-target pull ({where})",
                     f"{state}: rank {p.reader} pulled from rank {p.target} while it computed {p.busy_s:.2f} s "
                     f"without MPI: median {p.median_pull_s * 1e3:.2f} ms, slowest {p.slowest_pull_s * 1e3:.1f} ms"
                     + ("" if p.intact else "; WRONG VALUES")))
    gpus = Counter(len(r.gpus) for r in report.ranks)
    rows.append(("GPUs per rank", ", ".join(f"{k} on {n} rank(s)" for k, n in sorted(gpus.items()))
                 + (f" ({', '.join(sorted({g for r in report.ranks for g in r.gpus}))})" if any(gpus.keys() - {0})
                    else "")))
    aware = sum(r.cuda_aware for r in report.ranks)
    said = "yes" if aware == len(report.ranks) else "no" if aware == 0 else f"on {aware} of {len(report.ranks)} ranks"
    rows.append(("CUDA-aware MPI", f"{said} ({first.cuda_why})"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if len(libraries) > 1:
        lines += [f"  rank {r.rank}: {r.library}" for r in report.ranks]
    if report.links:
        lines += ["", f"{'path':<28} {'bandwidth':>10} {'latency':>10}   (bandwidth in --link units)"]
        for link in report.links:
            path = (f"all others -> {link.b}" if link.fan_in else f"within {link.a}" if link.a == link.b
                    else f"{link.a} <-> {link.b}")
            lines.append(f"{path:<28} {link_units(link.bandwidth_bps):>10} {_us(link.latency_s):>10}")
        rates = node_rates(report.links)
        if rates:
            lines.append("each node's link, as measured: " + ", ".join(f"{n} {link_units(v)}"
                                                                         for n, v in rates.items()))
    return "\n".join(lines)


def findings(report: Report) -> list[Finding]:
    """One line per problem (``warn``: hpcps works, slower or with less; ``fail``: it would not work), each
    with what to do; a single ``ok`` line where there is none."""
    out: list[Finding] = []
    if len({r.library for r in report.ranks}) > 1:
        out.append(Finding("fail", "the ranks run different MPI libraries",
                           "load one MPI module in the job script and build mpi4py against it"))
    for p in report.progress:
        if not p.intact:
            out.append(Finding("fail", f"a pull of rank {p.target}'s window by rank {p.reader} returned other "
                                       f"values than were published",
                               "report it with this table; HPCPS_WINDOW=locked is the fallback to try"))
        elif not p.progresses:
            where = "within a node" if p.same_node else "between nodes"
            out.append(Finding("warn", f"pulls {where} wait while the server computes (passive-target RMA does "
                                       f"not progress on its own: up to {p.slowest_pull_s * 1e3:.0f} ms here)",
                               _progress_fix(report.ranks[0].implementation)))
    if report.memory_model != "unified":
        out.append(Finding("warn", "MPI gives the separate RMA memory model: hpcps pulls under locks, and a pull "
                                   "waits for the server's next poll",
                           "nothing to set; expect pulls to cost a server poll (docs/internals.md)"))
    if any(r.thread_level != "MULTIPLE" for r in report.ranks):
        out.append(Finding("warn", "MPI does not provide MPI_THREAD_MULTIPLE: --paradigm eager will refuse to "
                                   "start and rank 0 evaluates in the foreground",
                           "enable it in your MPI (MPICH_MAX_THREAD_SAFETY=multiple on Cray) and keep "
                           "MPI4PY_RC_THREAD_LEVEL=multiple"))
    if any(r.gpus for r in report.ranks) and not all(r.cuda_aware for r in report.ranks if r.gpus):
        out.append(Finding("warn", "GPUs are visible but MPI is not CUDA-aware here: GPU workers move tensors "
                                   "through pinned host memory (staged)",
                           "load the site's CUDA-aware MPI, or keep the staging (docs/gpu.md)"))
    slow = _slow_links(report.links)
    if slow:
        out.append(Finding("warn", "slow path(s): " + ", ".join(slow),
                           "a network straggler: give it fewer workers, or --paradigm dssp/eager; "
                           "check the node's cabling and adapter"))
    return out or [Finding("ok", "hpcps can run here")]


def _progress_fix(implementation: str) -> str:
    if implementation in ("mpich", "intel-mpi", "cray-mpich", "mvapich"):
        return ("hpcps's server polls between updates, so this costs latency, not correctness; an MPICH-family "
                "MPI progresses on its own with MPIR_CVAR_ASYNC_PROGRESS=1 (a spare core per rank)")
    if implementation == "openmpi":
        return ("hpcps's server polls between updates, so this costs latency, not correctness; Open MPI over "
                "TCP needs the target inside MPI for RMA (UCX on RDMA hardware does not)")
    return "hpcps's server polls between updates, so this costs latency, not correctness"


def _slow_links(links: list[Link]) -> list[str]:
    pairs = [link for link in links if not link.fan_in]
    if len(pairs) < 3:
        return []
    rates = sorted(link.bandwidth_bps for link in pairs)
    median = rates[len(rates) // 2]
    return [f"{link.a} <-> {link.b} at {link_units(link.bandwidth_bps)} (median {link_units(median)})"
            for link in pairs if link.bandwidth_bps < SLOW_SHARE * median]


def verdict(found: list[Finding]) -> tuple[str, int]:
    """The closing line and the exit status: 1 when any finding fails, else 0."""
    fails = [f for f in found if f.level == "fail"]
    warns = [f for f in found if f.level == "warn"]
    if fails:
        return f"verdict: hpcps would not work here ({len(fails)} failure(s), {len(warns)} warning(s))", 1
    if warns:
        return f"verdict: hpcps works here, with {len(warns)} warning(s)", 0
    return "verdict: hpcps works here", 0
