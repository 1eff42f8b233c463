#!/usr/bin/env python3
"""A shard's work per gradient against a plain memory copy of the same bytes, in one run (no MPI).

What a shard does with a gradient once it has arrived, on this machine's
memory, through hpcps's own code:

* ``check``: the finiteness check (:func:`hpcps.transport.compress.all_finite`), and
  the ``isfinite(...).all()`` it replaced, for comparison;
* ``step``: one optimizer step of the shard's slice from one gradient
  (:class:`~hpcps.training.optim.ShardOptimizer`, chunked, as an asynchronous
  paradigm applies every gradient), with the check first;
* ``round``: adding a gradient to a BSP round's sum
  (:class:`~hpcps.runtime.rounds.RoundSum`), with the check first.

Each is timed as the median of ``--reps`` repetitions that alternate with
the copy (``torch.Tensor.copy_`` of the gradient's bytes into another
buffer: one read and one write per byte), so both see the same noise. Printed
per optimizer: GB/s of gradient and the time over the copy's; the copy
moves 2 bytes of memory traffic per gradient byte, so ``2 x ratio`` is the
shard's effective traffic per gradient byte where both are memory-bound.
The last line is ``ratio vs copy: X.XX``, the worst of step and round (the
issue's target: within 3x of a copy).

    python tools/bench_shard_apply.py                   # 16 MiB of gradient, sgd and adam
    python tools/bench_shard_apply.py --mib 64 --optimizer adamw
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from hpcps.runtime.rounds import RoundSum
from hpcps.transport.compress import all_finite
from hpcps.training.optim import ShardOptimizer, builtin_optimizer


def _alternate(fn, baseline, reps: int) -> tuple[float, float]:
    """Median seconds of ``fn`` and of ``baseline``, run alternately ``reps`` times after a warm-up."""
    fn(), baseline()
    a, b = [], []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        baseline()
        b.append(time.perf_counter() - t)
    return float(np.median(a)), float(np.median(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=16.0, help="gradient size in MiB (default 16)")
    parser.add_argument("--optimizer", action="append", choices=["sgd", "adam", "adamw"],
                        help="optimizers to step (default sgd and adam)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, as a shard runs (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = int(args.mib * (1 << 20)) // 4
    grad = torch.randn(n)
    other = torch.empty(n)
    copy = lambda: other.copy_(grad)  # noqa: E731
    nbytes = 4 * n

    def line(name: str, t: float, base: float) -> float:
        print(f"{name:<28} {nbytes / t / 1e9:7.2f} GB/s   {t / base:6.2f}x the copy ({base * 1e3:.2f} ms)")
        return t / base

    print(f"{args.mib:g} MiB of gradient, {args.threads} torch thread(s); copy = one read and one write per byte")
    line("check: isfinite().all()", *_alternate(lambda: bool(torch.isfinite(grad).all()), copy, args.reps))
    line("check: all_finite", *_alternate(lambda: all_finite(grad), copy, args.reps))
    worst = 0.0
    for name in args.optimizer or ["sgd", "adam"]:
        params = torch.randn(n)
        opt = ShardOptimizer(params, builtin_optimizer(name, lr=1e-3), lambda v: 1.0)

        def step() -> None:
            assert all_finite(grad)
            opt.step([grad], [1.0], version=0, factor=1.0)
        worst = max(worst, line(f"step ({name}, check first)", *_alternate(step, copy, args.reps)))
    rounds = RoundSum(n, n, 1, {0})  # one worker: every add closes nothing, the sum just grows

    def add() -> None:
        rounds.arrive(0)
        rounds.add_ready(lambda w: (grad if all_finite(grad) else None, 1.0))
        rounds.finite.clear()  # the same worker's gradient again: a new round without zeroing the sum
        rounds.arrived.clear()
        rounds._next = 0
    worst = max(worst, line("round sum (check first)", *_alternate(add, copy, args.reps)))
    print(f"ratio vs copy: {worst:.2f}")


if __name__ == "__main__":
    main()
