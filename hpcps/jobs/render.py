"""``hpcps jobs render``: batch scripts for Slurm, PBS, LSF and plain mpiexec.

The templates are Jinja2 files shipped in ``hpcps/jobs/templates/``. Every script
sets up the environment (``--setup`` lines: modules, venv activation), sets
``OMP_NUM_THREADS``, makes a per-job run directory named with the job id
(``runs/<jobid>``, exported as ``HPCPS_RUN_DIR``) and launches ``hpcps train``
with the options given after ``--``, unchanged. Without an ``--out`` among
them the metrics go to ``$RUN_DIR/metrics.h5``. With ``--script FILE.py``
it launches ``python FILE.py`` (a script calling :func:`hpcps.train`) with
those arguments instead; its metrics go to the run directory by default.

Before the time limit (``--stop-before``, 120 s by default) the scheduler
sends SIGUSR1 where it can (Slurm's ``--signal``, LSF's ``-wa``/``-wt``):
hpcps stops, writes its metrics and a checkpoint in the run directory,
and says how to resume. PBS has no such warning: at the walltime it sends
SIGTERM, which hpcps handles the same way, and SIGKILL ``kill_delay``
seconds later (10 by default; ask your site).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from importlib import resources

import jinja2

from hpcps.errors import UserError

DEFAULT_STOP_BEFORE = 120
SIGNAL_SLACK = 60  # the job's first minute is no time for a warning signal (Slurm's 30 s checks, start-up)
SCHEDULERS = {"slurm": "job.sbatch", "pbs": "job.pbs", "lsf": "job.lsf", "mpiexec": "job.sh"}
_TIME = re.compile(r"^(\d+):([0-5]\d):([0-5]\d)$")


@dataclass
class JobSpec:
    """What a batch script asks for; the options of ``hpcps jobs render``."""

    scheduler: str
    nodes: int = 1
    ntasks_per_node: int = 5
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    setup: list[str] = field(default_factory=list)
    mpi: str | None = None
    mpi_family: str | None = None  # mpich, openmpi or intel-mpi: picks the launcher; None: the generic one
    name: str = "hpcps"
    script: str | None = None
    stop_before: int | None = None  # seconds before the time limit to signal hpcps (Slurm, LSF); 0: never
    restarts: int = 0  # >0: the launch under hpcps supervise, resuming with --resume auto (hpcps.jobs.supervise)
    train_args: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise UserError(f"unknown scheduler {self.scheduler!r} (known: {', '.join(SCHEDULERS)})")
        for opt in ("nodes", "ntasks_per_node", "cpus_per_task"):
            if getattr(self, opt) < 1:
                raise UserError(f"--{opt.replace('_', '-')} must be at least 1 (got {getattr(self, opt)})")
        if self.gpus_per_node < 0:
            raise UserError(f"--gpus-per-node must be 0 or more (got {self.gpus_per_node})")
        if not _TIME.match(self.time):
            raise UserError(f"--time {self.time!r}: expected HH:MM:SS, e.g. 02:30:00")
        limit = seconds(self.time)
        if self.stop_before is None:  # 120 s, or less in a short job: see below
            self.stop_before = max(0, min(DEFAULT_STOP_BEFORE, limit - SIGNAL_SLACK))
        if self.stop_before < 0:
            raise UserError(f"--stop-before must be 0 or more seconds (got {self.stop_before})")
        if self.stop_before > limit - SIGNAL_SLACK:
            raise UserError(f"--stop-before {self.stop_before}: with --time {self.time} the signal could come "
                            f"before the job's tasks have started (Slurm checks every 30 s and may signal 30 s "
                            f"early); use at most {max(0, limit - SIGNAL_SLACK)} or a longer --time")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise UserError(f"--name {self.name!r}: use letters, digits, '.', '_' and '-'")
        if self.mpi_family is not None and self.mpi_family not in MPI_FAMILIES:
            raise UserError(f"--mpi-family {self.mpi_family!r}: expected one of {', '.join(MPI_FAMILIES)} or auto")
        if self.restarts < 0:
            raise UserError(f"--restarts must be 0 or more (got {self.restarts})")
        if self.script is not None and not os.path.isfile(self.script):
            raise UserError(f"--script {self.script}: no such file (the job runs it from the directory you submit in)")


def seconds(hh_mm_ss: str) -> int:
    h, m, s = (int(x) for x in _TIME.match(hh_mm_ss).groups())
    return 3600 * h + 60 * m + s


def lsf_minutes(hh_mm_ss: str) -> str:
    """LSF's ``-W [hours:]minutes`` from HH:MM:SS, seconds rounded up."""
    h, m, s = (int(x) for x in _TIME.match(hh_mm_ss).groups())
    total = h * 60 + m + (s > 0)
    return f"{total // 60}:{total % 60:02d}"


