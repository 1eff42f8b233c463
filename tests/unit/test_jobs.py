"""Batch scripts: rendering, shell validity, options passed through unchanged; launcher checks."""

import shutil
import subprocess
from pathlib import Path

import pytest

from hpcps.cli import main
from hpcps.errors import UserError
from hpcps.jobs.render import SCHEDULERS, JobSpec, launch_args, launcher, lsf_minutes, render
from hpcps.cluster.launcher import check_world, launched_tasks

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--paradigm", "dssp", "--slowdown", "4=3", "--dataset", "my data.h5"]


def _spec(scheduler, **kw):
    return JobSpec(scheduler, nodes=2, ntasks_per_node=4, gpus_per_node=4, time="02:30:00", partition="gpu",
                   account="proj1", setup=["module load openmpi", "source ~/venv/bin/activate"], mpi="pmix",
                   train_args=TRAIN, **kw)


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_scripts_are_valid_bash_and_pass_shellcheck(tmp_path, scheduler):
    script = tmp_path / "job.sh"
    script.write_text(render(_spec(scheduler)))
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck); bash -n passed")
    check = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


@pytest.mark.parametrize("scheduler,launch", [("slurm", "srun --kill-on-bad-exit=1 --mpi=pmix hpcps train"), ("pbs", "mpiexec -n 8 hpcps train"),
                                              ("lsf", "mpirun -n 8 hpcps train"), ("mpiexec", "mpiexec -n 8 hpcps train")])
def test_train_options_reach_the_launch_line_unchanged(scheduler, launch):
    text = render(_spec(scheduler))
    line = next(l for l in text.splitlines() if l.startswith(launch))
    assert line == f"{launch} --paradigm dssp --slowdown 4=3 --dataset 'my data.h5' --out \"$RUN_DIR/metrics.h5\""
    assert "module load openmpi" in text and "export OMP_NUM_THREADS" in text and "runs/" in text


def test_resources_appear_in_each_dialect():
    slurm, pbs, lsf = (render(_spec(s)) for s in ("slurm", "pbs", "lsf"))
    for needle in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--time=02:30:00",
                   "--partition=gpu", "--account=proj1", "${SLURM_JOB_ID}"):
        assert needle in slurm
    for needle in ("select=2:ncpus=4:mpiprocs=4:ngpus=4", "walltime=02:30:00", "#PBS -q gpu", "#PBS -A proj1"):
        assert needle in pbs
    for needle in ("#BSUB -n 8", "span[ptile=4]", 'num=4"', "#BSUB -W 2:30", "#BSUB -q gpu", "#BSUB -P proj1"):
        assert needle in lsf


def test_a_given_out_is_kept_and_no_mpi_plugin_means_the_site_default():
    text = render(JobSpec("slurm", train_args=["--out", "X.h5"]))
    assert "srun --kill-on-bad-exit=1 hpcps train --out X.h5\n" in text
    assert launch_args([]) == '--out "$RUN_DIR/metrics.h5"'


@pytest.mark.parametrize("scheduler, family, mpi, launch", [
    ("slurm", "openmpi", None, "mpirun -n 8 hpcps train"),              # inside the allocation
    ("slurm", "openmpi", "pmix", "srun --kill-on-bad-exit=1 --mpi=pmix hpcps train"),        # the user's plugin stands
    ("slurm", "intel-mpi", None, "mpiexec.hydra -n 8 hpcps train"),
    ("slurm", "mpich", None, "srun --kill-on-bad-exit=1 hpcps train"),                       # the site's MpiDefault
    ("pbs", "openmpi", None, "mpirun -n 8 hpcps train"),
    ("lsf", "intel-mpi", None, "mpiexec.hydra -n 8 hpcps train"),
    ("mpiexec", "mpich", None, "mpiexec -n 8 hpcps train"),
    ("lsf", None, None, "mpirun -n 8 hpcps train"),
])
def test_the_launcher_fits_the_mpi_family(scheduler, family, mpi, launch):
    spec = JobSpec(scheduler, nodes=2, ntasks_per_node=4, mpi=mpi, mpi_family=family,
                   train_args=["--paradigm", "bsp"])
    lines = render(spec).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(launch + " "))
    assert lines[at] == f'{launch} --paradigm bsp --out "$RUN_DIR/metrics.h5"'
    why = launcher(spec)[1]  # said in a comment above the line, where the MPI picked the launcher
    assert bool(why) == (family in ("openmpi", "intel-mpi") and mpi is None)
    assert not why or lines[at - 1] == f"# {why}"


