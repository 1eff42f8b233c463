"""The recorded comparison of docs/migrating.md: pytorch/examples' imagenet/main.py (main_ddp.py here) in one
process against its port (main.py) under hpcps, on --dummy data, the first N progress lines of each.

Needs torchvision (not a dependency of hpcps; see docs/migrating.md for the environment it ran in) and an
mpiexec. Each run stops with SIGTERM once N lines are out: the original has no step limit (its epoch is
ImageNet's 1281167 images), the port stops at the step under way and writes its metrics.

    python compare.py 20 --dummy -a resnet18 -b 8 -j 0 --seed 0 -p 1 --epochs 1
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = tempfile.mkdtemp(prefix="imagenet-compare-")  # the runs' files (the port's metrics, its checkpoint)


def progress(n: int, argv: list[str], env: dict[str, str] | None = None) -> tuple[list[str], int]:
    """The first ``n`` training progress lines of ``argv``, then SIGTERM to its process group; and its status."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=WORK,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    lines = []
    for line in proc.stdout:
        if line.startswith("Epoch: [0]"):
            lines.append(line.rstrip())
            if len(lines) == n:
                os.killpg(proc.pid, signal.SIGTERM)
                break
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    return lines, proc.wait()


def main() -> int:
    n, args = int(sys.argv[1]), sys.argv[2:]
    without_times = lambda lines: [re.sub(r"Time .*?Loss", "Loss", line) for line in lines]  # noqa: E731
    t0 = time.time()
    # one torch thread, as hpcps gives each rank (a CPU kernel's reductions are split by the thread count)
    original, _ = progress(n, [sys.executable, os.path.join(HERE, "main_ddp.py"), *args], env={"OMP_NUM_THREADS": "1"})
    one, status1 = progress(n, ["mpiexec", "-n", "2", sys.executable, os.path.join(HERE, "main.py"), *args])
    two, status2 = progress(2 * n, ["mpiexec", "-n", "3", sys.executable, os.path.join(HERE, "main.py"), *args])
    same = without_times(one) == without_times(original)
    print(f"original, one process: {len(original)} lines; the port, one worker: {len(one)} lines, exit {status1}; "
          f"the same losses and accuracies line for line: {same}")
    print(f"the port, two workers: {len(two)} lines (both workers'), exit {status2}; {time.time() - t0:.0f} s; "
          f"the runs' files in {WORK}")
    for a, b in zip(without_times(original), without_times(one)):
        print(f"  {a}\n  {b}")
    return 0 if same and status1 == status2 == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
