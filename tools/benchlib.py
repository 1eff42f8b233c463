"""Shared helpers of the benchmarks in tools/: launch real jobs, read their metrics, format tables."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np

from hpcps.cluster.launcher import clean_environ, find_mpiexec
from hpcps.errors import DIVERGED_STATUS


def launch_argv(np_: int, argv: list[str], emulate: str | None = None) -> list[str]:
    """``mpiexec -n NP ARGV``, or, with ``emulate`` (``hpcps emulate`` options as one string, e.g.
    ``"--nodes 5 --link 1gbit"``), ARGV on the ranks of a cluster in a box."""
    if emulate:  # {np} and {last} stand for the job's rank count and its last rank (e.g. --link {last}=250mbit)
        words = shlex.split(emulate.format(np=np_, last=np_ - 1))
        return [sys.executable, "-m", "hpcps", "emulate", *words, "--", *argv]
    return [find_mpiexec() or "mpiexec", "-n", str(np_), *argv]


def openmpi_env(oversubscribe: bool = True) -> dict[str, str]:
    """This environment, as Open MPI's launcher needs it here: more ranks than cores (``oversubscribe``), and
    as root the two variables without which it refuses to start."""
    env = dict(os.environ)
    if oversubscribe:
        env["PRTE_MCA_rmaps_default_mapping_policy"] = ":oversubscribe"
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


class RunFailed(subprocess.CalledProcessError):
    """A benchmark's job that ended non-zero, said with the last lines of what it wrote to stderr (the job's
    own one-line error among them), so a failed row says why instead of only its exit status."""

    def __str__(self) -> str:
        lines = (self.stderr or b"").decode(errors="replace").strip().splitlines()
        return super().__str__() + (" Its last lines on stderr:\n" + "\n".join(lines[-20:]) if lines else
                                    " It wrote nothing to stderr.")


def run_quietly(cmd: list[str], env: dict[str, str], timeout: float) -> None:
    """Run a benchmark's job ``cmd``, its stdout dropped and its stderr kept for :class:`RunFailed`."""
    try:
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.CalledProcessError as e:
        raise RunFailed(e.returncode, e.cmd, e.output, e.stderr) from None


def train(np_: int, out: Path, options: list[str], timeout: float = 900, env: dict[str, str] | None = None,
          emulate: str | None = None, diverged_ok: bool = False) -> dict:
    """Run ``hpcps train --out OUT OPTIONS`` on ``np_`` ranks (with ``env`` added to a clean environment),
    under mpiexec or in a box (``emulate``); return the run's tables and summary. With ``diverged_ok`` a run
    its divergence watch stopped (exit 3, its file complete and saying so in ``stopped_by``) is returned
    as the others are, for a row that says so, where otherwise it ends the benchmark."""
    cmd = launch_argv(np_, [sys.executable, "-m", "hpcps", "train", "--out", str(out), "--no-progress", *options],
                      emulate)
    try:
        run_quietly(cmd, clean_environ(**(env or {})), timeout)
    except RunFailed as e:
        if not (diverged_ok and e.returncode == DIVERGED_STATUS and _stopped_by(out) == "diverged"):
            raise
    with h5py.File(out) as f:
        if int(f.attrs["world_size"]) != np_:
            raise SystemExit(f"the job ran on {int(f.attrs['world_size'])} ranks, not --np {np_}: "
                             "make --emulate's nodes and ranks match")
        return {"it": f["workers/iterations"][()], "up": f["servers/updates"][()], "ev": f["eval"][()],
                "summary": dict(f["summary"].attrs), "paradigm": str(f.attrs["paradigm"]),
                "cluster": str(f.attrs.get("cluster", "{}")),
                "choice": json.loads(f.attrs.get("paradigm_choice", "{}")),  # --paradigm auto's
                "start_time": str(f.attrs["start_time"]), "clock_start": f.attrs.get("clock_start")}


