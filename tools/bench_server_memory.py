#!/usr/bin/env python3
"""A server shard's peak memory against the worker count: does it grow with N?

For each paradigm and worker count, one run of ``mpiexec -n N+1 hpcps train`` with a 19 MB model
(``--hidden 65536``: a 4.8M-parameter MLP) and emulated compute, then shard 0's peak resident
memory from the metrics file's ``/ranks`` table. Printed: MB per run and, per paradigm, the growth
from the smallest to the largest N in model sizes (target: below 2).

    python tools/bench_server_memory.py
    python tools/bench_server_memory.py --workers 2 4 8 --paradigms asp -- --steps 10
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py

from hpcps.launcher import clean_environ, find_mpiexec


def shard0_peak(n_workers: int, paradigm: str, out: Path, extra: list[str]) -> float:
    """Shard 0's peak RSS (bytes), from one run."""
    cmd = [find_mpiexec() or "mpiexec", "-n", str(n_workers + 1), sys.executable, "-m", "hpcps", "train",
           "--paradigm", paradigm, "--hidden", "65536", "--compute-time", "0.05", "--steps", "20",
           "--no-progress", "--out", str(out), *extra]
    subprocess.run(cmd, check=True, env=clean_environ(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                   timeout=900)
    with h5py.File(out) as f:
        ranks = f["ranks"][()]
        return float(ranks[ranks["rank"] == 0]["peak_rss_bytes"][0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", nargs="+", type=int, default=[2, 8])
    p.add_argument("--paradigms", nargs="+", default=["asp", "bsp"])
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: more hpcps train options")
    a = p.parse_args()
    extra = [x for x in a.train_args if x != "--"]
    model_mb = 4 * (64 * 65536 + 65536 + 65536 * 10 + 10) / 2 ** 20  # digits: 64 inputs, 10 classes
    print(f"shard 0's peak RSS (MB), model {model_mb:.1f} MB\n")
    print("| paradigm | " + " | ".join(f"N={n}" for n in a.workers) + " | growth in model sizes |")
    print("|---|" + "---|" * (len(a.workers) + 1))
    with tempfile.TemporaryDirectory() as tmp:
        for paradigm in a.paradigms:
            peaks = [shard0_peak(n, paradigm, Path(tmp) / f"{paradigm}-{n}.h5", extra) / 2 ** 20
                     for n in a.workers]
            growth = (peaks[-1] - peaks[0]) / model_mb
            print(f"| {paradigm} | " + " | ".join(f"{x:.0f}" for x in peaks) + f" | {growth:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
