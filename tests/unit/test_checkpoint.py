"""Checkpoint files: round trip, atomic write, and clear errors when one does not fit (no MPI)."""

import dataclasses

import numpy as np
import pytest

from hpcps.runtime.checkpoints.files import check_compatible, checkpoint_path, read_checkpoint, write_checkpoint
from hpcps.options.config import make_config
from hpcps.errors import UserError


def _write(tmp_path, **config):
    cfg = make_config({"paradigm": "bsp", **config}).as_json_dict()
    path = checkpoint_path(str(tmp_path / "ck"), 20)
    return write_checkpoint(path, np.arange(6, dtype=np.float32), version=20, worker_clocks=[20] * 4,
                            config=cfg, n_servers=1)


def test_round_trip_and_atomic_write(tmp_path):
    path = _write(tmp_path)
    assert path.endswith("ck/step-000020.h5")
    ck = read_checkpoint(path)
    assert ck.version == 20 and list(ck.worker_clocks) == [20] * 4 and ck.config["paradigm"] == "bsp"
    assert np.array_equal(ck.params, np.arange(6, dtype=np.float32))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-000020.h5"]  # no .tmp left


def test_a_checkpoint_that_does_not_fit_names_every_mismatch(tmp_path):
    ck = read_checkpoint(_write(tmp_path, lr=0.1))
    here = make_config({"paradigm": "bsp", "lr": 0.2}).as_json_dict()
    with pytest.raises(UserError, match=r"does not fit this run: lr is 0.2 here but 0.1 in the checkpoint; "
                                        r"the model has 7 parameters, the checkpoint 6$"):
        check_compatible(ck, "x.h5", here, n_params=7)
    # another worker or shard count is no mismatch: the checkpoint resumes on another shape (reshaped)
    check_compatible(ck, "x.h5", make_config({"paradigm": "bsp", "servers": 3}).as_json_dict(), n_params=6)


def test_a_checkpoint_of_other_local_steps_is_refused_and_a_presets_default_spelled_out_is_not(tmp_path):
    """A worker's clock counts outer rounds under --local-steps: resumed with another H it would start at
    another batch. diloco's default H (8) given explicitly is the same H."""
    ck = read_checkpoint(_write(tmp_path, paradigm="diloco"))
    check_compatible(ck, "x.h5", make_config({"paradigm": "diloco", "local_steps": 8}).as_json_dict(), n_params=6)
    with pytest.raises(UserError, match=r"local steps per round are 4 here but 8 in the checkpoint"):
        check_compatible(ck, "x.h5", make_config({"paradigm": "diloco", "local_steps": 4}).as_json_dict(),
                         n_params=6)
    plain = read_checkpoint(_write(tmp_path / "b", paradigm="bsp"))
    with pytest.raises(UserError, match=r"local steps per round are 2 here but none in the checkpoint"):
        check_compatible(plain, "x.h5", make_config({"paradigm": "bsp", "local_steps": 2}).as_json_dict(),
                         n_params=6)


def test_a_checkpoint_takes_the_shape_of_the_run_that_resumes_it(tmp_path):
    from hpcps.runtime.checkpoints.files import reshaped

    ck = read_checkpoint(_write(tmp_path, lr=0.1))  # 4 workers at 20, 1 shard
    assert reshaped(ck, n_servers=1, n_workers=4) is ck
    other = reshaped(ck, n_servers=3, n_workers=2)
    assert other.n_servers == 3 and other.shard_versions.tolist() == [20] * 3 and other.written_servers == 1
    assert other.worker_clocks.tolist() == [20, 20] and other.written_clocks.tolist() == [20] * 4
    assert other.describe_shape() == "1 shard(s) -> 3; 4 worker(s) at clocks [20, 20, 20, 20] -> 2 at clock 20"


