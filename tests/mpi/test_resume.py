"""Every paradigm stops cleanly on SIGUSR1 and resumes from the checkpoint it wrote, losing nothing."""

import numpy as np
import pytest

from mpitest import share, train
from hpcps.runtime.checkpoints.files import read_checkpoint, read_policy_state

pytestmark = pytest.mark.mpi(min_size=5)

STEPS = 60


@pytest.mark.timeout(120)
@pytest.mark.parametrize("paradigm", ["asp", "dssp", "eager", "ssp", "bsp", "hsp", "grouped"])
def test_a_signalled_run_checkpoints_and_its_resumed_run_loses_nothing(world, mpi_tmp_path, paradigm):
    """Worker rank 4 gets SIGUSR1 at its step 10 (``--fault usr1@4:10``): every rank stops, every pushed
    gradient is applied (or dropped, and counted), and the run resumed from the checkpoint pushes exactly
    the rest: pushed = applied + dropped over both runs, and each worker's steps add up to STEPS."""
    ckdir = mpi_tmp_path / f"ck-{paradigm}"
    # every update at --lr (--lr-scaling none): 60 steps are enough to train under every paradigm
    common = dict(paradigm=paradigm, steps=STEPS, seed=3, compute_time=0.002, lr_scaling="none",
                  **({"groups": 2} if paradigm == "grouped" else {}))
    first, t1 = train(mpi_tmp_path / f"first-{paradigm}.h5", fault=["usr1@4:10"], checkpoint_dir=str(ckdir),
                      **common)
    path = world.bcast(first.summary["checkpoint"] if world.rank == 0 else None, root=0)
    second, t2 = train(mpi_tmp_path / f"second-{paradigm}.h5", resume=path, **common)
    facts = None
    if world.rank == 0:
        ckpt = read_checkpoint(path)
        s1, s2 = t1["summary"], t2["summary"]
        it1, it2 = t1["workers/iterations"], t2["workers/iterations"]
        workers = sorted(set(it1["rank"].tolist()) | set(it2["rank"].tolist()))
        facts = {
            "stopped_by": (s1["stopped_by"], s2["stopped_by"]),
            "first_pushed": int(s1["gradients_pushed"]),
            "lost": [int(s["gradients_pushed"] - s["gradients_applied"] - s["gradients_dropped"]) for s in (s1, s2)],
            "total_pushed": int(s1["gradients_pushed"] + s2["gradients_pushed"]),
            "clocks": ckpt.worker_clocks.tolist(),
            "pushed_per_worker": [int((it1["rank"] == w).sum()) for w in workers],
            "steps_per_worker": [int((it1["rank"] == w).sum() + (it2["rank"] == w).sum()) for w in workers],
            "second_starts": [int(it2["step"][it2["rank"] == w].min()) if (it2["rank"] == w).any() else STEPS
                              for w in workers],
            "resumed_version": int(t2["attrs"]["start_version"]),
            "ckpt_version": ckpt.version,
            "accuracy": float(s2["final_accuracy"]),
            "stale": int(it2["staleness"].max()),
            "policy": read_policy_state(path, 0),
        }
    facts = share(world, facts)
    n_workers = len(facts["clocks"])
    assert facts["stopped_by"] == ("SIGUSR1", "")
    assert facts["first_pushed"] < n_workers * STEPS  # the signal really cut the first run short
    assert facts["lost"] == [0, 0]  # every pushed gradient was applied or dropped, in both runs
    assert facts["total_pushed"] == n_workers * STEPS
    assert facts["clocks"] == facts["pushed_per_worker"]  # the checkpoint knows where each worker left off
    assert facts["steps_per_worker"] == [STEPS] * n_workers
    assert facts["second_starts"] == facts["clocks"]  # ... and each resumed there, not at 0
    assert facts["resumed_version"] == facts["ckpt_version"] > 0
    assert facts["accuracy"] > 0.5  # 10 classes; the resumed run goes on training the same model
    # the resumed shards are at the checkpoint's version from their first publish, so the resumed gradients'
    # staleness keeps the paradigm's bound: 0 for bsp; for ssp (s=2) and dssp (s_hi=6) each of the 3 other
    # workers can push at most 2s+1 gradients while one is computed (it was 145-147 with version 0)
    bound = {"bsp": 0, "ssp": 3 * (2 * 2 + 1), "dssp": 3 * (2 * 6 + 1)}.get(paradigm)
    if bound is not None:
        assert facts["stale"] <= bound
    # the shard's paradigm state is in the checkpoint: ssp's and dssp's clocks are where the workers stopped
    if paradigm in ("ssp", "dssp"):
        assert facts["policy"]["clocks"] == facts["clocks"]
    if paradigm == "dssp":
        assert len(facts["policy"]["bound"]) == n_workers



