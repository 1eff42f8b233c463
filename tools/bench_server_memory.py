#!/usr/bin/env python3
"""A server shard's peak memory against the worker count: does it grow with N?

For each paradigm and worker count, one run of ``mpiexec -n N+1 hpcps train`` with a 19 MB model
(``--hidden 65536``: a 4.8M-parameter MLP) and emulated compute, then shard 0's peak resident
memory from the metrics file's ``/ranks`` table. Printed: MB per run and, per paradigm, the growth
from the smallest to the largest N in model sizes (target: below 2).

The runs use a fixed glibc mmap threshold (1 MiB) by default: glibc's dynamic threshold rises
to the size of the largest block freed, after which model-sized temporaries come from the heap
and stay resident when freed, so the peak depends on the timing of allocations (it moved by
3 model sizes between identical runs). ``--mmap-threshold 0`` measures with the default.

    python tools/bench_server_memory.py
    python tools/bench_server_memory.py --workers 2 4 8 --paradigms asp -- --steps 10
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import h5py

from benchlib import run_quietly
from hpcps.cluster.launcher import clean_environ, find_mpiexec


def shard0_peak(n_workers: int, paradigm: str, out: Path, extra: list[str], env: dict[str, str]) -> float:
    """Shard 0's peak RSS (bytes), from one run."""
    cmd = [find_mpiexec() or "mpiexec", "-n", str(n_workers + 1), sys.executable, "-m", "hpcps", "train",
           "--paradigm", paradigm, "--hidden", "65536", "--compute-time", "0.05", "--steps", "20",
           "--no-progress", "--divergence", "ignore",  # the memory is measured, not the training (asp on 2
           "--out", str(out), *extra]                   # workers at this width diverged and ended the tool)
    run_quietly(cmd, clean_environ(**env), 900)
    with h5py.File(out) as f:
        ranks = f["ranks"][()]
        return float(ranks[ranks["rank"] == 0]["peak_rss_bytes"][0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", nargs="+", type=int, default=[2, 8])
    p.add_argument("--paradigms", nargs="+", default=["asp", "bsp"])
    p.add_argument("--mmap-threshold", type=int, default=2 ** 20, metavar="BYTES",
                   help="glibc's MALLOC_MMAP_THRESHOLD_ for the runs (default 1 MiB; 0: the allocator's default, "
                        "whose dynamic threshold keeps freed model-sized blocks in the heap)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: more hpcps train options")
    a = p.parse_args()
    extra = [x for x in a.train_args if x != "--"]
    env = {"MALLOC_MMAP_THRESHOLD_": str(a.mmap_threshold)} if a.mmap_threshold else {}
    model_mb = 4 * (64 * 65536 + 65536 + 65536 * 10 + 10) / 2 ** 20  # digits: 64 inputs, 10 classes
    malloc = f"MALLOC_MMAP_THRESHOLD_={a.mmap_threshold}" if a.mmap_threshold else "glibc's default allocator"
    print(f"shard 0's peak RSS (MB), model {model_mb:.1f} MB, {malloc}\n")
    print("| paradigm | " + " | ".join(f"N={n}" for n in a.workers) + " | growth in model sizes |")
    print("|---|" + "---|" * (len(a.workers) + 1))
    with tempfile.TemporaryDirectory() as tmp:
        for paradigm in a.paradigms:
            peaks = [shard0_peak(n, paradigm, Path(tmp) / f"{paradigm}-{n}.h5", extra, env) / 2 ** 20
                     for n in a.workers]
            growth = (peaks[-1] - peaks[0]) / model_mb
            print(f"| {paradigm} | " + " | ".join(f"{x:.0f}" for x in peaks) + f" | {growth:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