def test_a_checkpoint_whose_shards_were_cut_off_the_grid_is_cut_again_and_one_on_it_is_not(tmp_path):
    """Checkpoints record the grid their shards' cuts were aligned to (hpcps.cluster.slices.ALIGN); one
    written before it records none, and its several shards' optimizer state is cut again from where their
    slices fell (align 1), never read as if the pieces were today's."""
    from hpcps.cluster.slices import ALIGN
    from hpcps.runtime.checkpoints.files import SLICE_ALIGN, reshaped

    cfg = make_config({"paradigm": "bsp", "servers": 2, "partition_mb": 0}).as_json_dict()
    for name, extra, resliced in [("old", {}, True), ("new", {SLICE_ALIGN: ALIGN}, False)]:
        path = write_checkpoint(checkpoint_path(str(tmp_path / name), 20), np.arange(6, dtype=np.float32),
                                version=20, worker_clocks=[20] * 3, config={**cfg, **extra}, n_servers=2)
        ck = read_checkpoint(path)
        same = reshaped(ck, n_servers=2, n_workers=3)
        assert same.resharded == resliced and (same is ck) == (not resliced)
        if resliced:
            assert same.written_align == 1 and same.written_servers == 2
            assert same.describe_shape() == ("the shards' slices cut again (written by an hpcps that cut them "
                                             "elsewhere)")
    assert not reshaped(read_checkpoint(_write(tmp_path / "one")), n_servers=1, n_workers=4).resharded  # 1 shard
    # an old checkpoint dealt in another stripe (--partition-mb) too: the line names both reasons
    striped = make_config({"paradigm": "bsp", "servers": 2, "partition_mb": 0.25}).as_json_dict()
    path = write_checkpoint(checkpoint_path(str(tmp_path / "striped"), 20), np.arange(6, dtype=np.float32),
                            version=20, worker_clocks=[20] * 3, config=striped, n_servers=2)
    both = reshaped(read_checkpoint(path), n_servers=2, n_workers=3)
    assert both.describe_shape() == ("the shards' slices dealt again (--partition-mb) and cut again (written by an "
                                     "hpcps that cut them elsewhere)")
    on_grid = reshaped(read_checkpoint(write_checkpoint(
        checkpoint_path(str(tmp_path / "striped-new"), 20), np.arange(6, dtype=np.float32), version=20,
        worker_clocks=[20] * 3, config={**striped, SLICE_ALIGN: ALIGN}, n_servers=2)), n_servers=2, n_workers=3)
    assert on_grid.describe_shape() == "the shards' slices dealt again (--partition-mb)"


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(UserError, match=r"--resume .*nope.h5: no such file"):
        read_checkpoint(str(tmp_path / "nope.h5"))
    junk = tmp_path / "junk.h5"
    junk.write_text("x")
    with pytest.raises(UserError, match=r"not an hpcps checkpoint"):
        read_checkpoint(str(junk))


def test_another_paradigms_checkpoint_fits_a_leg_only_and_its_versions_count_the_same_steps(tmp_path):
    """A user's --resume of another paradigm's checkpoint is refused; --paradigm auto's legs go on from one.
    bsp's version 20 is 20 rounds of the 4 workers' steps; asp applies each of the 4 gradients of a step
    as an update, so asp goes on at 80 (and back), every shard alike; the worker clocks are kept."""
    from hpcps.runtime.checkpoints.files import for_paradigm

    ck = read_checkpoint(_write(tmp_path))  # bsp: 4 workers at 20, version 20
    asp = make_config({"paradigm": "asp"}).as_json_dict()
    with pytest.raises(UserError, match=r"paradigm is 'asp' here but 'bsp' in the checkpoint"):
        check_compatible(ck, "x.h5", asp, n_params=6)
    check_compatible(ck, "x.h5", asp, n_params=6, any_paradigm=True)
    mapped = for_paradigm(ck, written_per_step=1, per_step=4)
    assert mapped.version == 80 and mapped.written_paradigm == "bsp" and mapped.worker_clocks.tolist() == [20] * 4
    # a round's mean against single gradients: the optimizer's statistics were of another batch
    assert mapped.optimizer_afresh
    assert mapped.describe_shape() == ("written by bsp, its versions counted in this paradigm's updates; the "
                                       "optimizer's state left behind (it was of updates from another batch "
                                       "of gradients)")
    assert not for_paradigm(ck, written_per_step=4, per_step=4).optimizer_afresh  # asp to ssp: the same updates
    stopped = for_paradigm(dataclasses.replace(mapped, shard_versions=np.array([80, 81])), written_per_step=4,
                           per_step=1)
    assert stopped.version == 20 and stopped.shard_versions.tolist() == [20, 20]
    assert np.array_equal(stopped.params, ck.params)
