"""Build, find and remove boxes: the mechanism behind :mod:`hpcps.box.spec`.

Every name a box creates starts with ``hpcps<pid>-``, the pid of the
``hpcps emulate`` that owns it, and everything lives inside the box's own
network namespaces (links, the bridge, the qdiscs, the addresses): deleting
the namespaces removes all of it, and the host's network is never touched.
A box whose owner is gone is *stale*: the next ``hpcps emulate`` removes it
before it starts, and so does ``hpcps emulate --cleanup``. While a box
runs, a reaper process (``python -m hpcps.box.reaper``, in a session of its
own) holds a pipe from its owner; if the owner dies, even by SIGKILL, the
pipe closes and the reaper kills whatever still runs in the namespaces and
deletes them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

from hpcps.box.spec import Cluster, box_pid, setup_commands
from hpcps.errors import UserError


class BoxError(UserError):
    """The box cannot be built here (platform, privileges, a missing tool or qdisc)."""


#: the start of the line that says this host will not make network namespaces for us
NEEDS_ROOT = "hpcps emulate needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces"
#: set in the user namespace ``hpcps emulate`` re-runs itself in when it is not root
USERNS_VAR = "HPCPS_BOX_USERNS"
#: the shell line that gives the user namespace its own /run (``ip netns`` keeps its names in /run/netns)
_PRIVATE_RUN = 'mount -t tmpfs hpcps-box /run && exec "$@"'


def check_host() -> None:
    """BoxError, saying what is missing, unless this machine can build a box (as root or in a user namespace)."""
    if not sys.platform.startswith("linux"):
        raise BoxError(f"hpcps emulate needs Linux network namespaces; this is {sys.platform}")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise BoxError(f"hpcps emulate needs {' and '.join(missing)} from iproute2 on PATH "
                       "(Debian: apt-get install iproute2)")


def needs_user_namespace() -> bool:
    """Not root, and not yet inside the user namespace hpcps emulate makes for itself."""
    return os.geteuid() != 0 and os.environ.get(USERNS_VAR) != "1"


def user_namespace_argv(argv: list[str]) -> list[str]:
    """``argv`` run as root of a new user namespace with its own network and mount namespaces and /run.

    Unprivileged users may create these where the kernel allows (``user.max_user_namespaces``, and no
    distribution policy against it). Everything the box makes then lives inside that namespace and
    goes with its last process, whatever ends it. Raises BoxError, naming what failed, if it cannot.
    """
    unshare = shutil.which("unshare")
    prefix = [unshare or "unshare", "--user", "--map-root-user", "--net", "--mount", "--propagation", "private",
              "sh", "-c", _PRIVATE_RUN, "sh"]
    said = "no unshare (util-linux) on PATH" if unshare is None else None
    if said is None:
        done = _run(prefix + ["ip", "netns", "add", "hpcps0-probe"])
        said = None if done.returncode == 0 else " ".join((done.stderr or done.stdout).split())
    if said is not None:
        raise BoxError(f"{NEEDS_ROOT}, or unprivileged user namespaces, which failed here: {said}")
    return prefix + argv


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def _explain(argv: list[str], stderr: str) -> str:
    """One line: what failed, and what is missing, from the tool's own words."""
    said = " ".join(stderr.split())
    cmd = " ".join(argv[:6])
    if "Operation not permitted" in said or "Permission denied" in said:
        return f"{NEEDS_ROOT}; `{cmd}` said: {said}"
    if argv[0] == "tc" and ("Unknown qdisc" in said or "qdisc kind is unknown" in said or "No such file" in said):
        return f"this kernel has no tbf qdisc (module sch_tbf), which shapes the links; `{cmd}` said: {said}"
    if "veth" in argv and ("Unknown device type" in said or "not supported" in said.lower()):
        return f"this kernel has no veth links (module veth); `{cmd}` said: {said}"
    if "congctl" in argv and "congestion algorithm" in said:
        offered = _read(AVAILABLE_CONGESTION).strip() or "none it lists"
        return (f"this kernel has no TCP congestion control named {argv[-1]} (it offers {offered}): give "
                f"--congestion one of them, or --congestion host for the host's own; `{cmd}` said: {said}")
    return f"building the box failed: `{' '.join(argv)}` said: {said}"


