"""``hpcps supervise``: launch a job again, without a person, when it fails for a reason that is not the user's.

The job resumes itself: its ``hpcps train`` takes ``--resume auto`` (the newest complete checkpoint of its
checkpoint directory, or a fresh start) and ``--checkpoint-every``/``--checkpoint-interval``, so each launch
continues from the last checkpoint of the one before. What a restart cost (the gradients pushed again,
the seconds lost) is in the resumed launch's run file, its ``restart`` attribute.

Which endings are final is pure policy (:func:`verdict`): a clean end (status 0, also a run that a stop
signal ended with a checkpoint), bad input (2: the same command would fail again), a diverged run (3:
restarting would diverge again), and a supervisor that was itself told to stop (it passes the signal on to
the job). Anything else, a rank that died, was killed, or took the launcher down, is a failure to restart
after ``delay`` seconds, up to ``restarts`` times. So is a status 0 from a launch whose hpcps run began and
never finished: each launch names a mark file (``HPCPS_LAUNCH_MARK``, in the working directory, which a
job's nodes usually share) where rank 0 writes ``started`` and then ``finished``; Open MPI's launcher under
``--with-ft ulfm`` returns 0 whatever the ranks did. A launch that wrote no mark (not hpcps, or a rank 0
that cannot see the file) is taken at its status. Outside a scheduler the command runs again as written,
on the same hosts. Inside a Slurm allocation (``--no-kill``: a failed node does not end the job) an
``srun`` command runs again on the allocation's nodes that sinfo says are alive, with as many ranks per
node as before: the run resumes on that smaller shape (hpcps resumes a checkpoint on another shape).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Sequence

from hpcps.runtime.faults import ATTEMPT_VAR, MARK_VAR

log = logging.getLogger("hpcps")

#: exit statuses that end supervision: what they mean (hpcps.errors.UserError, hpcps.errors.DIVERGED_STATUS)
FINAL = {0: "finished", 2: "bad input: the same command would fail again",
         3: "training diverged: a restart would diverge again"}


def verdict(status: int, stopped: bool, unfinished: bool = False) -> str | None:
    """Why supervision ends after a launch that exited with ``status`` (negative: killed by that signal),
    or None to launch again; ``stopped``: the supervisor itself was told to stop; ``unfinished``: the run
    began and never finished, whatever the status says."""
    if stopped:
        return "stopped by a signal"
    if unfinished and status == 0:
        return None
    return FINAL.get(status)


def describe(status: int, unfinished: bool = False) -> str:
    """``status 1`` or ``killed by SIGKILL``; a status 0 of a run that never finished says so."""
    if unfinished and status == 0:
        return "status 0, its run unfinished (the launcher said 0 for a run whose rank 0 never reached its end)"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    if status > 128 and status - 128 in signal.valid_signals():
        return f"status {status} (a rank killed by {signal.Signals(status - 128).name}?)"
    return f"status {status}"


#: Slurm node states in which a node takes no new job step (sinfo's short names; a trailing * says the
#: node does not respond)
_DEAD_STATES = ("down", "drain", "drng", "fail", "failg", "maint", "boot", "npc", "pow_dn", "pow_up", "unk")


def alive_nodes(sinfo_lines: Sequence[str]) -> list[str]:
    """The nodes of ``sinfo -h -N -o '%N %t'`` output that can run a step: responding, not down, drained
    or failing."""
    alive = []
    for line in sinfo_lines:
        parts = line.split()
        if len(parts) != 2:
            continue
        node, state = parts
        if state.endswith(("*", "~", "#", "!", "%", "$", "@", "^", "-")) or state.lower() in _DEAD_STATES:
            continue
        if node not in alive:
            alive.append(node)
    return alive


def srun_on(command: Sequence[str], nodes: Sequence[str], tasks_per_node: int) -> list[str]:
    """``command`` (an ``srun ...`` line) run on ``nodes`` only, ``tasks_per_node`` ranks each: what a
    relaunch inside an allocation that lost nodes needs (``--no-kill`` kept it)."""
    if not command or os.path.basename(command[0]) != "srun":
        return list(command)
    return [command[0], f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * tasks_per_node}",
            f"--nodelist={','.join(nodes)}", *command[1:]]


def slurm_relaunch(command: Sequence[str], environ) -> list[str]:
    """Inside a Slurm allocation, an ``srun`` command on the allocation's nodes still alive (sinfo); the
    command unchanged elsewhere, or where Slurm cannot be asked."""
    nodelist, per_node = environ.get("SLURM_JOB_NODELIST"), environ.get("SLURM_NTASKS_PER_NODE", "")
    if not nodelist or not command or os.path.basename(command[0]) != "srun" or not per_node.isdigit():
        return list(command)
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-n", nodelist, "-o", "%N %t"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        log.warning("hpcps supervise: sinfo could not say which nodes are alive: launching on all of them")
        return list(command)
    nodes = alive_nodes(out.splitlines())
    if not nodes:
        return list(command)
    log.info("hpcps supervise: launching on the %d node(s) still alive: %s", len(nodes), ",".join(nodes))
    return srun_on(command, nodes, int(per_node))


@dataclass
class Launch:
    """One launch of the job: when it began and ended (wall time), and how."""

    attempt: int
    began: float
    ended: float = 0.0
    status: int = 0
    unfinished: bool = False  # its hpcps run began and never finished (the launch's mark says)


@dataclass
class Supervisor:
    """Run ``command`` until it ends for good (:func:`verdict`), at most ``restarts`` times again."""

    command: Sequence[str]
    restarts: int = 3
    delay: float = 1.0
    launches: list[Launch] = field(default_factory=list)
    _stop: int | None = None  # the signal the supervisor was told to stop by
    _child: subprocess.Popen | None = None

    def run(self) -> int:
        """Launch until done; return the last launch's exit status (as a shell gives it: 128 + signal; 1 for
        a status 0 whose run never finished)."""
        if not any(a == "auto" and b == "--resume" for b, a in zip(self.command, self.command[1:])) \
                and "--resume=auto" not in self.command:
            log.warning("hpcps supervise: the command has no --resume auto, so each launch starts from the "
                        "beginning (unless its --config file says so)")
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
        try:
            while True:
                launch = self._launch(len(self.launches) + 1)
                reason = verdict(launch.status, self._stop is not None, launch.unfinished)
                if reason is not None:
                    break
                if len(self.launches) > self.restarts:
                    reason = f"no restarts left (--restarts {self.restarts})"
                    break
                log.warning("hpcps supervise: launch %d ended with %s after %.1f s; launching again in %g s "
                            "(restart %d of %d)", launch.attempt, describe(launch.status, launch.unfinished),
                            launch.ended - launch.began, self.delay, launch.attempt, self.restarts)
                time.sleep(self.delay)
                if self._stop is not None:
                    reason = "stopped by a signal"
                    break
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        log.info("hpcps supervise: %s after %d launch(es), last %s", reason, len(self.launches),
                 describe(launch.status, launch.unfinished))
        if launch.unfinished and launch.status == 0:
            return 1  # the launcher's 0 is not the run's
        return launch.status if launch.status >= 0 else 128 - launch.status

    def _launch(self, attempt: int) -> Launch:
        launch = Launch(attempt, time.time())
        self.launches.append(launch)
        command = list(self.command) if attempt == 1 else slurm_relaunch(self.command, os.environ)
        mark = os.path.abspath(f".hpcps-launch.{os.getpid()}.{attempt}")
        # its own process group: a signal the supervisor passes on reaches the launcher, which passes it on
        self._child = subprocess.Popen(command, env={**os.environ, ATTEMPT_VAR: str(attempt), MARK_VAR: mark},
                                       start_new_session=True)
        launch.status = self._child.wait()
        launch.ended = time.time()
        self._child = None
        try:
            with open(mark) as f:
                launch.unfinished = f.read().strip() == "started"
            os.remove(mark)
        except OSError:  # no mark: not an hpcps run, or its rank 0 could not reach the file
            pass
        return launch

    def _on_signal(self, signum, frame) -> None:
        """Stop for good, and tell the job (a stop signal makes hpcps write a checkpoint and end)."""
        self._stop = signum
        child = self._child
        if child is not None and child.poll() is None:
            try:
                os.kill(child.pid, signum)
            except ProcessLookupError:
                pass
