"""A job's end under ULFM, run by ``test_runthrough.py`` as ``mpirun --with-ft ulfm -n N python ulfm_parting.py
LATE MODE``: rank 0 broadcasts a word, rank r comes to the broadcast ``LATE * r / (N - 1)`` seconds after rank 0
(a spread, since when the end of a rank that left is reported to one still to receive decides), and every rank
then prints what it got and ends without ``MPI_Finalize``, as hpcps's ranks end once a rank died
(:func:`hpcps.transport.failures.end_without_the_dead`). ``MODE`` ``part``: the ranks part ways first
(:func:`hpcps.transport.failures.part_ways`); ``leave``: they do not (``leave`` at ``LATE`` 0.2 failed a
receive in 9 of 16 jobs)."""

import os
import sys
import time

from mpi4py import MPI

from hpcps.transport.failures import part_ways


def main(late: float, mode: str) -> None:
    comm = MPI.COMM_WORLD.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    comm.alltoall(list(range(comm.size)))  # (every pair connected, as in a run that talked before its end)
    time.sleep(late * comm.rank / (comm.size - 1))
    try:
        got = comm.bcast("the word" if comm.rank == 0 else None, root=0)
        if mode == "part":
            part_ways(comm)
        print(f"rank {comm.rank} got {got!r}", flush=True)
    except MPI.Exception as exc:
        print(f"rank {comm.rank} failed: {exc}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2])
