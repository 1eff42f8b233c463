"""Run-through's mechanism without a failure: when ULFM is on, and what counts as a rank's death."""

import pytest
from mpi4py import MPI

from hpcps.transport.failures import DeadRanks, failed_on, is_failure, retried, ulfm_enabled


def test_run_through_is_open_mpis_launched_with_ulfm_only():
    ompi = "Open MPI v5.0.11, package: Open MPI ..."
    assert ulfm_enabled(ompi, {"OMPI_MCA_mpi_ft_enable": "1"})
    assert ulfm_enabled(ompi, {"OMPI_MCA_mpi_ft_enable": "true"})
    assert not ulfm_enabled(ompi, {})  # mpirun without --with-ft ulfm
    assert not ulfm_enabled(ompi, {"OMPI_MCA_mpi_ft_enable": "0"})
    assert not ulfm_enabled("MPICH Version: 4.3.0", {"OMPI_MCA_mpi_ft_enable": "1"})  # fallbacks, not ULFM


def test_only_a_dead_rank_counts_as_one():
    assert is_failure(MPI.Exception(MPI.ERR_PROC_FAILED))
    assert is_failure(MPI.Exception(MPI.ERR_PROC_FAILED_PENDING))
    assert is_failure(MPI.Exception(MPI.ERR_REVOKED))
    assert not is_failure(MPI.Exception(MPI.ERR_TRUNCATE))
    assert not is_failure(ValueError("x"))


class Comm:
    """What :func:`failed_on` asks of a communicator: whether it is revoked, and the ranks it knows dead."""

    def __init__(self, revoked: bool = False, failed: int = 0) -> None:
        self.revoked, self.failed, self.freed = revoked, failed, 0

    def Is_revoked(self) -> bool:
        return self.revoked

    def Get_failed(self):
        comm = self

        class Group:
            def Get_size(self) -> int:
                return comm.failed

            def Free(self) -> None:
                comm.freed += 1
        return Group()


def test_a_collective_error_of_no_class_is_a_death_only_where_the_communicator_knows_of_one():
    """Open MPI's Iallreduce under ULFM reported a peer's death as MPI_ERR_OTHER once in 35 runs (libnbc's
    aborted schedule; CI's Open MPI stage): it counts as a death where the communicator is revoked or
    holds a rank known dead, and as the error it is otherwise."""
    other = MPI.Exception(MPI.ERR_OTHER)
    assert failed_on(other, Comm(revoked=True))
    known = Comm(failed=1)
    assert failed_on(other, known) and known.freed == 1
    assert not failed_on(other, Comm())  # nothing dead, nothing revoked: a real error
    assert not failed_on(MPI.Exception(MPI.ERR_TRUNCATE), Comm(revoked=True))  # a class of its own: not a death
    assert failed_on(MPI.Exception(MPI.ERR_PROC_FAILED), Comm())  # the classes that say so, as is_failure
    assert not failed_on(ValueError("x"), Comm(revoked=True))
    assert not failed_on(other, MPI.COMM_SELF)  # a real communicator: nothing revoked, none dead


def status(error: int) -> MPI.Status:
    s = MPI.Status()
    s.Set_error(error)
    return s


def test_a_death_in_a_status_of_testall_counts_as_one():
    """Testall and Testsome raise MPI_ERR_IN_STATUS, the death in the status of the request that failed (a
    worker's payload, its sender killed mid-transfer: CI's Open MPI stage): a death only where a status says."""
    in_status = MPI.Exception(MPI.ERR_IN_STATUS)
    assert is_failure(in_status, [status(MPI.SUCCESS), status(MPI.ERR_PROC_FAILED)])
    assert is_failure(in_status, [status(MPI.ERR_PENDING), status(MPI.ERR_PROC_FAILED)])
    assert not is_failure(in_status, [status(MPI.SUCCESS), status(MPI.ERR_TRUNCATE)])
    assert not is_failure(in_status)  # no statuses: nothing says a rank died
    with pytest.raises(MPI.Exception):
        DeadRanks([MPI.COMM_SELF]).found(in_status, [status(MPI.ERR_TRUNCATE)])


def test_any_other_error_goes_on_up_unchanged():
    dead = DeadRanks([MPI.COMM_SELF])
    error = MPI.Exception(MPI.ERR_TRUNCATE)
    with pytest.raises(MPI.Exception) as raised:
        dead.found(error)
    assert raised.value is error and dead.dead == set()

    def fails():
        raise error
    with pytest.raises(MPI.Exception):
        retried(dead, fails)
    with pytest.raises(MPI.Exception):
        retried(None, lambda: retried(None, fails))  # without run-through nothing is caught
    assert retried(dead, lambda: 7) == 7