@pytest.mark.timeout(120)
@pytest.mark.parametrize("paradigm", ["asp", "ssp", "eager"])
def test_a_periodic_checkpoint_is_a_consistent_cut_and_resumes_with_the_accounting_exact(world, mpi_tmp_path,
                                                                                       paradigm):
    """2 shards, a checkpoint every 25 versions of shard 0 while the run goes on: in each, every shard has
    applied exactly the cut's gradients (its version is the sum of the workers' clocks), and the run
    resumed from the first pushes exactly the rest (the cut's clocks plus its pushes make every worker's
    steps), with nothing lost in it. Killing the first run after that checkpoint would change nothing: the
    resumed run reads only the checkpoint (the CLI test kills one with SIGKILL)."""
    from hpcps.runtime.checkpoints.files import read_checkpoint

    steps, ckdir = 40, mpi_tmp_path / f"periodic-{paradigm}"
    common = dict(paradigm=paradigm, steps=steps, servers=2, seed=2, compute_time=0.002, slowdown=["3=2"],
                  checkpoint_every=25, checkpoint_dir=str(ckdir))
    train(mpi_tmp_path / f"periodic-{paradigm}.h5", **common)
    facts = None
    if world.rank == 0:
        paths = sorted(p for p in ckdir.iterdir() if p.suffix == ".h5")
        cuts = [read_checkpoint(str(p)) for p in paths]
        facts = {"n": len(paths), "first": str(paths[0]),
                 "consistent": [c.shard_versions.tolist() == [int(c.worker_clocks.sum())] * 2 for c in cuts],
                 "clocks": cuts[0].worker_clocks.tolist()}
    facts = share(world, facts)
    assert facts["n"] >= 2 and all(facts["consistent"])  # 3 workers x 40 = 120 gradients: cuts near 25, 50, ...
    _resumed_pushes_the_rest(world, mpi_tmp_path / f"periodic-resumed-{paradigm}.h5", facts["first"],
                             facts["clocks"], **{**common, "checkpoint_dir": str(ckdir / "again")})


@pytest.mark.timeout(120)
def test_a_checkpoint_carries_the_untrained_loss_and_the_run_resumed_from_it_compares_with_it(world, mpi_tmp_path):
    """bsp, a checkpoint every 20 rounds: the last one (round 60) carries the run's start, the mean of each
    worker's first loss in its file, where the divergence watch of a run resumed from it looks (hpcps.training.
    divergence). The resumed run's own first losses are a trained model's, below it; its own checkpoint
    (round 80) carries the first run's start again, not them: three times a trained loss is noise."""
    common = dict(paradigm="bsp", seed=4, compute_time=0.01, checkpoint_every=20)
    first, t1 = train(mpi_tmp_path / "first.h5", steps=60, checkpoint_dir=str(mpi_tmp_path / "ck1"), **common)
    last = share(world, str(mpi_tmp_path / "ck1" / "step-000060.h5"))
    _, t2 = train(mpi_tmp_path / "second.h5", steps=80, resume=last, checkpoint_dir=str(mpi_tmp_path / "ck2"), **common)
    facts = None
    if world.rank == 0:
        def starts(it):
            return float(np.mean([it["loss"][it["rank"] == r][0] for r in sorted(set(it["rank"].tolist()))]))

        facts = {"untrained": starts(t1["workers/iterations"]), "resumed_own": starts(t2["workers/iterations"]),
                 "carried": read_checkpoint(last).config.get("loss_start"),
                 "again": read_checkpoint(str(mpi_tmp_path / "ck2" / "step-000080.h5")).config.get("loss_start"),
                 "stopped": t2["summary"]["stopped_by"]}
    facts = share(world, facts)
    assert facts["carried"] == pytest.approx(facts["untrained"], rel=1e-12)
    assert facts["again"] == facts["carried"] and facts["resumed_own"] < 0.8 * facts["untrained"]
    assert facts["stopped"] == ""


def _resumed_pushes_the_rest(world, out, checkpoint: str, clocks: list[int], **options) -> None:
    """The run resumed from a periodic ``checkpoint`` (workers ranks 2-4 at ``clocks`` in its cut) loses
    nothing and pushes exactly the rest, each worker from its clock in the cut."""
    _, t = train(out, resume=checkpoint, **options)
    facts = None
    if world.rank == 0:
        it, s = t["workers/iterations"], t["summary"]
        facts = {"pushed": int(s["gradients_pushed"]), "lost": int(s["gradients_pushed"] - s["gradients_applied"]
                                                                   - s["gradients_dropped"]),
                 "starts": [int(it["step"][it["rank"] == r].min()) for r in (2, 3, 4)]}
    facts = share(world, facts)
    assert facts["lost"] == 0
    assert facts["pushed"] + sum(clocks) == 3 * options["steps"]
    assert facts["starts"] == clocks  # each worker resumed at its clock in the cut