#: the kernel's TCP congestion controls, loaded or built in
AVAILABLE_CONGESTION = "/proc/sys/net/ipv4/tcp_available_congestion_control"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def build(cluster: Cluster) -> None:
    """Create the box; on any failure remove what was made and raise BoxError with one line."""
    try:
        for argv in setup_commands(cluster):
            done = _run(argv)
            if done.returncode != 0:
                raise BoxError(_explain(argv, done.stderr or done.stdout))
    except BaseException:
        remove(cluster.prefix)
        raise


@contextlib.contextmanager
def built(cluster: Cluster) -> Iterator[Reaper]:
    """The box's lifetime: ``cluster`` built on entry and removed on exit, however the block ends, and by a
    :class:`Reaper` if this process dies inside it. Yields the reaper, to tell it of a job to kill with
    the box (:meth:`Reaper.job`)."""
    reaper = Reaper(cluster.prefix)  # from here on the box goes, however this process ends
    try:
        build(cluster)
        yield reaper
    finally:
        remove(cluster.prefix)
        reaper.close()


def namespaces() -> list[str]:
    """Every network namespace name on this host (``ip netns list``), without its ``(id: N)``."""
    done = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def pids(prefix: str) -> list[int]:
    """Processes running in the namespaces named ``prefix*`` (the ranks of a box's job)."""
    found: list[int] = []
    for ns in namespaces():
        if ns.startswith(prefix):
            found += [int(w) for w in _run(["ip", "netns", "pids", ns]).stdout.split() if w.isdigit()]
    return found


def pids_in(ns: str) -> list[int]:
    """Processes running in the namespace ``ns`` (one node's)."""
    return [int(w) for w in _run(["ip", "netns", "pids", ns]).stdout.split() if w.isdigit()]


def remove(prefix: str) -> list[str]:
    """Kill what runs in, and delete, every namespace named ``prefix*``; return their names.

    Nodes go first and the switch last; deleting a namespace destroys its links and qdiscs.
    """
    mine = sorted((ns for ns in namespaces() if ns.startswith(prefix)), key=lambda ns: ns.endswith("-sw"))
    for pid in pids(prefix):  # the ranks of a job whose launcher died
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for ns in mine:
        _run(["ip", "netns", "delete", ns])
    return mine


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"hpcps" in f.read()
    except OSError:
        return False


def boxes() -> dict[str, bool]:
    """Every box on this host, by prefix, and whether its owner still runs (this process counts)."""
    owners = sorted({box_pid(ns) for ns in namespaces()} - {None})
    return {f"hpcps{pid}-": pid == os.getpid() or _owner_alive(pid) for pid in owners}


def cleanup_stale() -> list[str]:
    """Remove every stale box; return the namespaces removed."""
    removed: list[str] = []
    for prefix, alive in boxes().items():
        if not alive:
            removed += remove(prefix)
    return removed


class Reaper:
    """A process that removes the box when its owner dies, however it dies.

    The owner keeps the write end of a pipe; the reaper (a new session, so a Ctrl-C or a
    killed process group does not take it along) reads until end of file, which comes when
    the owner closes it (:meth:`close`, after its own teardown) or when the kernel closes it
    for a dead owner.
    """

    def __init__(self, prefix: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "hpcps.box.reaper", prefix], stdin=subprocess.PIPE,
                                     start_new_session=True, close_fds=True)

    def job(self, pgid: int, *, done: bool = False) -> None:
        """Tell the reaper of a job in process group ``pgid`` (killed if this process dies before it says
        ``done``)."""
        if self.proc.stdin is not None:
            self.proc.stdin.write(f"{'done' if done else 'job'} {pgid}\n".encode())
            self.proc.stdin.flush()

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