def _stopped_by(out: Path) -> str | None:
    """What the run file ``out`` says stopped its run ("" for nothing; None: no complete file)."""
    try:
        with h5py.File(out, "r") as f:
            return str(f["summary"].attrs["stopped_by"])
    except (OSError, KeyError):
        return None


def flags_of(options: list[str]) -> dict[str, str]:
    """``--flag value`` pairs (as given after ``--``) as config field names and their values."""
    return dict(zip([o.lstrip("-").replace("-", "_") for o in options[::2]], options[1::2]))


def config_of(options: list[str], drop: tuple[str, ...] = ()):
    """The hpcps train config of ``options`` (:func:`flags_of`), less the fields in ``drop``: what a
    benchmark's own ranks build the same workload from."""
    from hpcps.options.config import make_config

    flags = flags_of(options)
    for name in drop:
        flags.pop(name, None)
    return make_config(flags)


def box_node() -> int | None:
    """The emulated node this process runs on (``hpcps emulate`` sets ``HPCPS_NODE``), or None outside a box."""
    node = os.environ.get("HPCPS_NODE")
    return None if node is None else int(node)


def gloo_addresses() -> tuple[str, str]:
    """(this process's address, node 0's), where gloo and torchft listen and meet. In a cluster in a box the
    emulated nodes' addresses, and gloo set to the node's link (``GLOO_SOCKET_IFNAME``), which it would not
    find alone; elsewhere 127.0.0.1 twice."""
    node = box_node()
    if node is None:
        return "127.0.0.1", "127.0.0.1"
    from hpcps.box.spec import NODE_IFACE, Cluster

    os.environ["GLOO_SOCKET_IFNAME"] = NODE_IFACE
    return Cluster.address(node), Cluster.address(0)


def init_gloo(comm) -> None:
    """Collective: torch.distributed's gloo group over ``comm``'s ranks, rank for rank, met at node 0 in a
    box (elsewhere at ``MASTER_ADDR``, default 127.0.0.1) on ``MASTER_PORT`` or a port rank 0 picks."""
    import torch.distributed as dist

    first = gloo_addresses()[1]
    if box_node() is not None:
        os.environ["MASTER_ADDR"] = first
    os.environ.setdefault("MASTER_ADDR", first)
    os.environ.setdefault("MASTER_PORT", str(comm.bcast(29500 + os.getpid() % 1000 if comm.rank == 0 else None)))
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)


def data_parallel_replica(cfg, comm, steps: int):
    """A data-parallel rank's share of ``hpcps train``'s workload under ``cfg`` (collective over ``comm``):
    the workload, the model ``hpcps train`` would build and this rank's batches, on the CPU."""
    import torch

    from hpcps.training.workload import data_shape, workload_from_config

    workload = workload_from_config(cfg)
    if workload.prepare is not None and comm.rank == 0:
        workload.prepare()
    comm.Barrier()
    source = workload.data()
    in_shape, n_classes = data_shape(source)
    model = workload.build_model(seed=cfg.seed, in_shape=in_shape, n_classes=n_classes, hidden=cfg.hidden)
    batches = source.for_worker(comm.rank, comm.size, batch_size=cfg.batch_size, seed=cfg.seed,
                                device=torch.device("cpu"), steps=steps)
    return workload, model, batches


