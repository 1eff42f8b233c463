"""What the launcher (srun, mpiexec, mpirun) says about the job, before and against MPI.

hpcps trusts ``MPI.COMM_WORLD``. The one thing it checks against the
launcher is the classic mis-wiring: the launcher started several tasks but
MPI sees a world of one (``srun`` without the PMI plugin the MPI library
needs, or an ``mpiexec`` from a different MPI than mpi4py's). Without the
check that job would run N independent single-rank trainings.

Also here, pure: which MPI family a library's version string or a launcher's ``--version`` names, and the
environment a new job started from inside one gets (the user's MPI settings kept, the launcher's dropped).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hpcps.errors import UserError

#: prefixes of the variables a launcher leaves in a rank's environment
LAUNCHER_VAR_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "OMPI_", "PRTE_", "SLURM_")
#: ...except these, the user's own settings of Open MPI (its MCA parameters, running as root)
USER_VAR_PREFIXES = ("OMPI_MCA_", "PRTE_MCA_", "PMIX_MCA_", "OMPI_ALLOW_RUN_AS_ROOT")
#: ...of which Open MPI's launcher sets these for each job itself
JOB_MCA_VARS = ("OMPI_MCA_initial_wdir", "OMPI_MCA_num_procs", "OMPI_MCA_cpu_type")

#: where Linux lists RDMA devices (InfiniBand, RoCE, Omni-Path's verbs): what Open MPI's UCX components need
RDMA_DEVICES = "/sys/class/infiniband"

#: (environment variable, launcher) pairs that announce the number of tasks started
_TASK_VARS = (
    ("SLURM_STEP_NUM_TASKS", "srun"),
    ("PMI_SIZE", "mpiexec"),
    ("PMIX_SIZE", "mpiexec"),
    ("OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"),
    ("MV2_COMM_WORLD_SIZE", "mpirun (MVAPICH)"),
)


#: the variables launchers announce a process's rank in (MPI's launchers, srun)
RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def launcher_rank(environ=os.environ) -> int:
    """This process's rank as the launcher announced it (torchrun's ``RANK`` too; 0 when not launched by one)."""
    for var in RANK_VARS:
        if environ.get(var, "").isdigit():
            return int(environ[var])
    if "TORCHELASTIC_RUN_ID" in environ and environ.get("RANK", "").isdigit():
        return int(environ["RANK"])
    return 0


def launched_tasks(environ=os.environ) -> tuple[str, int] | None:
    """``(launcher, number of tasks)`` as announced in the environment, or None. torchrun (torch's elastic
    launcher, a DDP user's habit) announces its processes too, though it starts no MPI job."""
    for var, launcher in _TASK_VARS:
        if environ.get(var, "").isdigit():
            return launcher, int(environ[var])
    if "TORCHELASTIC_RUN_ID" in environ and environ.get("WORLD_SIZE", "").isdigit():
        return "torchrun", int(environ["WORLD_SIZE"])
    return None


def check_world(world_size: int, environ=os.environ) -> None:
    """Raise UserError if the launcher started several tasks but MPI sees a world of one."""
    launched = launched_tasks(environ)
    if world_size != 1 or launched is None or launched[1] <= 1:
        return
    launcher, n = launched
    if launcher == "torchrun":
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "SCRIPT.py"
        raise UserError(f"torchrun started {n} processes, each an MPI world of 1: hpcps runs over MPI, not torch's "
                        f"launcher. Launch the same script with mpiexec -n {n + 1} python {script} (or srun -n "
                        f"{n + 1} python {script}): {n} workers and a server shard (hpcps.init needs no "
                        f"init_process_group)")
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


#: (what a library's version string or its launcher's ``--version`` contains, upper case; the MPI's family),
#: the first that matches: Hydra is MPICH's launcher (MVAPICH's too; Intel's names itself first)
_FAMILIES = (("CRAY MPICH", "cray-mpich"), ("INTEL(R) MPI", "intel-mpi"), ("INTEL MPI", "intel-mpi"),
             ("MVAPICH", "mvapich"), ("OPEN MPI", "openmpi"), ("OPENRTE", "openmpi"), ("MPICH", "mpich"),
             ("HYDRA", "mpich"))


def mpi_family(text: str) -> str:
    """The MPI's family (``openmpi``, ``mpich``, ``intel-mpi``, ``cray-mpich``, ``mvapich``, else ``other``)
    from ``MPI_Get_library_version`` or from its launcher's ``--version``."""
    text = text.upper()
    return next((name for key, name in _FAMILIES if key in text), "other")


def library_name(text: str) -> str:
    """The first line of an ``MPI_Get_library_version`` string, printable: Open MPI ends its string in a
    NUL, which HDF5's strings cannot hold, and MPICH spreads its over many lines."""
    lines = text.replace("\0", "").strip().splitlines()
    return " ".join(lines[0].split()) if lines else "unknown MPI"


def launcher_family(mpiexec: str) -> str:
    """Whose launcher ``mpiexec`` is (:func:`mpi_family` of its ``--version``)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "other"
    return mpi_family(out)


def oversubscribing(family: str) -> dict[str, str]:
    """The environment that lets ``family``'s launcher start more ranks than cores (tests, the box on one
    machine): Open MPI refuses by default; MPICH's and Intel's launchers allow it."""
    if family == "openmpi" and "PRTE_MCA_rmaps_default_mapping_policy" not in os.environ:
        return {"PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}
    return {}


def _launchers(name: str) -> bool:
    """Whether variable ``name`` was set by a launcher for the job it started (not by the user)."""
    if name.startswith(USER_VAR_PREFIXES):
        return name in JOB_MCA_VARS
    return name.startswith(LAUNCHER_VAR_PREFIXES)


#: how hpcps launches a job under Open MPI's fault tolerance: run-through (``--with-ft ulfm``), and every job of
#: the launch recoverable, so that a process spawned in a dead worker's place (``--respawn``), which may have
#: to end without ``MPI_Finalize`` as the living do, does not fail its job (:mod:`hpcps.runtime.respawn`)
ULFM_LAUNCH = ("--with-ft", "ulfm", "--prtemca", "state_base_recoverable", "1")


def clean_environ(**extra: str) -> dict[str, str]:
    """This process's environment without the launcher's variables of the job it is in, for starting a new
    job from inside one; the user's own MPI settings (``OMPI_MCA_*``, ``PRTE_MCA_*``...) stay."""
    env = {k: v for k, v in os.environ.items() if not _launchers(k)}
    env.update(extra)
    return env


