"""Log lines tagged with rank and role: ``hpcps[r3 worker] ...``."""

from __future__ import annotations

import logging
import sys


def setup_logging(rank: int, role: str = "", *, verbose: bool = False) -> logging.Logger:
    """Rank 0 logs progress (INFO); other ranks only warnings, unless ``verbose``."""
    log = logging.getLogger("hpcps")
    log.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    tag = f"r{rank} {role}".strip()
    handler.setFormatter(logging.Formatter(f"%(asctime)s hpcps[{tag}] %(levelname)s: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 or verbose else logging.WARNING)
    log.propagate = False
    return log