class Replica:
    """A data-parallel replica of a benchmark's workload outside hpcps (bench_local's DDP rows, torchft's
    DiLoCo), from the hpcps train ``options`` after its ``--`` (less the fields in ``drop``), collective
    over ``comm``: the config, workload, model and batches :func:`data_parallel_replica` gives, with the
    emulated compute hooked into the model's passes as an hpcps worker's (the last rank ``--straggler``
    times slower), and rank 0's evaluations every ``--eval-every-s`` seconds of training (its clock stopped
    while it evaluates) until ``target`` or ``budget`` seconds."""

    def __init__(self, options: list[str], comm, drop: tuple[str, ...], *, target: float, budget: float) -> None:
        import torch

        from hpcps.cluster.emulation import BackwardCompute, ComputeTime, forward_compute
        from hpcps.training.workload import default_evaluate

        flags = flags_of(options)
        self.cfg = cfg = config_of(options, drop=("straggler", "eval_every_s", *drop))
        torch.set_num_threads(cfg.threads)
        self.workload, self.model, self.batches = data_parallel_replica(cfg, comm, cfg.steps)
        slow = float(flags.get("straggler", 1.0)) if comm.rank == comm.size - 1 else 1.0
        self.emulated = ComputeTime(cfg.compute_time, slow)
        forward_compute(self.model, lambda: self.emulated.forward_seconds(cfg.compute_forward), time.sleep)
        self.backward = BackwardCompute(self.model, lambda: self.emulated.forward_seconds(cfg.compute_backward),
                                        time.sleep)
        self.rng = np.random.default_rng([cfg.seed, comm.rank + 1, 7])
        self.every, self.target, self.budget = float(flags.get("eval_every_s", 2.0)), target, budget
        self._evaluate = default_evaluate(self.workload.loss)
        self._test = list(self.workload.data().test_batches(cfg.eval_batch_size)) if comm.rank == 0 else None
        self.evals: list[tuple[float, float]] = []  # rank 0: (seconds of training, validation loss)
        self._paused, self._last, self._start = 0.0, -math.inf, time.perf_counter()

    def start(self) -> None:
        """The clock starts (after every replica is set up)."""
        self._start = time.perf_counter()

    def evaluate_if_due(self) -> bool:
        """Rank 0: evaluate if ``--eval-every-s`` seconds of training have passed since the last; whether
        training stops (the target reached, or the budget spent)."""
        import torch

        t0 = time.perf_counter()
        if t0 - self._start - self._paused < self._last + self.every:
            return False
        self.model.eval()
        with torch.no_grad():
            loss = self._evaluate(self.model, self._test)["loss"]
        self.model.train()
        self._last = t0 - self._start - self._paused
        self.evals.append((self._last, loss))
        self._paused += time.perf_counter() - t0
        return loss <= self.target or self._last >= self.budget

    def step(self, step: int, module=None) -> None:
        """One batch's forward and backward passes through ``module`` (default: the model; DDP's wrapper),
        padded to the emulated compute."""
        t = time.perf_counter()
        x, y = self.batches.batch(step)
        self.backward.begin()
        self.workload.loss(module if module is not None else self.model, (x, y)).backward()
        time.sleep(self.emulated.sleep_after(time.perf_counter() - t, self.rng))


def parser(doc: str, *, seeds: list[int]) -> argparse.ArgumentParser:
    """The options every benchmark shares: ``--seeds`` and the hpcps train options after ``--``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", nargs="+", type=int, default=seeds)
    p.add_argument("--emulate", metavar="OPTIONS",
                   help="run every job in a cluster in a box: hpcps emulate's options as one string, e.g. "
                        "'--nodes {np} --link 1gbit --link 0=4gbit', where {np} is the job's rank count and {last} "
                        "its last rank (root or a user namespace; the ranks must match the job's)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: more hpcps train options")
    return p


def train_options(args: argparse.Namespace) -> list[str]:
    """The hpcps train options given after ``--``."""
    return [x for x in args.train_args if x != "--"]


def torchft_version() -> str:
    """torchft's version, for a row's name (the peer's version belongs beside its figure)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchft")
    except PackageNotFoundError:
        return "(not installed)"


def torchft_lighthouse() -> str:
    """torchft's lighthouse program: the one installed beside this Python (the venv torchft came in), else
    whichever ``torchft_lighthouse`` is on PATH."""
    return shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) or "torchft_lighthouse"


def fmt(values: list[float], digits: int) -> str:
    """mean ± standard deviation, ignoring NaN (runs that never got there), which are counted."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return "never"
    miss = f" ({len(values) - len(vals)} missed)" if len(vals) < len(values) else ""
    return f"{np.mean(vals):.{digits}f} ± {np.std(vals):.{digits}f}{miss}"
