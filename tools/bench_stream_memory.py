#!/usr/bin/env python3
"""Peak memory of every rank when the training set is an HDF5 file larger than a rank should hold.

Writes an HDF5 file of --gigabytes of float32 samples (1x32x32 each, integer
labels), trains on it streamed (workers read their own batches, rank 0 the
held-out set, other servers nothing), and prints each rank's peak resident
memory from the run's /ranks table next to the same job on a tiny in-memory
data set (digits), measured in the same invocation: the difference is what
the data cost each rank. The last line is the largest ratio of a rank's
peak memory to the file's size.

    python tools/bench_stream_memory.py --gigabytes 1.2 -- --steps 50
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np

from benchlib import parser, train, train_options


def write_file(path: Path, gigabytes: float, chunk: int = 8192) -> int:
    """float32 samples of 1x32x32 (4 KiB each) with integer labels, written chunk by chunk; return the count."""
    n = int(gigabytes * 1e9 // 4096)
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", (n, 1, 32, 32), np.float32, chunks=(64, 1, 32, 32))
        f["y"] = rng.integers(0, 10, n)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            x[lo:hi] = rng.standard_normal((hi - lo, 1, 32, 32), dtype=np.float32)
    return n


def ranks_of(out: Path) -> np.ndarray:
    with h5py.File(out) as f:
        return f["ranks"][()]


def main() -> None:
    p = parser(__doc__, seeds=[0])
    p.add_argument("--gigabytes", type=float, default=1.2)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write the file (default: a temporary directory)")
    a = p.parse_args()
    extra = ["--paradigm", "asp", "--servers", str(a.servers), "--model", "mlp", "--eval-interval", "5",
             *train_options(a)]
    n = a.servers + a.workers
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        data = Path(tmp) / "big.h5"
        samples = write_file(data, a.gigabytes)
        size = os.path.getsize(data)
        print(f"  wrote {size / 1e9:.2f} GB ({samples} samples)", file=sys.stderr)
        train(n, Path(tmp) / "stream.h5", ["--dataset", str(data), *extra])
        streamed = ranks_of(Path(tmp) / "stream.h5")
        train(n, Path(tmp) / "digits.h5", ["--dataset", "digits", *extra])
        baseline = ranks_of(Path(tmp) / "digits.h5")
    print(f"{a.servers} servers + {a.workers} workers, asp, HDF5 file of {size / 1e9:.2f} GB, "
          f"options: {' '.join(extra)}\n")
    print("| rank | role | samples read | peak RSS MB (streamed) | peak RSS MB (digits, in memory) | difference MB |")
    print("|---|---|---|---|---|---|")
    for s, b in zip(streamed, baseline):
        print(f"| {s['rank']} | {s['role'].decode()} | {s['samples_read']} | {s['peak_rss_bytes'] / 1e6:.0f} | "
              f"{b['peak_rss_bytes'] / 1e6:.0f} | {(s['peak_rss_bytes'] - b['peak_rss_bytes']) / 1e6:+.0f} |")
    worst = streamed["peak_rss_bytes"].max()
    print(f"\nlargest peak RSS / file size: {worst / size:.3f} ({worst / 1e6:.0f} MB against {size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
