"""Wire formats and tags of the parameter-server protocol.

All messages travel on the run's *PS communicator* (a duplicate of the run
communicator, so they never meet user or metrics traffic).

Push (worker -> every server shard), two messages in this order::

    tag PUSH_HEADER   int64[6]  kind, worker rank, clock, version, lr (float64 bits), push flags
    tag PUSH_DATA     float32[shard length]      the gradient's slice for that shard
                      (--compress: uint16[shard length] holding bf16 or fp16 values, or
                      top-k's int32[k] indices then float32[k] values; hpcps.transport.compress)

``kind`` is ``PUSH`` (a payload follows) or ``DONE`` (the worker leaves; no
payload). Push flags: ``EXTRA`` marks an hsp gradient computed while the
worker waited for its round to close; ``HYPER``, that the worker's loop
changed its optimizer's hyperparameters since its last push: it sent them
before the header, as a pickled list (one dict per param group) with tag
``HYPER``, and the gradient is applied with them
(:mod:`hpcps.training.hyper`). ``CHECKED`` and ``NONFINITE`` carry the worker's
verdict on the whole gradient (every value finite as the wire carries it, or
not), so that a gradient is applied by every shard or by none; a push begun
during backward says ``VERDICT`` instead, and after its payload the worker
sends each shard the verdict (tag ``VERDICT``, int64 1 or 0).

*Serial transfers* (hsp): the worker sends the header alone; each shard
answers ``TRANSFER`` to one ready worker at a time, and only then does that
worker send the payload to it, so no two gradients stream into one shard at
once. ``version`` is the shard version the gradient was computed on.
MPI's non-overtaking rule (same source, communicator and tag) keeps a
worker's messages in order, so a ``DONE`` is never seen before that worker's
last push.

Notice (server shard -> worker)::

    tag NOTICE        int64[5]  flags, clock, version, staleness, lr (float64 bits)

``flags`` is a bit set: ``RECEIPT`` (the push with that clock was applied,
at server ``version``, with that ``staleness``, at learning rate ``lr``; or
``DROPPED`` with it, ``lr`` NaN),
``GRANT`` (the worker may start its next iteration), ``BYE`` (answer to
``DONE``; the last notice the shard sends that worker), ``TRANSFER`` (serial
transfers: send the payload of your oldest waiting push now).

Optimizer state (worker -> shard, then its answer; :mod:`hpcps.runtime.optstate`)::

    tag STATE         pickled ("get",) or ("set", the shard's part of a state)
    tag STATE_REPLY   pickled: the shard's state over its slice, or None once it took the new one

RMA window (one per run over the PS communicator; server shards expose
memory, every other rank exposes none)::

    bytes 0..127      int64[16] version, stop flag, newest slot, 0,
                                version in slot 0..3 (words 4-7),
                                reader count of slot 0..3 (words 8-11), 0 x 4
    bytes 128..       float32[shard length]   slot 0: published parameters
    then              float32[shard length]   slots 1, 2 (pinned protocol only)
    (--compress bf16/fp16: the slots are uint16[shard length] holding 16-bit copies, and the
     shard's fp32 master weights follow them, read only by exact pulls)

Two protocols keep a pull from ever mixing two versions
(:mod:`hpcps.transport.window` has the details): ``pinned`` (the default
where the MPI library gives the unified memory model) never locks
exclusively, so a pull needs no server lock (nor, over RDMA, its CPU); readers pin the
slot they copy and the shard writes only unpinned slots; ``locked`` (the
fallback) publishes under an exclusive lock and reads under shared locks.
"""

from __future__ import annotations

import numpy as np

TAG_CLOCK_PING = 31  # clock synchronisation at start-up (hpcps.transport.clocksync), on the PS communicator
TAG_CLOCK_PONG = 32
TAG_PUSH_HEADER = 11
TAG_PUSH_DATA = 12
TAG_NOTICE = 13
TAG_HYPER = 14  # a worker's optimizer hyperparameters, before the push header flagged HYPER
TAG_VERDICT = 17  # int64[1]: 1 finite, 0 not, after a payload whose header said VERDICT
TAG_STATE = 15  # ps.optimizer's state requests, worker -> shard (hpcps.runtime.optstate)
TAG_STATE_REPLY = 16  # their answers, shard -> worker
TAG_SENT_HEAD = 19  # int64[2] (version, stop flag): a shard's sent round, shard -> worker (hpcps.transport.sent)
#: its values, one message per range of the shard's slice, range k with tag TAG_SENT + k (a round released a
#: piece at a time sends its ranges in the order they are stepped, hpcps.runtime.release); at most 1 + MAX_CHUNKS
TAG_SENT = 1000
TAG_SPARE = 18  # int64[3], spare workers' words: shard 0 -> a spare, shard 0 -> the shards (hpcps.runtime.spares)

#: each tag's name, for reports (a stall's: what MPI holds unmatched from a silent worker)
TAG_NAMES = {TAG_PUSH_HEADER: "a push header", TAG_PUSH_DATA: "a push payload", TAG_NOTICE: "a notice",
             TAG_HYPER: "hyperparameters", TAG_VERDICT: "a verdict", TAG_STATE: "an optimizer state request",
             TAG_STATE_REPLY: "an optimizer state reply", TAG_SENT_HEAD: "a sent round's header",
             TAG_SENT: "a sent round's values", TAG_SPARE: "a spare's word"}

HEADER_LEN = 6
KIND_PUSH = 1
KIND_DONE = 2

NOTICE_LEN = 5
RECEIPT = 1
GRANT = 2
BYE = 4
DROPPED = 8
TRANSFER = 16

EXTRA = 1  # push flags (header field 5)
SKIP = 2  # the worker skipped this step (a GradScaler found Inf/NaN): count it, never apply it
HYPER = 4  # new hyperparameters came before this header (tag HYPER): apply the gradient with them
# the worker's verdict on the whole gradient (it holds all of it; a shard sees its slice only), so that a
# gradient is applied by every shard or by none:
CHECKED = 8  # every value is finite (as the wire carries it): the shards need not scan it
NONFINITE = 16  # some value is not: every shard drops it
VERDICT = 32  # pushed during backward, before the worker could know: the verdict follows the payload (tag VERDICT)

WINDOW_HEADER_BYTES = 128
WIN_MAX_SLOTS = 4
WIN_VERSION = 0  # newest published version
WIN_STOP = 1
#: the stop word's values, raised only (MAX): a stop asked for under a paradigm of rounds waits for the shard's
#: next publish (STOP_PENDING), so that every worker sees it at the same round; readers stop at STOP_RAISED
STOP_PENDING = 1
STOP_RAISED = 2
WIN_NEWEST = 2  # pinned: the slot that holds the newest complete publish
WIN_SLOT_VERSION = 4  # pinned: the version in slot k is word 4 + k
WIN_PINS = 8  # pinned: readers copying slot k (word 8 + k); hpcps.transport.window.CLAIMED while the shard writes it


def encode_header(buf: np.ndarray, kind: int, worker: int, clock: int, version: int, lr: float,
                  flags: int = 0) -> None:
    """Fill one push header in place (``buf`` is int64[HEADER_LEN])."""
    buf[0] = kind
    buf[1] = worker
    buf[2] = clock
    buf[3] = version
    buf[4:5].view(np.float64)[0] = lr
    buf[5] = flags


def decode_lr(buf: np.ndarray) -> float:
    return float(buf[4:5].view(np.float64)[0])
