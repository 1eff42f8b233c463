"""What the box's links did during a job: the packets the switch dropped at each node's port, and the TCP
segments the nodes sent again.

A port's queue (``--buffer``) overflows when several nodes send to one at once (incast), and TCP then
sends again what was dropped, halving its window: a flow that lost packets delivers its message at a
fraction of the link while the others keep the queue full. A step that waited on such a flow looks,
from inside the job, like an unexplained slow step. The kernel counts both, so ``hpcps emulate`` reads
them before and after the job (:func:`read`) and says what changed (:func:`describe`): the switch's
``tbf`` drops per port (``tc -s``) and each node's ``RetransSegs`` and ``TCPTimeouts``
(``/proc/net/snmp`` and ``/proc/net/netstat`` in its namespace).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

from hpcps.box.spec import Cluster


@dataclass(frozen=True)
class Counters:
    """Per node (in node order): packets the switch dropped at its port (towards it), TCP segments it
    sent again, and those sent again after a retransmission timeout."""

    dropped: tuple[int, ...]
    retransmitted: tuple[int, ...]
    timeouts: tuple[int, ...]

    def __sub__(self, earlier: "Counters") -> "Counters":
        return Counters(*(tuple(a - b for a, b in zip(mine, theirs))
                          for mine, theirs in zip((self.dropped, self.retransmitted, self.timeouts),
                                                  (earlier.dropped, earlier.retransmitted, earlier.timeouts))))


def tbf_drops(tc_json: str) -> int:
    """The packets dropped by the root qdisc in ``tc -s -j qdisc show dev PORT``'s output."""
    return sum(int(q.get("drops", 0)) for q in json.loads(tc_json) if q.get("root"))


def snmp_value(text: str, group: str, name: str) -> int:
    """One counter of ``/proc/net/snmp`` or ``/proc/net/netstat``: a line of names under ``group:`` and the
    line of values that follows it."""
    lines = [line.split() for line in text.splitlines() if line.startswith(group + ":")]
    for names, values in zip(lines[::2], lines[1::2]):
        if name in names:
            return int(values[names.index(name)])
    raise KeyError(f"{group}:{name}")


def _out(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True)
    return done.stdout


def read(cluster: Cluster) -> Counters:
    """The box's counters now (raises ``OSError`` or ``subprocess.SubprocessError`` if a namespace is gone)."""
    dropped, retransmitted, timeouts = [], [], []
    for k in range(len(cluster.nodes)):
        dropped.append(tbf_drops(_out(["tc", "-s", "-j", "-n", cluster.switch, "qdisc", "show", "dev", f"p{k}"])))
        ns = cluster.namespace(k)
        snmp = _out(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp", "/proc/net/netstat"])
        retransmitted.append(snmp_value(snmp, "Tcp", "RetransSegs"))
        timeouts.append(snmp_value(snmp, "TcpExt", "TCPTimeouts"))
    return Counters(tuple(dropped), tuple(retransmitted), tuple(timeouts))


def describe(change: Counters, buffer_bytes: int) -> str:
    """One line for the job's end: what the switch dropped, where, and what TCP sent again."""
    dropped = sum(change.dropped)
    where = ", ".join(f"node {k} {n:,}" for k, n in enumerate(change.dropped) if n)
    drops = (f"the switch dropped {dropped:,} packets at the ports towards {where} (their queue, --buffer "
             f"{buffer_bytes:,} bytes, overflowed: many sending to one node at once)") if dropped else \
        "the switch dropped no packets"
    return (f"hpcps emulate: during the job {drops}; the nodes' TCP sent {sum(change.retransmitted):,} segments "
            f"again ({sum(change.timeouts):,} retransmission timeouts)")
