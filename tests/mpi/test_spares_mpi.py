"""Spare workers' words (hpcps.runtime.spares) between two shards and two spares, without a death: what shard 0
decides, what the other shard takes in and when, what each spare is told."""

import pytest
from mpi4py import MPI

from hpcps.runtime.spares import JoinEvent, SpareDesk, wait_for_place
from hpcps.transport.poll import Backoff, wait_until

pytestmark = pytest.mark.mpi(min_size=5)


@pytest.mark.timeout(60)
def test_shard_0_hands_a_spare_the_dead_workers_place_and_the_other_shard_takes_it_once_it_found_the_death(world):
    """Shards at ranks 0 and 1, spares at 2 and 3. Shard 0 finds worker 1 dead after 5 gradients (of 10) and
    worker 3 dead after all 10: rank 2 is told to take worker 1's place at clock 5, nobody worker 3's. Shard 1
    hears of the join before it has found worker 1 dead itself: it takes the join only once it has (at its
    own clock of worker 1), and it waits for shard 0's last word before it may end, having found worker 3
    dead too. The idle spare, rank 3, is released when shard 0 closes."""
    comm = world.Dup()
    rank, seen = comm.rank, {}
    if rank in (0, 1):
        desk = SpareDesk(comm, shard=rank, shards=[0, 1], spares=[2, 3], rounds=10)
        if rank == 0:
            desk.died(1, 5, 3)
            desk.died(3, 10, 5)
            seen["joins"] = desk.poll(lambda w: True, [0] * 4)
            seen["pending"] = desk.pending()
        else:
            desk.died(3, 10, 5)
            found: set[int] = set()
            joins: list[JoinEvent] = []
            # the word comes first: kept while worker 1 is not found dead here
            wait_until(lambda: desk.poll(found.__contains__, [0, 7, 0, 0]) or bool(desk.words), Backoff())
            seen["kept"] = [w.tolist() for w in desk.words]
            found.add(1)
            joins += desk.poll(found.__contains__, [0, 7, 0, 0])
            seen["joins"] = joins
            seen["pending_before_closing"] = desk.pending()  # worker 3's death: shard 0 may still send a spare
        comm.Barrier()  # shard 1 has its join before shard 0 closes
        if rank == 0:
            desk.close(Backoff())
        else:
            wait_until(lambda: (desk.poll(found.__contains__, [0, 7, 0, 0]), not desk.pending())[1], Backoff())
            seen["pending_after_closing"] = desk.pending()
            desk.close(Backoff())
    elif rank in (2, 3):
        comm.Barrier()
        seen["place"] = wait_for_place(comm, 0)
    else:
        comm.Barrier()
    every = comm.allgather(seen)
    comm.Free()
    assert every[0] == {"joins": [JoinEvent(1, 2, 5)], "pending": False}
    assert every[1] == {"kept": [[3, 1, 2]], "joins": [JoinEvent(1, 2, 7)], "pending_before_closing": True,
                        "pending_after_closing": False}
    assert every[2] == {"place": (1, 5)} and every[3] == {"place": None}
