"""--respawn's pure parts (hpcps.runtime.respawn): a shard's answer to a death, and the options of the part
that resumes. The whole path (a death, the spawn, the resumed run) is tests/cli/test_runthrough.py's."""

from types import SimpleNamespace

from hpcps.options.config import make_config
from hpcps.runtime.respawn import STOPPED_BY, DeathStop, resumed


def test_a_death_raises_the_stop_once_and_names_the_respawn_unless_a_signal_came_first():
    stops, signals = [], SimpleNamespace(acted=None)
    desk = DeathStop(shard=0, stop=lambda: stops.append(1), signals=signals, rounds=60)
    desk.died(2, 15, 3)
    assert signals.acted == STOPPED_BY and stops == [1]
    desk.died(1, 20, 2)  # a second death before the stop took effect: the same stop
    assert signals.acted == STOPPED_BY and len(stops) == 2
    assert desk.poll(lambda w: True, [0] * 4) == [] and not desk.pending()
    signalled = SimpleNamespace(acted="SIGTERM")
    DeathStop(shard=0, stop=lambda: None, signals=signalled, rounds=60).died(2, 15, 3)
    assert signalled.acted == "SIGTERM"  # the user's stop wins: no respawn after it


def test_a_worker_that_had_pushed_all_its_gradients_stops_nothing():
    stops, signals = [], SimpleNamespace(acted=None)
    DeathStop(shard=0, stop=lambda: stops.append(1), signals=signals, rounds=60).died(2, 60, 3)
    assert stops == [] and signals.acted is None


def test_a_resumed_part_starts_from_the_checkpoint_on_its_shards_with_no_fault_and_a_file_of_its_own(tmp_path):
    cfg = make_config(dict(paradigm="ssp", respawn=True, fault=["kill@3:15"], out=str(tmp_path / "run.h5")))
    part = resumed(cfg, str(tmp_path / "run-checkpoints" / "step-000069.h5"), 2, 1, cfg.out)
    assert part.resume.endswith("step-000069.h5") and part.servers == 2 and part.fault == []
    assert part.out == str(tmp_path / "run-respawn1.h5")
    assert part.checkpoint_dir == str(tmp_path / "run-checkpoints")  # where the first part's went
    assert part.respawn and resumed(part, part.resume, 2, 2, cfg.out).out == str(tmp_path / "run-respawn2.h5")