@pytest.mark.timeout(120)
def test_grouped_checkpoints_periodically_and_resumes_with_the_accounting_exact(world, mpi_tmp_path):
    """grouped (1 central shard, 2 group servers of one worker each): a cut every 10 central versions, taken
    on the central shard with the group servers as its clients; each worker's clock in it is its group's
    rounds, so the central version is their sum, and the run resumed from the first pushes exactly the rest."""
    from hpcps.runtime.checkpoints.files import read_checkpoint

    steps, ckdir = 40, mpi_tmp_path / "periodic-grouped"
    common = dict(paradigm="grouped", groups=2, steps=steps, seed=2, compute_time=0.002, slowdown=["4=2"],
                  checkpoint_every=10, checkpoint_dir=str(ckdir))
    train(mpi_tmp_path / "periodic-grouped.h5", **common)
    facts = None
    if world.rank == 0:
        cuts = [read_checkpoint(str(p)) for p in sorted(ckdir.glob("step-*.h5"))]
        facts = {"n": len(cuts), "first": str(sorted(ckdir.glob("step-*.h5"))[0]),
                 "consistent": [c.version == int(c.worker_clocks.sum()) for c in cuts],
                 "clocks": cuts[0].worker_clocks.tolist()}
    facts = share(world, facts)
    assert facts["n"] >= 3 and all(facts["consistent"])
    _, t = train(mpi_tmp_path / "periodic-grouped-resumed.h5", resume=facts["first"],
                 **{**common, "checkpoint_dir": str(ckdir / "again")})
    facts2 = None
    if world.rank == 0:
        s = t["summary"]
        facts2 = {"pushed": int(s["gradients_pushed"]),
                  "lost": int(s["gradients_pushed"] - s["gradients_applied"] - s["gradients_dropped"])}
    facts2 = share(world, facts2)
    assert facts2["lost"] == 0 and facts2["pushed"] + sum(facts["clocks"]) == 2 * steps


@pytest.mark.timeout(120)
def test_hsp_checkpoints_periodically_between_rounds_and_resumes_with_the_accounting_exact(world, mpi_tmp_path):
    """hsp on 2 shards, extras from the fast workers while rank 4 (3x slower) finishes each round: a cut
    every 10 versions of shard 0. Each cut falls at a round's close: every worker's last gradient in it
    belongs to one update, the same on both shards; on each shard the gradients applied below its version
    are exactly the cut's (extras included, some of them alone); and the run resumed from the first
    pushes exactly the rest, each worker from its clock in the cut."""
    from hpcps.runtime.checkpoints.files import read_checkpoint

    steps, ckdir = 30, mpi_tmp_path / "periodic-hsp"
    common = dict(paradigm="hsp", hsp_max_stale=2, steps=steps, servers=2, seed=2, compute_time=0.002,
                  slowdown=["4=3"], checkpoint_every=10, checkpoint_dir=str(ckdir))
    _, t = train(mpi_tmp_path / "periodic-hsp.h5", **common)
    facts = None
    if world.rank == 0:
        up = t["servers/updates"]
        cuts = [read_checkpoint(str(p)) for p in sorted(ckdir.glob("step-*.h5"))]
        checks = []
        for c in cuts:
            clocks = dict(zip((2, 3, 4), c.worker_clocks.tolist()))
            for shard in (0, 1):
                mine = up[up["shard"] == shard]
                below = mine[mine["version"] < c.shard_version(shard)]
                in_cut = sorted((int(r["worker"]), int(r["worker_clock"])) for r in below)
                last = {int(mine["version"][(mine["worker"] == w) & (mine["worker_clock"] == k)][0])
                        for w, k in clocks.items()}
                checks.append({
                    "exact": in_cut == sorted((w, k) for w, n in clocks.items() for k in range(1, n + 1)),
                    "one_update_each": len(set(below["version"].tolist())) == c.shard_version(shard),
                    "between_rounds": len(last) == 1,
                    "extras": int((np.unique(below["version"], return_counts=True)[1] == 1).sum()),
                })
        facts = {"n": len(cuts), "checks": checks, "first": str(sorted(ckdir.glob("step-*.h5"))[0]),
                 "clocks": cuts[0].worker_clocks.tolist() if cuts else []}
    facts = share(world, facts)
    assert facts["n"] >= 2
    assert all(c["exact"] and c["one_update_each"] and c["between_rounds"] for c in facts["checks"]), facts
    assert max(c["extras"] for c in facts["checks"]) > 0  # the cuts hold extras applied alone, not only rounds
    _resumed_pushes_the_rest(world, mpi_tmp_path / "periodic-hsp-resumed.h5", facts["first"], facts["clocks"],
                             **{**common, "checkpoint_dir": str(ckdir / "again")})
