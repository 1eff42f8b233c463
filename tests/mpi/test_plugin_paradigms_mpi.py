"""Paradigms of one's own (``--paradigm file.py:Class``): the backup-workers example and a docs-only plug-in
run through the real runtime and keep their closed forms."""

from pathlib import Path

import numpy as np
import pytest

from mpitest import share, train

pytestmark = pytest.mark.mpi(min_size=5)

ROOT = Path(__file__).resolve().parents[2]
BACKUP = f"{ROOT / 'examples' / 'backup_workers.py'}:BackupWorkers"
DROP_STALE = f"{Path(__file__).resolve().parent / 'plugins' / 'drop_stale.py'}:DropStale"
STEPS = 30


def _rounds(t, steps: int = STEPS) -> dict:
    """Rank 0: the run's counts from its file (one shard) of a run of ``steps`` per worker."""
    up, s = t["servers/updates"], t["summary"]
    applied = up[up["applied"] == 1]
    per_version = np.bincount(applied["version"])
    # rounds before any worker's last gradient was decided: every worker was still taking part
    last = up["worker_clock"] == steps
    first_end = int(up["version"][last].min())
    return {"pushed": int(s["gradients_pushed"]), "applied": int(s["gradients_applied"]),
            "dropped": int(s["gradients_dropped"]), "by_paradigm": int((up["reason"] == 3).sum()),
            "full_rounds": sorted(set(per_version[:first_end].tolist())), "most": int(per_version.max()),
            "stale": int(applied["staleness"].max()), "versions": len(per_version),
            "lr_nan_if_dropped": bool(np.isnan(up["lr"][up["applied"] == 0]).all())}


@pytest.mark.timeout(120)
def test_backup_workers_close_every_round_with_n_minus_b_and_drop_the_late(world, mpi_tmp_path):
    """b=1 of 4 workers, worker 4 three times slower: every round applies exactly 3 gradients while all four
    run, none computed on an older version; the straggler's late gradients are dropped by the paradigm,
    counted, and pushed = applied + dropped."""
    _, t = train(mpi_tmp_path / "backup.h5", paradigm=BACKUP, paradigm_option=["backups=1"], steps=STEPS,
                 compute_time=0.01, slowdown=["4=3"], seed=1)
    facts = share(world, _rounds(t) if world.rank == 0 else None)
    assert facts["pushed"] == 4 * STEPS == facts["applied"] + facts["dropped"]
    assert facts["dropped"] == facts["by_paradigm"] > 0 and facts["lr_nan_if_dropped"]
    assert facts["full_rounds"] == [3] and facts["most"] <= 3  # N - b, never more
    assert facts["stale"] == 0  # a round's gradients are all computed on its parameters


@pytest.mark.timeout(120)
def test_backup_workers_with_no_backups_is_bsp_bit_for_bit(world, mpi_tmp_path):
    """b=0: the same rounds as bsp, and the same parameters to the last bit (4 workers)."""
    runs = {}
    for name, options in (("bsp", {"paradigm": "bsp"}),
                          ("b0", {"paradigm": BACKUP, "paradigm_option": ["backups=0"]})):
        result, t = train(mpi_tmp_path / f"{name}.h5", steps=20, seed=5, compute_time=0.002, slowdown=["2=2"],
                          **options)
        if world.rank == 0:
            runs[name] = (result.params, _rounds(t, 20) if name == "b0" else None)
    facts = None
    if world.rank == 0:
        facts = {"equal": bool(np.array_equal(runs["bsp"][0], runs["b0"][0])), **runs["b0"][1]}
    facts = share(world, facts)
    assert facts["dropped"] == 0 and facts["applied"] == 80 and facts["versions"] == 20
    assert facts["equal"]


@pytest.mark.timeout(120)
def test_a_plugin_written_from_the_docs_keeps_its_bound(world, mpi_tmp_path):
    """The docs-only plug-in (asp dropping what is more than 1 version stale), straggler 4x: no applied
    gradient is staler than 1, the straggler's stale ones are dropped and counted, nothing is lost."""
    _, t = train(mpi_tmp_path / "drop.h5", paradigm=DROP_STALE, paradigm_option=["max_stale=1"], steps=STEPS,
                 compute_time=0.005, slowdown=["4=4"], seed=2)
    facts = share(world, _rounds(t) if world.rank == 0 else None)
    assert facts["pushed"] == 4 * STEPS == facts["applied"] + facts["dropped"]
    assert facts["stale"] <= 1 and facts["dropped"] == facts["by_paradigm"] > 0
    assert facts["most"] == 1  # one gradient per update


@pytest.mark.timeout(120)
def test_a_bsp_plugins_own_state_is_in_its_periodic_checkpoint(world, mpi_tmp_path):
    """bsp's periodic checkpoints are taken at a round's close, from the publish hook: a plug-in built on bsp
    that keeps state of its own (the pushes it decided on: 4 workers x 4 rounds at version 4) finds it in
    each checkpoint's part (before, bsp's checkpointer wrote the optimizer's state alone)."""
    from hpcps.runtime.checkpoints.files import read_policy_state

    counting = f"{Path(__file__).resolve().parent / 'plugins' / 'counting_bsp.py'}:CountingBSP"
    ckdir = mpi_tmp_path / "counting-checkpoints"
    train(mpi_tmp_path / "counting.h5", paradigm=counting, steps=8, checkpoint_every=4, checkpoint_dir=str(ckdir))
    facts = share(world, {p.name: read_policy_state(str(p), 0) for p in sorted(ckdir.glob("step-*.h5"))}
                  if world.rank == 0 else None)
    assert facts == {"step-000004.h5": {"pushes": 16}, "step-000008.h5": {"pushes": 32}}, facts
