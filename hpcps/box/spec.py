"""A cluster in a box, described: nodes, their links, the switch's buffer, ranks per node.

Pure: no subprocess, no MPI. :mod:`hpcps.box.net` carries out the commands
written here. The box it builds, for a cluster named ``PREFIX`` (``hpcps<pid>-``)::

    namespace PREFIXsw                       namespace PREFIXn<k> (one per node)
    ┌───────────────────────────┐            ┌──────────────────────────────┐
    │ bridge br0                │            │ hpcps0  10.213.0.<k+1>/24    │
    │   port p<k> ──── veth ────┼────────────┼── egress: tbf at the node's  │
    │   egress: tbf at node k's │            │   rate (the node's uplink)   │
    │   rate, queue = --buffer  │            │ lo                           │
    │   (the switch's buffer)   │            └──────────────────────────────┘
    └───────────────────────────┘

Each direction of a node's link is shaped by its own token bucket: the
node's egress (what it sends) inside its namespace, and the switch port's
egress (what it receives) inside the switch's. A switch port queues at most
``buffer`` bytes, as a shallow-buffered switch does: when many nodes send to
one at once (incast), the port drops packets and TCP backs off or times out.
Nothing is created in the host's own namespace, so deleting the namespaces
removes everything.

TCP between the nodes runs the congestion control the cluster names (its
route's ``congctl``): cubic, Linux's own default, unless told otherwise, so
that the box's timings do not hang on the host's choice. Some hosts default
to BBR, which does not back off on loss: in a parameter server's incasts it
kept the switch's ports overflowing, and bsp's mean step in the box was
8-10% longer than under cubic (docs/results.md).
"""

from __future__ import annotations

from typing import Sequence

import json
import re
from dataclasses import dataclass

#: name of every node's interface inside its namespace (MPICH's ``FI_TCP_IFACE``)
NODE_IFACE = "hpcps0"
BRIDGE = "br0"
SUBNET = "10.213.0"  # node k has SUBNET.(k+1)/24; the address exists only inside the box's namespaces
PREFIX_RE = re.compile(r"^hpcps(\d+)-")
#: the nodes' TCP congestion control unless told otherwise (Linux's default); HOST_CONGESTION keeps the host's
CONGESTION = "cubic"
HOST_CONGESTION = "host"
MAX_NODES = 250

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_SIZE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_rate(text: str) -> int:
    """Bits per second from ``1gbit``, ``250mbit``, ``100kbit`` or plain bits (SI prefixes)."""
    return int(_parse(text, _RATE_UNITS, "bit", "a link rate such as 1gbit or 250mbit"))


def parse_size(text: str) -> int:
    """Bytes from ``64kb``, ``1mb`` (SI), ``64kib``, ``1mib`` (binary) or plain bytes."""
    return int(_parse(text, _SIZE_UNITS, "b", "a size such as 64kb, 1mib or 200000"))


def _parse(text: str, units: dict, default: str, what: str) -> float:
    m = _NUMBER_UNIT.match(str(text))
    unit = (m.group(2) or default).lower() if m else ""
    if not m or unit not in units or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not {what} (units: {', '.join(units)})")
    return float(m.group(1)) * units[unit]


