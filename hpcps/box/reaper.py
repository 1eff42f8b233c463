"""``python -m hpcps.box.reaper PREFIX``: wait for the owner's pipe to close, then end the box's job and remove
box PREFIX.

Started by :class:`hpcps.box.net.Reaper`; see there why. The owner writes ``job PGID`` on the pipe when it
starts a job in a process group of its own, and ``done PGID`` once that job has ended; at end of file
every process group still named is killed (SIGKILL) before the namespaces go, so a launcher, its proxies
and its ranks go too, even when the namespaces they ran in are gone already.
"""

import os
import signal
import sys

from hpcps.box.net import remove


def main() -> None:
    prefix = sys.argv[1]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # only the pipe ends the wait
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    for line in sys.stdin.buffer:
        word, _, number = line.decode(errors="replace").strip().partition(" ")
        if number.isdigit():
            (groups.add if word == "job" else groups.discard)(int(number))
    doomed = {pid for pgid in groups for pid in tree(pgid)}  # the owner died with its job running
    for pgid in groups:
        _kill(lambda: os.killpg(pgid, signal.SIGKILL))
    for pid in doomed:  # (MPICH's proxies and ranks each lead a session of their own)
        _kill(lambda: os.kill(pid, signal.SIGKILL))
    remove(prefix)


def tree(root: int) -> set[int]:
    """``root`` and every process descended from it, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def _kill(send) -> None:
    try:
        send()
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    main()
