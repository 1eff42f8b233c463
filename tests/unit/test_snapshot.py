"""The periodic checkpoints' protocol on one shard (shard 0 alone, MPI.COMM_SELF), against a stand-in server:
which cut a paradigm takes, when a checkpoint is written, and when it is abandoned."""

from types import SimpleNamespace

import pytest
from mpi4py import MPI

from hpcps.policies import policy_class
from hpcps.runtime.checkpoints.cut import ClockCut, RoundCut, Snapshots


@pytest.mark.parametrize("paradigm,cut", [("bsp", "rounds"), ("hsp", "rounds"), ("asp", "clocks"),
                                          ("ssp", "clocks"), ("dssp", "clocks"), ("eager", "clocks"),
                                          ("grouped", "clocks")])
def test_every_built_in_paradigm_can_be_cut(paradigm, cut):
    assert policy_class(paradigm).periodic_cut() == cut


def test_a_plug_in_that_holds_gradients_its_own_way_cannot():
    from pathlib import Path
    examples = Path(__file__).resolve().parents[2] / "examples"
    assert policy_class(f"{examples}/backup_workers.py:BackupWorkers").periodic_cut() is None


class Inbox:
    def __init__(self):
        self.open, self.round_cut, self.cut = 2, None, None

    def hold_after_regulars(self, n):
        self.round_cut = n

    def hold_after(self, cut):
        self.cut = cut

    def clocks_in_hand(self, clocks):
        return [c + 1 for c in clocks]  # each worker's next push is taken up, not yet handled


def _snapshots(cut, server):
    done = SimpleNamespace(parts=[], main=[], discarded=[])
    snaps = Snapshots(MPI.COMM_SELF, every=10, interval=None, cut=cut,
                      write_part=done.parts.append,
                      write_main=lambda path, clocks, versions: done.main.append((path, clocks, versions)) or path,
                      discard=done.discarded.append, path_for=lambda epoch: f"cut-{epoch}")
    snaps.server = server
    return snaps, done


def test_a_round_cut_waits_for_its_rounds_close_then_writes_the_clocks_there():
    server = SimpleNamespace(inbox=Inbox(), round_sum=SimpleNamespace(closed=3), pending={}, version=10,
                             clocks=[5, 6])
    snaps, done = _snapshots(RoundCut(), server)
    assert snaps.tick()  # version 10 crossed a multiple of 10: pause, in round 3 (3 closed)
    assert snaps.cut == 3 and server.inbox.round_cut == 4  # hold each worker after its 4th round gradient
    assert snaps.state == "draining" and not done.parts
    server.round_sum.closed, server.version, server.clocks = 4, 13, [7, 8]  # round 3 closed, extras applied
    server.pending = {1: "an extra"}
    snaps.tick()
    assert not done.parts  # a gradient still pending: not at the cut yet
    server.pending = {}
    snaps.tick()
    assert done.parts == ["cut-1"] and done.main == [("cut-1", [7, 8], [13])] and not done.discarded
    assert snaps.state == "idle" and server.inbox.round_cut is None and snaps.last_version == 13


def test_a_round_cut_the_run_never_reaches_is_abandoned_and_its_parts_removed():
    server = SimpleNamespace(inbox=Inbox(), round_sum=SimpleNamespace(closed=5), pending={}, version=20,
                             clocks=[9, 9])
    snaps, done = _snapshots(RoundCut(), server)
    snaps.tick()
    assert snaps.cut == 5
    server.inbox.open = 0  # every worker left after round 4: round 5 never comes
    snaps.tick()
    assert snaps.state == "draining"  # the loop may still hand over events: not abandoned yet
    snaps.finish()
    assert done.discarded == ["cut-1"] and not done.main and snaps.state == "idle"


def test_a_clock_cut_holds_the_clocks_in_hand_and_is_reached_there():
    server = SimpleNamespace(inbox=Inbox(), pending={0: "push"}, version=10, clocks=[3, 4])
    snaps, done = _snapshots(ClockCut(), server)
    snaps.tick()
    assert snaps.cut == [4, 5] and server.inbox.cut == [4, 5]
    server.clocks, server.pending, server.version = [4, 5], {}, 12
    snaps.tick()
    assert done.main == [("cut-1", [4, 5], [12])] and server.inbox.cut is None
