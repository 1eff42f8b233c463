"""``--paradigm auto`` on five ranks: trials of each paradigm, then the run as if the user had typed the one
chosen, going on from where the trials left the model."""

from __future__ import annotations

import datetime
import json
import os

import h5py
import numpy as np
import pytest
import torch

import hpcps
from hpcps.errors import UserError
from hpcps.options.config import make_config
from hpcps.runtime.run import run_training
from hpcps.runtime.tune import choose_paradigm

from mpitest import share


@pytest.mark.timeout(120)
def test_with_a_3x_straggler_asp_is_tried_first_and_alone_and_chosen_and_bsp_not_tried(world, mpi_tmp_path):
    """Worker rank 4 three times slower: asp's trial goes first and shows that worker's 30 ms of compute a
    step. bsp's rounds wait for it, so bsp could train at most 4 batches per 30 ms, while asp's other
    three run on (3 per 10 ms and 1 per 30: 2.5x that, where compute is all): bsp is not tried, and its
    reason is kept beside the choice."""
    cfg = make_config({"paradigm": "auto", "paradigms": ["bsp", "asp"], "trial_steps": 12, "compute_time": 0.01,
                       "slowdown": {4: 3.0}, "progress": False, "out": str(mpi_tmp_path / "unused.h5")})
    chosen, choice, start = choose_paradigm(cfg, world, run_training)  # (no folder: trials from the start)
    assert chosen.paradigm == "asp" and start is None
    assert chosen == make_config({"paradigm": "asp", "compute_time": 0.01, "slowdown": {4: 3.0}, "progress": False,
                                  "out": str(mpi_tmp_path / "unused.h5")})  # as if typed, --trial-steps gone
    record = json.loads(choice)
    assert record["chosen"] == "asp" and record["trial_steps"] == 12
    assert [t["paradigm"] for t in record["trials"]] == ["asp"] and list(record["skipped"]) == ["bsp"]
    asp = record["trials"][0]
    # the straggler's compute a step, in closed form (its 30 ms of --compute-time and slowdown, and the model's)
    assert asp["slowest_compute_s"] == pytest.approx(0.03, rel=0.25)
    assert record["skipped"]["bsp"].startswith(f"at most {4 / asp['slowest_compute_s']:.1f} batches/s")
    assert asp["batches_per_s"] * 0.95 > 4 / asp["slowest_compute_s"] and asp["staleness"] > 0
    assert record["predicted"]["batches_per_s"] == asp["batches_per_s"]
    assert asp["workers"] == 4 and not asp["stopped_by"]
    assert record["trials_s"] > 12 * 0.01 * 3  # asp's trial ends with the straggler's 12 steps


def _net():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))


@pytest.mark.timeout(120)
def test_a_run_chosen_from_bsp_alone_goes_on_from_its_trial_and_is_the_bsp_run_bit_for_bit(world, mpi_tmp_path):
    """hpcps.train with a model the script built, a cosine schedule and momentum: the trial trains its first
    8 steps (a copy of the script's model), the run goes on from there with the shards' momentum, and ends
    where a plain bsp run of the same 30 steps does, bit for bit (the schedule's horizon is the run's 30
    steps in the trial too), the choice in its file."""
    options = {"steps": 30, "lr": 0.1, "momentum": 0.9, "lr_schedule": "cosine", "progress": False,
               "exit_on_error": False}
    plain = hpcps.train(_net(), paradigm="bsp", out=str(mpi_tmp_path / "plain.h5"), **options)
    auto = hpcps.train(_net(), paradigm="auto", paradigms=["bsp"], trial_steps=8,
                       out=str(mpi_tmp_path / "auto.h5"), **options)
    # the trial's run file and checkpoint went with its folder; only the two runs' files are left
    assert share(world, sorted(p.name for p in mpi_tmp_path.glob("*.h5"))) == ["auto.h5", "plain.h5"]
    if world.rank == 0:
        np.testing.assert_array_equal(auto.params, plain.params)
        with h5py.File(auto.path) as f:
            assert f.attrs["paradigm"] == "bsp"
            record = json.loads(f.attrs["paradigm_choice"])
            steps = f["workers/iterations"]["step"]
            # the run's t = 0 on the wall clock: after the file's creation, before its first row ended
            created = datetime.datetime.fromisoformat(f.attrs["start_time"]).timestamp()
            first_end = float(f["workers/iterations"]["t_end"].min())
            assert created <= f.attrs["clock_start"] <= created + 60 and first_end > 0
        assert sorted(set(steps.tolist())) == list(range(8, 30)) and len(steps) == 4 * 22  # the rest, once each
        assert record["chosen"] == "bsp" and [t["paradigm"] for t in record["trials"]] == ["bsp"]
        assert record["measured"]["batches_per_s"] > 0 and record["trial_steps"] == 8
        assert record["trained_steps"] == 8


