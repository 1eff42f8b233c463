"""What the launcher (srun, mpiexec, mpirun) says about the job, before and against MPI.

hpcps trusts ``MPI.COMM_WORLD``. The one thing it checks against the
launcher is the classic mis-wiring: the launcher started several tasks but
MPI sees a world of one (``srun`` without the PMI plugin the MPI library
needs, or an ``mpiexec`` from a different MPI than mpi4py's). Without the
check that job would run N independent single-rank trainings.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from hpcps.errors import UserError

#: prefixes of the variables a launcher leaves in a rank's environment
LAUNCHER_VAR_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "OMPI_", "SLURM_")

#: (environment variable, launcher) pairs that announce the number of tasks started
_TASK_VARS = (
    ("SLURM_STEP_NUM_TASKS", "srun"),
    ("PMI_SIZE", "mpiexec"),
    ("PMIX_SIZE", "mpiexec"),
    ("OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"),
    ("MV2_COMM_WORLD_SIZE", "mpirun (MVAPICH)"),
)


def launched_tasks(environ=os.environ) -> tuple[str, int] | None:
    """``(launcher, number of tasks)`` as announced in the environment, or None."""
    for var, launcher in _TASK_VARS:
        if environ.get(var, "").isdigit():
            return launcher, int(environ[var])
    return None


def check_world(world_size: int, environ=os.environ) -> None:
    """Raise UserError if the launcher started several tasks but MPI sees a world of one."""
    launched = launched_tasks(environ)
    if world_size != 1 or launched is None or launched[1] <= 1:
        return
    launcher, n = launched
    if launcher == "srun":
        fix = ("srun needs the PMI plugin of the MPI library mpi4py uses: srun --mpi=pmi2 for MPICH "
               "(and the mpich wheel), --mpi=pmix for Open MPI; `srun --mpi=list` shows what this Slurm offers")
    else:
        fix = ("the mpiexec/mpirun on PATH belongs to a different MPI than the one mpi4py was built for; use "
               "that MPI's launcher (python -c 'import mpi4py; print(mpi4py.get_config())' tells which)")
    raise UserError(f"{launcher} started {n} tasks but MPI sees a world of 1 in each: every task would train "
                    f"alone. {fix}")


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python (the mpich wheel's, matching mpi4py), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def clean_environ(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, for starting a new job from inside one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VAR_PREFIXES)}
    env.update(extra)
    return env
