"""A cluster in a box: emulated nodes joined by real, rate-limited TCP links, on one Linux host.

* :mod:`hpcps.box.spec`: the cluster described (nodes, link rates, the switch's buffer, ranks per
  node) and the commands that build it; pure.
* :mod:`hpcps.box.net`: the mechanism: network namespaces, veth pairs, a bridge, ``tbf`` qdiscs;
  certain teardown.
* :mod:`hpcps.box.launch`: ``hpcps emulate``, which builds a box, runs one MPI job in it and takes
  it down.
* :mod:`hpcps.box.counters`: what the links did during the job (the switch's drops per port, the
  nodes' TCP retransmissions), said at its end.

A rank started by ``hpcps emulate`` finds the box's description in ``HPCPS_CLUSTER`` (JSON) and
its node in ``HPCPS_NODE``; :func:`cluster_record` and :func:`node_label` read them.
"""

from __future__ import annotations

import json
import os


def cluster_record(environ=os.environ) -> dict | None:
    """The emulated cluster this rank runs in (:meth:`hpcps.box.spec.Cluster.record`), or None."""
    text = environ.get("HPCPS_CLUSTER")
    return json.loads(text) if text else None


def node_label(hostname: str, environ=os.environ) -> str:
    """``host`` for a real node, ``host/n<k>`` for emulated node k of a box on host."""
    node = environ.get("HPCPS_NODE", "")
    return f"{hostname}/n{node}" if node.isdigit() else hostname