def test_bad_job_options_are_named():
    with pytest.raises(UserError, match=r"--mpi-family 'lam': expected one of mpich, openmpi, intel-mpi or auto"):
        render(JobSpec("slurm", mpi_family="lam"))
    with pytest.raises(UserError, match=r"--time '2h': expected HH:MM:SS"):
        render(JobSpec("slurm", time="2h"))
    with pytest.raises(UserError, match=r"--nodes must be at least 1"):
        render(JobSpec("pbs", nodes=0))
    assert lsf_minutes("00:00:01") == "0:01" and lsf_minutes("26:59:59") == "27:00"


def test_cli_render_passes_everything_after_the_double_dash(capsys, monkeypatch):
    monkeypatch.setattr("hpcps.cli.detect_mpi_family", lambda: "mpich")
    assert main(["jobs", "render", "slurm", "--nodes", "3", "--", "--paradigm", "bsp", "--lr-gamma", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=3" in out and "srun --kill-on-bad-exit=1 hpcps train --paradigm bsp --lr-gamma 0.5 --out" in out
    assert "# Rendered by: hpcps jobs render slurm --nodes 3 -- --paradigm bsp --lr-gamma 0.5" in out


EXAMPLES = {
    "slurm-2node-gpu.sbatch": ["jobs", "render", "slurm", "--nodes", "2", "--ntasks-per-node", "4",
                               "--gpus-per-node", "4", "--time", "02:00:00", "--partition", "gpu",
                               "--account", "myproject", "--setup", "module load openmpi",
                               "--setup", "source \"$HOME/venvs/hpcps/bin/activate\"", "--mpi", "pmix", "--",
                               "--paradigm", "dssp", "--steps", "2000"],
    "pbs.pbs": ["jobs", "render", "pbs", "--nodes", "2", "--ntasks-per-node", "4", "--", "--paradigm", "ssp"],
    "lsf.lsf": ["jobs", "render", "lsf", "--nodes", "2", "--ntasks-per-node", "4", "--", "--paradigm", "asp"],
    "mpiexec.sh": ["jobs", "render", "mpiexec", "--ntasks-per-node", "5", "--", "--paradigm", "bsp"],
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_shipped_examples_are_what_render_prints(name, capsys, monkeypatch):
    monkeypatch.setattr("hpcps.cli.detect_mpi_family", lambda: "mpich")  # as rendered: whatever MPI this has
    assert main(EXAMPLES[name]) == 0
    assert (ROOT / "jobs" / name).read_text() == capsys.readouterr().out, f"re-render jobs/{name}"


def test_launcher_mismatch_is_detected_with_the_fix():
    assert launched_tasks({"SLURM_STEP_NUM_TASKS": "4"}) == ("srun", 4)
    with pytest.raises(UserError, match=r"srun started 4 tasks but MPI sees a world of 1.*srun --mpi=pmi2"):
        check_world(1, {"SLURM_STEP_NUM_TASKS": "4"})
    with pytest.raises(UserError, match=r"mpiexec started 3 tasks.*different MPI"):
        check_world(1, {"PMI_SIZE": "3"})
    check_world(4, {"SLURM_STEP_NUM_TASKS": "4"})  # wired right
    check_world(1, {"SLURM_NTASKS": "8"})  # a batch shell, not a step: nothing to say
    check_world(1, {})


def test_a_user_script_is_launched_in_place_of_hpcps_train(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    text = render(JobSpec("slurm", script="train.py", train_args=["--", "--steps", "10", "--note", "a b"]))
    assert "srun --kill-on-bad-exit=1 python train.py --steps 10 --note 'a b'\n" in text
    assert 'export HPCPS_RUN_DIR="$RUN_DIR"' in text and "hpcps train" not in text
    with pytest.raises(UserError, match="--script nope.py: no such file"):
        render(JobSpec("pbs", script="nope.py"))


@pytest.mark.parametrize("argv,message", [
    (["--", "--paradigm", "ssq"], "--paradigm: unknown paradigm 'ssq'"),
    (["--nodes", "1", "--ntasks-per-node", "2", "--", "--servers", "2"],
     "world of 2 rank(s) is too small for --servers 2 and --groups 0: at least 3 ranks are needed"),
    (["--", "--lr", "abc"], "after --: argument --lr: invalid float value: 'abc'"),
    (["--", "--nope", "1"], "after --: unrecognized arguments: --nope 1"),
    (["--nodes", "2", "--ntasks-per-node", "2", "--", "--slowdown", "9=2"], "--slowdown 9=...: no rank 9 in a world of 4"),
])
def test_render_refuses_what_hpcps_train_would_refuse_with_one_line_and_no_script(capsys, argv, message):
    assert main(["jobs", "render", "slurm", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("hpcps: error: ") and message in err, err


@pytest.mark.parametrize("scheduler,asks", [
    ("slurm", ["#SBATCH --signal=USR1@120"]),  # every task of the job step gets SIGUSR1 120 s before the limit
    ("lsf", ["#BSUB -wa USR1", "#BSUB -wt 2"]),  # LSF's warning time is in minutes: 120 s -> 2
])
def test_schedulers_with_a_warning_signal_ask_for_one_before_the_time_limit(scheduler, asks):
    lines = render(_spec(scheduler)).splitlines()
    assert all(a in lines for a in asks)
    assert render(_spec(scheduler, stop_before=90)).count("USR1") >= 1
    assert "-wt 2" in render(_spec(scheduler, stop_before=61)) or scheduler == "slurm"  # minutes round up
    quiet = render(_spec(scheduler, stop_before=0))
    assert "--signal" not in quiet and "-wa " not in quiet and "-wt " not in quiet


def test_pbs_says_its_sigterm_is_the_warning_and_a_negative_stop_before_is_refused():
    assert "sends SIGTERM" in render(_spec("pbs"))
    with pytest.raises(UserError, match="--stop-before must be 0 or more"):
        render(_spec("slurm", stop_before=-5))


def test_a_warning_that_could_come_before_the_tasks_start_is_refused_and_short_jobs_get_a_shorter_default():
    with pytest.raises(UserError, match=r"--stop-before 100: with --time 00:02:00 .* use at most 60"):
        render(JobSpec("slurm", time="00:02:00", stop_before=100))
    assert "#SBATCH --signal=USR1@60" in render(JobSpec("slurm", time="00:02:00"))
    assert "--signal" not in render(JobSpec("slurm", time="00:01:00"))  # no room for one: none asked


def test_a_script_started_by_torchrun_is_told_the_mpi_command_to_use():
    """torchrun starts N processes, each an MPI world of 1: one line naming mpiexec with N workers and a shard."""
    env = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "RANK": "2"}
    assert launched_tasks(env) == ("torchrun", 4)
    said = r"torchrun started 4 processes, each an MPI world of 1: .*mpiexec -n 5 python "
    with pytest.raises(UserError, match=said):
        check_world(1, env)
    assert launched_tasks({"WORLD_SIZE": "4"}) is None  # not torchrun's
    from hpcps.cluster.launcher import launcher_rank

    assert launcher_rank(env) == 2 and launcher_rank({"PMI_RANK": "1"}) == 1 and launcher_rank({}) == 0
