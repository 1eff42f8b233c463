"""What ``auto`` means for the layout, the pull and the partitions: the configuration measured fastest
(docs/results.md, *Defaults that are the measured best*), for a user who sets no flag.

Pure policy, no MPI: the callers bring the facts (each rank's node, the model's tensors, where the
workers compute). Each rule keeps the old behaviour wherever the new one was not measured faster, and
what it chose is said once at the start (:func:`describe`) and kept in the run file's config.

* **Servers** (``--servers auto``): one shard on each node, beside the workers there, when the job spans
  nodes and every node has a rank to spare for a worker; else one shard. A shard per node serves a
  1/M slice of every pull from each node's own link, where one server's link carries every worker's
  traffic (in the box, 8 ranks on 4 nodes: one server took 5.15x DDP's step, a shard per node 0.90x).
* **Pull** (``--pull auto``): the shards send a round's values (``send``) where the job spans nodes, the
  model's whole transfer over the link takes under :data:`SEND_MAX_S`, the paradigm releases every worker
  at a round's close and nothing the user set needs reads (16-bit pulls, ``--shards-at-once``,
  ``--overlap-steps``); the workers read the window (``get``) everywhere else. Over TCP a read costs round
  trips a send does not (in the box, bsp's step with send was 0.87x its step with get on a 40 ms
  transfer), but on long transfers the shards' sends lost (1.13-1.25x from 280 ms: a 33-45 MB model at
  1 Gbit/s, 4.8 MB at 100 Mbit/s); within a node the two took the same step (64.2-65.0 ms), so there the
  window is read as before.
* **Partitions** (``--partition-mb auto``): partitioned pulls and pushes during backward where a
  link lies between the workers and the shards (the job spans nodes), the workers compute on the CPU, the
  paradigm pulls between steps one gradient per step, and the model's transfer over the link is long
  enough to pipeline (:data:`PARTITION_MIN_S`, 4 MB at 1 Gbit/s). Where the workers read the window
  (``get``), a partition of 1/16 of the model, within 0.25 and 4 MB (the box measured 0.1-1 MB alike on a
  4.8 MB model, 0.5 MB on an 8.4 MB one). Where the shards send the rounds, 1/40 of the model, within 0.1
  and 4 MB (:data:`PARTITION_PIECES_SENT`): every shard sends its pieces at once, each in its slice's order,
  so a worker's link brings the model in rounds of one piece from each shard, and a layer can begin only
  once the round holding its last values is whole; the finer the stripe, the closer to one stream in the
  pass's order, until the pieces' own cost wins. Whole transfers elsewhere: on one node shared memory
  leaves no transfer to hide, and on a GPU a pull is a copy to the device.

The link is measured at start-up, where a rule needs it and the job spans nodes: a stream from rank 0 to
a rank on another node, a fraction of a second (:func:`hpcps.check.probe.link_between_nodes`); the pull and
the partitions are settled once the model is built (its size), the servers before (a plan made before
launch, ``hpcps jobs render``, settles only those).
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from hpcps.options.config import TrainConfig
from hpcps.options.effects import REFUSALS

AUTO = "auto"
#: a model smaller than this goes whole under --partition-mb auto: in the box at 1 Gbit/s partitions took 0.72x
#: the step of whole transfers on the 4.8 MB deep_mlp, and gained nothing on the 1.4 MB language model of
#: tools/bench_local.py (105.7 against 103.9 ms, two seeds), whose transfer is short beside its passes
PARTITION_MIN_MB = 4.0
#: the partition size under --partition-mb auto: the model over this many pieces, within the bounds below
PARTITION_PIECES = 16
PARTITION_MB_RANGE = (0.25, 4.0)
#: the same under ``--pull send``: in the box (4 nodes at 1 Gbit/s, a shard and a worker on each, the 4.8 MB
#: deep_mlp, 200 steps) bsp's mean step was 83.5-85.0 ms with 0.286 MB partitions (1/16), 82.2 on average at
#: 0.2, 81.7 at 0.15 and 0.125, 80.8 at 0.1, and 84.2 at 0.07 (each piece a message of every push and
#: every round: the workers' compute rose 3 ms); the forward pass's wait for its pull fell from 12 to 8-9 ms
PARTITION_PIECES_SENT = 40
PARTITION_MB_RANGE_SENT = (0.1, 4.0)
#: the link the rules assume where none was measured (one node, or a caller that does not say), bits/s: the
#: box's 1 Gbit/s, where the rules were first measured
REFERENCE_BPS = 1e9
#: --partition-mb auto pipelines a model whose whole transfer over the measured link takes at least this long
#: (seconds): PARTITION_MIN_MB at the reference link, 33.6 ms. At 100 Mbit/s the 1.4 MB language model's
#: transfer (117 ms) passes it, and 0.25 MB partitions took 0.84x the step of whole transfers there
PARTITION_MIN_S = PARTITION_MIN_MB * 2**20 * 8 / REFERENCE_BPS
#: --pull auto sends a round's values only where the model's whole transfer over the link takes less than this
#: (seconds). In the box (bsp, a shard per node), sends against reads by that time: 0.92x at 12 ms, 0.87x at
#: 40, 0.96x at 80, alike at 117-160, 1.13x at 280, 1.18-1.25x at 370 and 1.13x at 400 (docs/results.md,
#: *No flags against every layout*)
SEND_MAX_S = 0.1


def servers_for(cfg: TrainConfig, nodes: Sequence[int]) -> int:
    """``--servers auto`` on ranks whose nodes are ``nodes`` (``nodes[r]``: rank r's node): one shard per
    node where the job spans nodes, each node has two ranks or more and a worker is left (spares and
    group servers counted), else 1. Grouped paradigms keep one central shard: their group servers carry
    the links' traffic. Under ``--placement rank`` the shards are ranks 0..S-1 as launched: one per node
    only where those ranks sit on different nodes (a cyclic rank order), else 1."""
    per_node = Counter(nodes)
    n_nodes = len(per_node)
    if n_nodes < 2 or min(per_node.values()) < 2 or cfg.groups:
        return 1
    if len(nodes) - n_nodes - cfg.spare_workers < 1:
        return 1
    if cfg.placement == "rank" and len(set(nodes[:n_nodes])) < n_nodes:
        return 1
    return n_nodes


def pull_for(cfg: TrainConfig, paradigm: type, spans_nodes: bool, link_bps: float | None = None,
             model_bytes: int = 0) -> str:
    """``--pull auto``: ``send`` where the job spans nodes, the model's whole transfer over the link
    (``link_bps``, measured; None: :data:`REFERENCE_BPS`) takes under :data:`SEND_MAX_S`, and ``--pull send``
    would be refused for nothing (:data:`hpcps.options.effects.REFUSALS`: the paradigm releases every worker
    at a round's close, and no option needs the workers to read), else ``get``."""
    transfer_s = model_bytes * 8 / (REFERENCE_BPS if link_bps is None else link_bps)
    if not spans_nodes or transfer_s >= SEND_MAX_S:
        return "get"
    sending = cfg.model_copy(update={"pull": "send"})
    refused = any(r.applies(sending, paradigm) and not r.applies(cfg, paradigm) for r in REFUSALS)
    return "get" if refused else "send"


def partition_mb_for(cfg: TrainConfig, paradigm: type, model_bytes: int, spans_nodes: bool, on_cpu: bool,
                     link_bps: float | None = None, pull: str = "get") -> float:
    """``--partition-mb auto``: a partition size in MB, or 0 (whole transfers); see the module's docstring.
    ``link_bps``: the link between nodes, measured (None: :data:`REFERENCE_BPS`); ``pull``: how the run's
    workers take the rounds (settled: ``get`` or ``send``)."""
    pipelines = not (paradigm.eager_pull or paradigm.uses_groups or cfg.inner_steps is not None)
    mb = model_bytes / 2**20
    transfer_s = model_bytes * 8 / (REFERENCE_BPS if link_bps is None else link_bps)
    if not (spans_nodes and on_cpu and pipelines and cfg.compress == "none") or transfer_s < PARTITION_MIN_S:
        return 0.0
    pieces, (low, high) = ((PARTITION_PIECES_SENT, PARTITION_MB_RANGE_SENT) if pull == "send"
                           else (PARTITION_PIECES, PARTITION_MB_RANGE))
    return round(min(high, max(low, mb / pieces)), 3)


def needs_link(cfg: TrainConfig, nodes: Sequence[int]) -> bool:
    """Whether the rules need the link between nodes measured: the job spans nodes and the pull or the
    partitions are left to them."""
    return len(set(nodes)) > 1 and AUTO in (cfg.pull, cfg.partition_mb)


def settle_layout(cfg: TrainConfig, nodes: Sequence[int]) -> TrainConfig:
    """``cfg`` with ``servers`` made concrete (what it is already, where the user set it). The pull and the
    partitions wait for the model (:func:`settle_transfers`); ``auto`` is never refused meanwhile."""
    return cfg.model_copy(update={"servers": servers_for(cfg, nodes)}) if cfg.servers == AUTO else cfg


def settle_transfers(cfg: TrainConfig, paradigm: type, model_bytes: int, spans_nodes: bool,
                     on_cpu: bool, link_bps: float | None = None) -> TrainConfig:
    """``cfg`` with ``pull`` and ``partition_mb`` made concrete, from the model's size, the link between
    nodes (``link_bps``, measured; None: :data:`REFERENCE_BPS`) and where the workers compute."""
    update = {}
    if cfg.pull == AUTO:
        update["pull"] = pull_for(cfg, paradigm, spans_nodes, link_bps, model_bytes)
    if cfg.partition_mb == AUTO:
        update["partition_mb"] = partition_mb_for(cfg, paradigm, model_bytes, spans_nodes, on_cpu, link_bps,
                                                  pull=update.get("pull", cfg.pull))
    return cfg.model_copy(update=update) if update else cfg


def describe(given: TrainConfig, settled: TrainConfig, link_bps: float | None = None) -> str | None:
    """One line naming what ``auto`` chose for this run (None where the user set all three), and the link
    it measured to choose (``link_bps``)."""
    chose = []
    if given.servers == AUTO:
        chose.append(f"{settled.servers} server shard{'s' if settled.servers != 1 else ''}"
                     + (" (one per node)" if settled.servers > 1 else ""))
    if given.pull == AUTO:
        chose.append(f"pull {settled.pull}")
    if given.partition_mb == AUTO:
        chose.append(f"partitions of {settled.partition_mb:g} MB" if settled.partition_mb else "whole transfers")
    if not chose:
        return None
    link = f" (the link between nodes measured at {link_bps / 1e6:.0f} Mbit/s)" if link_bps else ""
    return "defaults for this job: " + ", ".join(chose) + link