def launch_args(train_args: list[str], restarts: int = 0) -> str:
    """The ``hpcps train`` options, shell-quoted, with a per-job ``--out`` unless one is given, and under
    ``restarts`` ``--resume auto`` unless a ``--resume`` is given (each launch resumes the one before)."""
    args = [a for a in train_args if a != "--"] if train_args[:1] == ["--"] else list(train_args)
    quoted = shlex.join(args)
    if not any(a == "--out" or a.startswith("--out=") for a in args):
        quoted = (quoted + " " if quoted else "") + '--out "$RUN_DIR/metrics.h5"'
    if restarts and not any(a == "--resume" or a.startswith("--resume=") for a in args):
        quoted += " --resume auto"
    return quoted


MPI_FAMILIES = ("mpich", "openmpi", "intel-mpi")


def launcher(spec: JobSpec) -> tuple[str, str]:
    """The launch command before what each rank runs, and a comment saying why it fits ``spec.mpi_family``.

    * Slurm: ``srun`` with ``--mpi`` as given; else for Open MPI its own ``mpirun``, which starts the ranks
      inside the allocation through Slurm (``srun --mpi=pmix`` needs Slurm's PMIx plugin to load, and
      ``srun --mpi=list`` lists it also where it cannot: seen with Debian's Slurm); for Intel MPI its
      ``mpiexec.hydra``, which does the same; else ``srun`` with the site's ``MpiDefault``.
    * PBS, LSF and plain scripts: Open MPI's ``mpirun``, Intel's ``mpiexec.hydra``, else ``mpiexec``
      (``mpirun`` on LSF).
    """
    n, family = spec.nodes * spec.ntasks_per_node, spec.mpi_family
    if spec.scheduler == "slurm":
        # --kill-on-bad-exit: a rank that dies ends the step, as mpiexec ends its job; without it (Slurm's
        # default) the other ranks waited for the dead one until the stall limit
        if spec.mpi:
            return f"srun --kill-on-bad-exit=1 --mpi={spec.mpi}", ""
        if family == "openmpi":
            return f"mpirun -n {n}", ("Open MPI's mpirun starts the ranks inside the allocation (or render with "
                                      "--mpi pmix to launch with srun, where Slurm's PMIx plugin loads)")
        if family == "intel-mpi":
            return f"mpiexec.hydra -n {n}", "Intel MPI's launcher starts the ranks inside the allocation"
        return "srun --kill-on-bad-exit=1", ""
    if family == "openmpi":
        return f"mpirun -n {n}", "Open MPI's launcher"
    if family == "intel-mpi":
        return f"mpiexec.hydra -n {n}", "Intel MPI's launcher"
    return (f"mpirun -n {n}" if spec.scheduler == "lsf" else f"mpiexec -n {n}"), ""


def launch_line(spec: JobSpec) -> str:
    """What each rank runs: ``hpcps train OPTIONS``, or ``python SCRIPT ARGS`` (arguments unchanged)."""
    if spec.script is None:
        return f"hpcps train {launch_args(spec.train_args, spec.restarts)}"
    args = spec.train_args[1:] if spec.train_args[:1] == ["--"] else spec.train_args
    return shlex.join(["python", spec.script, *args])


def render(spec: JobSpec, *, command: str = "hpcps jobs render") -> str:
    """The batch script for ``spec``."""
    spec.validate()
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    text = resources.files("hpcps.jobs").joinpath("templates", f"{spec.scheduler}.sh.j2").read_text()
    prefix, why = launcher(spec)
    if spec.restarts:
        where = " on the nodes still alive" if prefix.startswith("srun") else ""
        again = (f"a launch that fails (a rank or a node died) runs again{where}, at most {spec.restarts} times, "
                 f"resuming from the newest complete checkpoint")
        prefix, why = f"hpcps supervise --restarts {spec.restarts} -- {prefix}", f"{why}; {again}" if why else again
    return env.from_string(text).render(
        **{k: v for k, v in vars(spec).items() if k not in ("train_args", "script")},
        launcher=prefix, launcher_why=why,
        launch=launch_line(spec), lsf_time=lsf_minutes(spec.time), lsf_warning=-(-spec.stop_before // 60),
        script_name=SCHEDULERS[spec.scheduler], command=command,
    )
