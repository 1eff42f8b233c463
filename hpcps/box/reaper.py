"""``python -m hpcps.box.reaper PREFIX``: wait for the owner's pipe to close, then remove box PREFIX.

Started by :class:`hpcps.box.net.Reaper`; see there why.
"""

import signal
import sys

from hpcps.box.net import remove


def main() -> None:
    prefix = sys.argv[1]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # only the pipe ends the wait
        signal.signal(sig, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    remove(prefix)


if __name__ == "__main__":
    main()
