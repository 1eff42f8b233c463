"""Shared helpers of the benchmarks in tools/: launch real jobs, read their metrics, format tables."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

from hpcps.launcher import clean_environ, find_mpiexec


def train(np_: int, out: Path, options: list[str], timeout: float = 900, env: dict[str, str] | None = None) -> dict:
    """Run ``mpiexec -n NP hpcps train --out OUT OPTIONS`` (with ``env`` added to a clean environment);
    return the run's tables and summary."""
    cmd = [find_mpiexec() or "mpiexec", "-n", str(np_), sys.executable, "-m", "hpcps", "train", "--out", str(out), "--no-progress",
           *options]
    subprocess.run(cmd, check=True, env=clean_environ(**(env or {})), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout)
    with h5py.File(out) as f:
        return {"it": f["workers/iterations"][()], "up": f["servers/updates"][()], "ev": f["eval"][()],
                "summary": dict(f["summary"].attrs), "paradigm": str(f.attrs["paradigm"])}


def parser(doc: str, *, seeds: list[int]) -> argparse.ArgumentParser:
    """The options every benchmark shares: ``--seeds`` and the hpcps train options after ``--``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", nargs="+", type=int, default=seeds)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: more hpcps train options")
    return p


def train_options(args: argparse.Namespace) -> list[str]:
    """The hpcps train options given after ``--``."""
    return [x for x in args.train_args if x != "--"]


def fmt(values: list[float], digits: int) -> str:
    """mean ± standard deviation, ignoring NaN (runs that never got there), which are counted."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return "never"
    miss = f" ({len(values) - len(vals)} missed)" if len(vals) < len(values) else ""
    return f"{np.mean(vals):.{digits}f} ± {np.std(vals):.{digits}f}{miss}"
