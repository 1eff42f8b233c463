"""The grace after a stop signal (hpcps.transport.poll): 30 s, or the site's own from HPCPS_SIGNAL_GRACE."""

import time

import pytest

from hpcps.transport import poll


def test_the_grace_is_30_s_unless_the_environment_gives_seconds_above_zero(capsys):
    assert poll.signal_grace({}) == poll.DEFAULT_SIGNAL_GRACE == 30.0
    assert poll.signal_grace({"HPCPS_SIGNAL_GRACE": "90"}) == 90.0
    assert poll.signal_grace({"HPCPS_SIGNAL_GRACE": "2.5"}) == 2.5
    assert capsys.readouterr().err == ""
    for bad in ("0", "-5", "soon", "nan", "inf", ""):
        assert poll.signal_grace({"HPCPS_SIGNAL_GRACE": bad}) == 30.0
        assert f"HPCPS_SIGNAL_GRACE={bad!r} is no number of seconds above 0" in capsys.readouterr().err


def test_a_bad_grace_is_said_once_for_the_job_by_the_launchers_rank_0_not_by_every_rank(capsys):
    for rank_var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        assert poll.signal_grace({"HPCPS_SIGNAL_GRACE": "soon", rank_var: "3"}) == 30.0
        assert capsys.readouterr().err == ""
        assert poll.signal_grace({"HPCPS_SIGNAL_GRACE": "soon", rank_var: "0"}) == 30.0
        assert "HPCPS_SIGNAL_GRACE='soon'" in capsys.readouterr().err


class _Ended(Exception):
    pass


def test_a_watched_wait_ends_the_job_once_the_grace_has_passed_since_the_signal_not_before(monkeypatch):
    monkeypatch.setattr(poll, "SIGNAL_GRACE", 4.0)
    monkeypatch.setattr(poll, "_signalled", [("SIGTERM", time.monotonic() - 3.0)])  # 3 s ago
    watch = poll.StallWatch(warn=1e9, abort=None, describe=lambda: "rank 1 waiting", log=None, error=_Ended)
    watch(10.0)  # the wait is long, but the signal came 3 s ago: within the grace
    monkeypatch.setattr(poll, "_signalled", [("SIGTERM", time.monotonic() - 5.0)])
    watch(3.0)  # 5 s since the signal, but this wait began 3 s ago
    with pytest.raises(_Ended, match=r"SIGTERM received 5 s ago, and rank 1 waiting for 5 s: the step under way "
                                     r"will not end; ending the job \(HPCPS_SIGNAL_GRACE 4 s\)"):
        watch(5.0)