def format_rate(bps: float) -> str:
    """``1 Gbit/s``-style text for a rate in bits per second."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def describe_record(record: dict) -> str:
    """One line for a cluster record (:meth:`Cluster.record`): nodes grouped by link rate, ranks, buffer."""
    groups: dict[int, list[int]] = {}
    for k, rate in enumerate(record["link_bps"]):
        groups.setdefault(rate, []).append(k)
    links = ", ".join(f"{_span(ks)} at {format_rate(rate)}" for rate, ks in groups.items())
    per_node = record["ranks_per_node"]
    tcp = record.get("congestion")
    return (f"{record['nodes']} nodes ({links}), {sum(per_node)} ranks ({'/'.join(map(str, per_node))} per node), "
            f"switch buffer {record['buffer_bytes']:,} bytes per port" + (f", TCP {tcp}" if tcp else ""))


def _span(ks: list[int]) -> str:
    if len(ks) == 1:
        return f"node {ks[0]}"
    if ks == list(range(ks[0], ks[-1] + 1)):
        return f"nodes {ks[0]}-{ks[-1]}"
    return "nodes " + ",".join(map(str, ks))


@dataclass(frozen=True)
class Node:
    """One emulated node: its link rate (each direction) and how many ranks it runs."""

    rate_bps: int
    ranks: int = 1


@dataclass(frozen=True)
class Cluster:
    """Nodes (in rank order: node 0's ranks come first), the switch's per-port buffer, the names' prefix, the
    nodes' TCP congestion control (a kernel's name for one, or :data:`HOST_CONGESTION`)."""

    nodes: tuple[Node, ...]
    buffer_bytes: int
    prefix: str = "hpcps0-"
    congestion: str = CONGESTION

    def __post_init__(self) -> None:
        if not 1 <= len(self.nodes) <= MAX_NODES:
            raise ValueError(f"--nodes must be 1 to {MAX_NODES}, not {len(self.nodes)}")
        if not PREFIX_RE.match(self.prefix):
            raise ValueError(f"prefix {self.prefix!r} must look like hpcps<digits>-")
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,15}", self.congestion):
            raise ValueError(f"--congestion {self.congestion!r}: expected an algorithm's name, such as cubic, "
                             f"reno or bbr, or {HOST_CONGESTION}")

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def namespace(self, k: int) -> str:
        return f"{self.prefix}n{k}"

    @staticmethod
    def address(k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    @property
    def n_ranks(self) -> int:
        return sum(n.ranks for n in self.nodes)

    def node_of_rank(self) -> list[int]:
        """``[node of world rank 0, node of rank 1, ...]``: ranks fill the nodes in order."""
        return [k for k, node in enumerate(self.nodes) for _ in range(node.ranks)]

    def record(self) -> dict:
        """What the run file keeps (``cluster`` attribute) and ``hpcps report`` shows."""
        return {"emulated": True, "nodes": len(self.nodes),
                "link_bps": [n.rate_bps for n in self.nodes],
                "ranks_per_node": [n.ranks for n in self.nodes],
                "node_of_rank": self.node_of_rank(),
                "buffer_bytes": self.buffer_bytes, "congestion": self.congestion}


def make_cluster(nodes: int, links: list[str], *, buffer: str, ranks_per_node: int = 1,
                 ranks: list[str] | None = None, prefix: str = "hpcps0-", congestion: str = CONGESTION) -> Cluster:
    """A :class:`Cluster` from the command line's words.

    ``links``: ``RATE`` sets every node's link, ``NODE=RATE`` (or ``A-B=RATE``, a range) one node's;
    later words win. ``ranks``: ``NODE=COUNT`` overrides ``ranks_per_node`` for a node (0 is allowed:
    a node that only routes nothing, e.g. an idle spare). ``congestion``: the nodes' TCP congestion control
    (:data:`HOST_CONGESTION`: the host's). Raises ValueError naming the option.
    """
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"--nodes must be 1 to {MAX_NODES}, not {nodes}")
    rates = [parse_rate("1gbit")] * nodes
    for word in links or []:
        for k, value in _per_node(word, nodes, "--link"):
            rates[k] = _option(parse_rate, value, "--link")
    if ranks_per_node < 0:
        raise ValueError(f"--ranks-per-node must be >= 0, not {ranks_per_node}")
    counts = [ranks_per_node] * nodes
    for word in ranks or []:
        if "=" not in word:
            raise ValueError(f"--ranks {word!r}: expected NODE=COUNT")
        for k, value in _per_node(word, nodes, "--ranks"):
            counts[k] = _option(_count, value, "--ranks")
    if sum(counts) < 1:
        raise ValueError("the cluster runs no rank: give --ranks-per-node or --ranks NODE=COUNT")
    buffer_bytes = _option(parse_size, buffer, "--buffer")
    return Cluster(tuple(Node(r, c) for r, c in zip(rates, counts)), buffer_bytes, prefix, congestion)


def _count(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a rank count")
    return int(text)


def _option(parse, value: str, option: str):
    try:
        return parse(value)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def _per_node(word: str, nodes: int, option: str) -> list[tuple[int, str]]:
    """``VALUE`` -> every node; ``K=VALUE`` or ``A-B=VALUE`` -> those nodes."""
    if "=" not in word:
        return [(k, word) for k in range(nodes)]
    which, value = word.split("=", 1)
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", which.strip())
    if not m:
        raise ValueError(f"{option} {word!r}: expected NODE=VALUE or FIRST-LAST=VALUE")
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if not lo <= hi < nodes:
        raise ValueError(f"{option} {word!r}: nodes are 0 to {nodes - 1}")
    return [(k, value) for k in range(lo, hi + 1)]


def burst_bytes(rate_bps: int) -> int:
    """The token bucket's depth: a millisecond at the link's rate, and at least a 64 KiB GSO packet.

    Smaller buckets drop the large segments veth hands to the qdisc; larger ones let a
    short transfer beat the rate by the bucket's size.
    """
    return max(rate_bps // 8 // 1000, 64 * 1024 + 4096)


#: queue of a node's own egress: deep, so losses happen at the switch, where --buffer sets them
NODE_QUEUE_BYTES = 4 * 1024 * 1024


def setup_commands(cluster: Cluster) -> list[list[str]]:
    """The ``ip``/``tc`` commands that build the box, in order (each an argv). The nodes' TCP takes the
    cluster's congestion control from their subnet's route (``congctl``), which every connection between
    two nodes follows; nothing of the host's is changed."""
    sw = cluster.switch
    cmds = [["ip", "netns", "add", sw],
            ["ip", "-n", sw, "link", "add", "name", BRIDGE, "type", "bridge"],
            ["ip", "-n", sw, "link", "set", "dev", BRIDGE, "up"]]
    for k, node in enumerate(cluster.nodes):
        ns, port, burst = cluster.namespace(k), f"p{k}", str(burst_bytes(node.rate_bps))
        rate = f"{node.rate_bps}bit"
        cmds += [["ip", "netns", "add", ns],
                 ["ip", "-n", sw, "link", "add", "name", port, "type", "veth", "peer", "name", NODE_IFACE,
                  "netns", ns],
                 ["ip", "-n", sw, "link", "set", "dev", port, "master", BRIDGE, "up"],
                 ["ip", "-n", ns, "addr", "add", f"{cluster.address(k)}/24", "dev", NODE_IFACE],
                 ["ip", "-n", ns, "link", "set", "dev", NODE_IFACE, "up"],
                 ["ip", "-n", ns, "link", "set", "dev", "lo", "up"],
                 *([] if cluster.congestion == HOST_CONGESTION else
                   [["ip", "-n", ns, "route", "replace", f"{SUBNET}.0/24", "dev", NODE_IFACE, "proto", "kernel",
                     "scope", "link", "src", cluster.address(k), "congctl", cluster.congestion]]),
                 ["tc", "-n", ns, "qdisc", "add", "dev", NODE_IFACE, "root", "tbf", "rate", rate,
                  "burst", burst, "limit", str(NODE_QUEUE_BYTES)],
                 ["tc", "-n", sw, "qdisc", "add", "dev", port, "root", "tbf", "rate", rate,
                  "burst", burst, "limit", str(max(cluster.buffer_bytes, int(burst)))]]
    return cmds


#: the MPI families the box launches its own way (:func:`mpi_environment`, :func:`mpmd_argv`)
FAMILIES = ("mpich", "openmpi", "intel-mpi")


def mpi_environment(cluster: Cluster, family: str = "mpich", agent: str | None = None) -> dict[str, str]:
    """What every rank needs: the MPI over TCP on the node's interface, and the box's description.

    MPICH: ``MPIR_CVAR_NOLOCAL`` keeps it from taking shared memory between ranks that are on one
    real host but on different emulated nodes. Open MPI: a daemon of its own on every emulated node,
    started through ``agent`` (the script of :func:`ssh_agent_script`, as a cluster's ``mpirun`` starts
    them through ssh), so Open MPI knows which ranks share a node: with one daemon for all, osc/rdma
    put every ``MPI_Win_allocate`` window in the host's shared memory, and pulls never crossed a
    link. Point-to-point goes over the TCP BTL alone (``self,tcp``), one-sided through ``osc/rdma``
    over it, and the daemons and PMIx talk on the nodes' interface. Intel MPI: OFI alone (no shared
    memory, which it takes between ranks of one host whatever MPICH's variables say: a job hung there)
    over its TCP provider on the node's interface.
    """
    record = {"HPCPS_CLUSTER": json.dumps(cluster.record(), separators=(",", ":"))}
    if family == "openmpi":
        return {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp", "OMPI_MCA_btl_tcp_if_include": NODE_IFACE,
                "OMPI_MCA_osc": "rdma", "PMIX_MCA_ptl_tcp_if_include": NODE_IFACE,
                "PRTE_MCA_oob_tcp_if_include": NODE_IFACE, "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
                **({"PRTE_MCA_plm_ssh_agent": agent} if agent else {}), **record}
    if family == "intel-mpi":
        return {"I_MPI_FABRICS": "ofi", "I_MPI_OFI_PROVIDER": "tcp", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": NODE_IFACE,
                **record}
    return {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
            "FI_TCP_IFACE": NODE_IFACE, **record}


def ssh_agent_script(cluster: Cluster) -> str:
    """The shell script Open MPI's launcher starts each emulated node's daemon through, in place of ssh:
    called with the node's address and the daemon's command line, it runs that line inside the node's
    namespace, under a host name of the node's own (a UTS namespace: Open MPI tells nodes apart by it)."""
    cases = "".join(f"  {cluster.address(k)}) ns={cluster.namespace(k)} ;;\n"
                    for k, node in enumerate(cluster.nodes) if node.ranks)
    return ("#!/bin/sh\n"
            "# hpcps emulate: Open MPI's daemons start on the emulated nodes through this script, as through ssh\n"
            'case "$1" in\n' + cases +
            '  *) echo "hpcps emulate: no emulated node has the address $1" >&2; exit 1 ;;\n'
            "esac\n"
            "shift\n"
            """exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$ns" "$*"\n""")


def mpmd_argv(cluster: Cluster, mpiexec: str, command: list[str], family: str = "mpich",
              options: Sequence[str] = ()) -> list[str]:
    """One ``mpiexec`` that starts each node's ranks inside its namespace (MPMD segments).

    ``HPCPS_NODE`` tells a rank which emulated node it is on (for ``/ranks`` and the report). MPICH's
    launcher runs in the host's namespace and its proxies start each segment in its node's namespace.
    Open MPI's runs in the first node's namespace, under that node's host name, and starts a daemon on
    every other node through :func:`ssh_agent_script`; each segment names its node by address
    (``--host ADDRESS:RANKS``), as on a cluster. ``options``: the launcher's own, before the segments.
    """
    nodes = [(k, node) for k, node in enumerate(cluster.nodes) if node.ranks]
    segments = []
    for k, node in nodes:
        where = ["--host", f"{cluster.address(k)}:{node.ranks}"] if family == "openmpi" else \
            ["ip", "netns", "exec", cluster.namespace(k)]
        segments.append(["-n", str(node.ranks), *where, "env", f"HPCPS_NODE={k}", *command])
    argv = [mpiexec]
    if family == "openmpi":
        first = cluster.namespace(nodes[0][0])
        argv = ["ip", "netns", "exec", first, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', first,
                mpiexec]
    argv += list(options)
    for n, segment in enumerate(segments):
        argv += ([":"] if n else []) + segment
    return argv


def box_pid(namespace: str) -> int | None:
    """The pid in a box namespace's name (``hpcps<pid>-...``), or None if it is not one of ours."""
    m = PREFIX_RE.match(namespace)
    return int(m.group(1)) if m else None