class _Bias(torch.nn.Module):
    """Logits that are one parameter vector whatever the input: under ``_sum`` each gradient is all ones."""

    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Parameter(torch.zeros(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b.expand(x.shape[0], 10)


def _sum(model: torch.nn.Module, batch) -> torch.Tensor:
    """The logits' batch mean, summed: d/db is all ones, whatever the batch."""
    return model(batch[0]).mean(0).sum()


@pytest.mark.timeout(120)
def test_trials_of_two_paradigms_train_each_step_once_and_the_run_goes_on_from_them(world, mpi_tmp_path):
    """Every gradient is all ones, so a step of the 4 workers moves each logit by -lr under either paradigm
    (bsp: a round's mean at lr; asp: each gradient at lr/4): after 20 steps in all, of which the two trials
    trained 6 each (asp, then bsp going on from asp's end), every logit is -20 lr, exactly (lr = 1/8), whichever
    paradigm the run took. A step the trials dropped or the run took again would be off by lr."""
    result = hpcps.train(_Bias(), loss=_sum, paradigm="auto", paradigms=["bsp", "asp"], trial_steps=6, steps=20,
                         lr=0.125, progress=False, exit_on_error=False, out=str(mpi_tmp_path / "auto.h5"))
    if world.rank == 0:
        np.testing.assert_array_equal(result.params, np.full(10, -20 * 0.125, np.float32))
        with h5py.File(result.path) as f:
            record = json.loads(f.attrs["paradigm_choice"])
            steps = f["workers/iterations"]["step"]
            applied = int(f["summary"].attrs["gradients_applied"])
        assert record["trained_steps"] == 12 and [t["paradigm"] for t in record["trials"]] == ["asp", "bsp"]
        assert sorted(set(steps.tolist())) == list(range(12, 20)) and len(steps) == 4 * 8 and applied == 4 * 8


@pytest.mark.timeout(120)
def test_in_a_short_run_the_trials_are_shortened_to_a_quarter_of_it_and_still_train(world, mpi_tmp_path):
    """``--steps 44`` and no ``--trial-steps``: two trials of the default 30 would outlast the run (and train
    nothing, the run starting over after them); shortened to 10 each (a quarter of 44 over 2 trials, at least
    10), they train 20 steps and the run the other 24, every logit at -44 lr in the end, as in the test above."""
    result = hpcps.train(_Bias(), loss=_sum, paradigm="auto", paradigms=["bsp", "asp"], steps=44, lr=0.125,
                         progress=False, exit_on_error=False, out=str(mpi_tmp_path / "auto.h5"))
    if world.rank == 0:
        np.testing.assert_array_equal(result.params, np.full(10, -44 * 0.125, np.float32))
        with h5py.File(result.path) as f:
            record = json.loads(f.attrs["paradigm_choice"])
            steps = f["workers/iterations"]["step"]
        assert record["trial_steps"] == 10 and record["trained_steps"] == 20
        assert sorted(set(steps.tolist())) == list(range(20, 44)) and len(steps) == 4 * 24


@pytest.mark.timeout(120)
def test_adams_state_goes_on_only_between_paradigms_whose_updates_are_of_one_batch(world, mpi_tmp_path):
    """Adam on the shards, every gradient all ones: each update moves each logit by its rate (m and v are 1
    after bias correction), so 20 steps leave -20 lr whatever the paradigms. An asp update is one worker's
    gradient and a bsp update the mean of 4: Adam's second moments of one are not the other's, so where the
    trials hand over between them the optimizer starts afresh, and its step count says so in closed form.
    asp's trial (6 steps, 24 updates), then bsp's going on from it afresh (6 rounds), then the run's 8 steps:
    bsp going on from its own trial (kept: 6 + 8 = 14 updates counted), or asp from bsp's (afresh: 8 x 4 = 32).
    Kept all along they would count 38 and 62."""
    from hpcps.runtime.checkpoints.files import checkpoint_path, read_optimizer_state

    folder = share(world, str(mpi_tmp_path / "ckpt"))
    result = hpcps.train(_Bias(), loss=_sum, paradigm="auto", paradigms=["bsp", "asp"], trial_steps=6, steps=20,
                         optimizer="adam", lr=0.125, checkpoint_every=1, checkpoint_dir=folder, progress=False,
                         exit_on_error=False, out=str(mpi_tmp_path / "auto.h5"))
    if world.rank == 0:
        np.testing.assert_allclose(result.params, np.full(10, -20 * 0.125, np.float32), rtol=1e-6)
        with h5py.File(result.path) as f:
            chosen, shape = str(f.attrs["paradigm"]), str(f.attrs["resumed_shape"])
        assert ("left behind" in shape) == (chosen == "asp")  # (bsp goes on from bsp's trial: kept)
        last = checkpoint_path(folder, 20 if chosen == "bsp" else 80)
        steps = [float(entry["step"]) for entry in read_optimizer_state(last, 0)["state"].values()]
        assert steps and set(steps) == {14.0 if chosen == "bsp" else 32.0}


@pytest.mark.timeout(120)
def test_with_adam_and_no_paradigms_given_auto_tries_bsp_alone_and_the_file_keeps_what_it_left_out(world,
                                                                                                  mpi_tmp_path):
    """Adam on the shards and ``--paradigms`` left at its default: the paradigms of single gradients are left
    out before any trial (hpcps.options.paradigm_choice.choices), so bsp's is the one trial, the run goes on
    from it (-20 lr on every logit after 20 steps, as in the test above), and the run file names what was left
    out and why, where ``hpcps report`` reads it."""
    from hpcps.analysis.report import load_run

    result = hpcps.train(_Bias(), loss=_sum, paradigm="auto", trial_steps=6, steps=20, optimizer="adam", lr=0.125,
                         progress=False, exit_on_error=False, out=str(mpi_tmp_path / "auto.h5"))
    if world.rank == 0:
        np.testing.assert_allclose(result.params, np.full(10, -20 * 0.125, np.float32), rtol=1e-6)
        with h5py.File(result.path) as f:
            record = json.loads(f.attrs["paradigm_choice"])
        assert record["chosen"] == "bsp" and [t["paradigm"] for t in record["trials"]] == ["bsp"]
        assert sorted(record["left_out"]) == ["asp", "dssp", "ssp"] and record["skipped"] == {}
        assert all(why.startswith("--optimizer adam: trains less per sample") for why in record["left_out"].values())
        assert load_run(result.path).choice == record


@pytest.mark.timeout(120)
def test_trials_skip_the_held_out_evaluation_that_the_run_takes(world, mpi_tmp_path):
    """A trial's accuracy and model are read by no one: its end pulls the final parameters (the next leg goes
    on from them) but evaluates nothing and saves no model, where the run after it evaluates as its options
    say (on ResNet-18 a final evaluation is seconds a trial). Each trial's run file has no evaluation row and
    no model beside it; the run's has them."""
    from hpcps.runtime.tune import run_chosen

    rows = []

    def trial(cfg, comm, leg=None):
        result = run_training(cfg, comm, leg=leg)
        assert leg is not None and leg.trial
        if comm.rank == 0:
            with h5py.File(result.path) as f:
                rows.append(len(f["eval"]))
            assert result.saved is None and not os.path.exists(result.path[:-3] + ".pt")  # nor a model saved
        return result

    cfg = make_config({"paradigm": "auto", "paradigms": ["bsp", "asp"], "trial_steps": 6, "steps": 20,
                       "eval_every": 2, "progress": False, "out": str(mpi_tmp_path / "auto.h5")})
    _, result = run_chosen(cfg, world, run_training, trial)
    if world.rank == 0:
        with h5py.File(result.path) as f:
            evaluated = len(f["eval"])
        assert rows == [0, 0] and evaluated >= 2  # (every 2 versions, and the final one)


@pytest.mark.timeout(120)
def test_a_trial_that_diverges_ends_with_a_warning_of_the_trial_not_a_runs_error_and_advice(world, mpi_tmp_path,
                                                                                            capsys):
    """At a rate no paradigm survives, each trial's divergence watch stops it, and rank 0 says so as the
    trial's end (a warning: the trials go on without it), not as a run's error with advice the user is not
    to take (a smaller --lr, --divergence ignore). With every trial stopped, the job ends before the run."""
    cfg = make_config({"paradigm": "auto", "paradigms": ["bsp", "asp"], "trial_steps": 40, "steps": 400,
                       "lr": 50.0, "progress": False, "out": str(mpi_tmp_path / "auto.h5")})
    try:
        chosen = choose_paradigm(cfg, world, run_training)
    except UserError as e:
        assert "every paradigm's trial stopped on its own" in str(e), e
    else:  # (failed once in CI's Open MPI stage, passing alone: say what the trials did)
        pytest.fail(f"a trial at lr 50 did not stop; chosen: {chosen!r}; rank {world.rank}'s log:\n"
                    + capsys.readouterr().err[-4000:])
    err = capsys.readouterr().err
    facts = share(world, {"trial": [x for x in err.splitlines() if "'s trial diverged: " in x],
                          "run": [x for x in err.splitlines() if "training diverged" in x or "stopped by" in x
                                  or "--resume" in x]} if world.rank == 0
                  else None)
    assert [x.split("--paradigm auto: ")[1].split("'s")[0] for x in facts["trial"]] == ["asp", "bsp"], facts
    assert all("WARNING" in x and "it is not chosen" in x for x in facts["trial"]), facts
    assert facts["run"] == [], facts
