"""``hpcps check``: run under the job's launcher on a new allocation, it says in about a minute whether
hpcps will work there, and what to do where it will not (``srun -n 8 hpcps check``).

The order of work: every rank's facts; the window's memory model and the protocol hpcps picks; a pull
while its target computes without MPI (from a rank on the same node, and from one on another node);
the paths between nodes (one rank per node: every pair, or a ring on many nodes) and into each node
from all the others at once. Measurements live in :mod:`hpcps.check.probe`, their meaning in
:mod:`hpcps.check.findings`. Rank 0 prints; every rank returns the same exit status.
"""

from __future__ import annotations

import sys

from mpi4py import MPI

from hpcps.check import findings
from hpcps.check import probe
from hpcps.transport.window import choose_protocol, memory_model


def _say(comm: MPI.Comm, text: str) -> None:
    if comm.rank == 0:
        print(f"hpcps check: {text}", file=sys.stderr, flush=True)


def measure(comm: MPI.Comm, *, seconds: float = 0.5, busy_s: float = 1.0) -> findings.Report:
    """Collective: every measurement of the check on ``comm``, as a :class:`findings.Report` on every rank."""
    ranks = probe.rank_facts(comm)
    nodes = findings.nodes_of(ranks)
    names, leaders = list(nodes), [members[0] for members in nodes.values()]
    _say(comm, f"{comm.size} ranks on {len(nodes)} node(s); {ranks[0].library}")
    report = findings.Report(ranks=ranks, memory_model=memory_model(comm), protocol=choose_protocol(comm))
    readers = nodes[names[0]][1:2] + leaders[1:2]  # one on rank 0's node, one on another node
    for reader in readers:
        _say(comm, f"pulling from rank 0 while it computes for {busy_s:g} s (reader: rank {reader})")
        report.progress.append(probe.passive_progress(comm, 0, reader, same_node=reader in nodes[names[0]],
                                                      busy_s=busy_s))
    pairs = findings.pair_plan(len(nodes))
    if len(nodes) == 1 and comm.size > 1:  # one node: the path between its first two ranks
        pairs, leaders, names = [(0, 1)], nodes[names[0]][:2], [names[0], names[0]]
    for i, (a, b) in enumerate(pairs):
        _say(comm, f"path {i + 1} of {len(pairs)}: {names[a]} <-> {names[b]}")
        report.links.append(probe.pair_path(comm, leaders[a], leaders[b], (names[a], names[b]), seconds=seconds))
    if len(nodes) > 2:
        into = range(len(nodes)) if len(nodes) <= findings.ALL_PAIRS_UP_TO else [0]
        for k in into:
            _say(comm, f"all other nodes into {names[k]}")
            senders = [leader for j, leader in enumerate(leaders) if j != k]
            report.links.append(probe.fan_in(comm, leaders[k], senders, names[k], seconds=seconds))
    return report


def run_check(comm: MPI.Comm, *, seconds: float = 0.5, busy_s: float = 1.0, out=sys.stdout) -> int:
    """Collective: measure, print the table, one line per finding and the verdict (rank 0); return the exit
    status, the same on every rank (1 where hpcps would not work). The measurements talk on a duplicate of
    ``comm``, so their messages never meet the caller's."""
    own = comm.Dup()
    try:
        report = measure(own, seconds=seconds, busy_s=busy_s)
    finally:
        own.Free()
    found = findings.findings(report)
    line, status = findings.verdict(found)
    if comm.rank == 0:
        print(findings.table(report), file=out)
        print("", file=out)
        for f in found:
            print(f"{f.level.upper():<5} {f.what}" + (f"\n      -> {f.fix}" if f.fix else ""), file=out)
        print(line, file=out, flush=True)
    return status