def open_mpi_defaults(environ=os.environ, rdma_devices: str = RDMA_DEVICES) -> dict[str, str]:
    """Settings for Open MPI that hpcps adds to ``environ`` before MPI starts, where the user has set none
    (each on its own); returns what it added. Only in a job that Open MPI's launcher started.

    * **The TCP BTL's eager limit** (``btl_tcp_eager_limit``, ``btl_tcp_rndv_eager_limit`` and
      ``btl_tcp_max_send_size``: 1 MiB, :data:`TCP_EAGER_BYTES`, instead of 64 KiB). Over TCP a larger
      message goes by rendezvous: its first fragment, the receiver's answer, then the rest, and each step
      waits for the other side's next MPI call. A push leaves as many pieces of about a partition
      (``--partition-mb``) while the worker computes and the shard polls with a backoff, so every piece
      paid those waits: in the box, bsp's round took 61-82 ms against 14 under MPICH, and sent eagerly 14
      (docs/results.md). They matter only where the TCP BTL carries the messages (Ethernet between nodes);
      Open MPI's RDMA networks go through UCX, which ignores them.
    * **Not** ``osc/ucx`` **on a node without RDMA devices.** There Open MPI 5's UCX one-sided component
      has nothing to run on: on every window's creation each rank prints ``OSC UCX component priority set
      inside component query failed`` and Open MPI goes on with the component that works (``osc/sm``
      within a node, ``osc/rdma`` across nodes). Excluding it (``OMPI_MCA_osc=^ucx``) picks the same
      component without the message; never where the node has RDMA devices, where ``osc/ucx`` is the
      component to use.
    """
    if "OMPI_COMM_WORLD_SIZE" not in environ:
        return {}
    added = {key: str(TCP_EAGER_BYTES) for key in TCP_EAGER_KEYS if key not in environ}
    if "OMPI_MCA_osc" not in environ:
        try:
            devices = os.listdir(rdma_devices)
        except OSError:  # no such folder: no RDMA device
            devices = []
        if not devices:
            added["OMPI_MCA_osc"] = "^ucx"
    environ.update(added)
    return added


#: the TCP BTL's eager limit hpcps sets under Open MPI where the user set none (:func:`open_mpi_defaults`)
TCP_EAGER_BYTES = 1 << 20
TCP_EAGER_KEYS = ("OMPI_MCA_btl_tcp_eager_limit", "OMPI_MCA_btl_tcp_rndv_eager_limit", "OMPI_MCA_btl_tcp_max_send_size")
