#!/usr/bin/env python3
"""Check ``hpcps simulate`` against real emulated runs at 4, 8 and 16 workers.

One invocation: first calibration runs, none of them a validated size.
1 server + 1 worker whose pull goes with its push (examples/pull_with_push.py:
asp as it was before it read its own writes) gives the per-iteration overhead
on this machine (median iteration time minus compute time), the model's
transfer latency L. 1 server + n = 1, 2, 3, 5, 6 workers under bsp, the last one
``--straggler`` times slower, give the server's costs: such a round takes
straggler x compute + 2L + server_s (the straggler's push) + n x update_s
(closing the round: a row, a receipt and a grant per gradient), and a
least-squares line through the five round times gives update_s (slope)
and server_s (intercept). (The sizes straddle 4 and lie below 8 and 16:
with a range of one to three workers the slope was within its noise.) Then, for each
paradigm and worker count, a real run (``--compute-time``, the last worker
``--straggler`` times slower) and the model of the same job. Throughput is
iterations per second summed over workers, each over its own active time
(as ``hpcps report`` counts). Grouped runs have ``--groups`` group servers
(default 2) over contiguous blocks of workers. Printed: measured, predicted, and the error;
the last line is ``worst error: X%``.

    python tools/validate_simulator.py --workers 4 8 16 --paradigms bsp asp ssp grouped

With ``--link RATE`` (and ``--server-link RATE``) the validated runs go into a cluster in a box
(``hpcps emulate``, one rank per node, the server on node 0) and the model gets the same links
(:class:`hpcps.analysis.simulate.Links`): every transfer of the model's ``4 x parameters`` bytes is a flow on
the server's link. The server's costs are still calibrated on this machine without a box (they
are CPU, not network), the per-iteration overhead with 1 worker in the box, less its transfer.
Grouped is not modelled with links.

    python tools/validate_simulator.py --workers 4 8 16 --paradigms bsp asp ssp --link 200mbit \
        --server-link 1gbit --hidden 2048 --compute-time 0.05
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from benchlib import train
from hpcps.analysis.report import worker_rates
from hpcps.analysis.simulate import Links, Machine, simulate

#: the calibration's paradigm: one transfer's overhead per iteration, the pull overlapping the push
PULL_WITH_PUSH = f"{Path(__file__).resolve().parents[1] / 'examples' / 'pull_with_push.py'}:PullWithPush"


def _parameters(hidden: int | None) -> int:
    """Parameters of the MLP hpcps train builds on digits (64 inputs, 10 classes) with ``hidden`` units."""
    from hpcps.training.models import mlp

    model = mlp((64,), 10, **({"hidden": hidden} if hidden else {}))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--paradigms", nargs="+", default=["bsp", "asp", "ssp", "grouped"])
    p.add_argument("--groups", type=int, default=2, help="group servers of grouped runs (default 2)")
    p.add_argument("--compute-time", dest="compute_time", type=float, default=0.02)
    p.add_argument("--straggler", type=float, default=2.0, help="the last worker is this much slower (default 2)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hidden", type=int, help="the MLP's width (default: hpcps train's)")
    p.add_argument("--link", metavar="RATE", help="run the validated jobs in a box with workers' links of RATE")
    p.add_argument("--server-link", dest="server_link", metavar="RATE", help="with --link: the server's (default: RATE)")
    a = p.parse_args()
    common = ["--compute-time", str(a.compute_time), "--steps", str(a.steps), "--eval-interval", "1",
              *(["--hidden", str(a.hidden)] if a.hidden else [])]
    words = [a.link, f"0={a.server_link or a.link}"] if a.link else None
    box = f"--nodes {{np}} --link {a.link} --link 0={a.server_link or a.link}" if a.link else None
    nbytes = 4 * _parameters(a.hidden) if a.link else 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cal = train(2, Path(tmp) / "calibrate.h5", ["--paradigm", PULL_WITH_PUSH, *common], emulate=box)["it"]
        overhead = float(np.median(cal["t_end"] - cal["t_start"] - cal["compute_s"]))
        if words:  # the 1-worker iteration in the box also moves the model once each way, overlapped
            overhead = max(0.0, overhead - nbytes / min(Links.from_words(words, 1).workers[0],
                                                        Links.from_words(words, 1).server))
        sizes, rounds = [1, 2, 3, 5, 6], []
        for n in sizes:
            slow = ["--slowdown", f"{n}={a.straggler:g}"] if a.straggler > 1 else []
            cal = train(n + 1, Path(tmp) / f"calibrate-bsp-{n}.h5", ["--paradigm", "bsp", *common, *slow])["it"]
            rounds.append(float(np.median(cal["t_end"] - cal["t_start"])))
        update_s, intercept = np.polyfit(sizes, rounds, 1)
        update_s = max(0.0, float(update_s))
        server_s = max(0.0, float(intercept) - max(a.straggler, 1.0) * a.compute_time - 2 * overhead)
        machine = Machine(latency=overhead, bandwidth=1e12, server_s=server_s, apply_rate=1e12, update_s=update_s)
        for paradigm in a.paradigms:
            for n in a.workers:
                groups = a.groups if paradigm == "grouped" else 0
                last = n + groups  # the last worker's rank: after the server and the group servers
                slow = ["--slowdown", f"{last}={a.straggler:g}"] if a.straggler > 1 else []
                grouped = ["--groups", str(groups)] if groups else []
                it = train(n + 1 + groups, Path(tmp) / f"{paradigm}-{n}.h5",
                           ["--paradigm", paradigm, *grouped, *common, *slow], emulate=box)["it"]
                measured = sum(worker_rates(it).values())
                predicted = simulate(paradigm, n, steps=a.steps, nbytes=nbytes, compute_time=a.compute_time,
                                     slowdown={n - 1: a.straggler}, machine=machine, groups=a.groups,
                                     links=Links.from_words(words, n) if words else None).throughput
                rows.append((paradigm, n, measured, predicted, predicted / measured - 1))
    if a.link:
        print(f"in a box: workers' links {a.link}, the server's {a.server_link or a.link}, "
              f"{nbytes / 1e6:.2f} MB per transfer")
    print(f"compute {a.compute_time * 1e3:g} ms, last worker {a.straggler:g}x slower, {a.steps} steps; "
          f"calibrated: transfer {overhead * 1e3:.2f} ms (1 worker, pull with push); server {server_s * 1e3:.3f} ms per push "
          f"and {update_s * 1e3:.3f} ms per gradient of a closing update (1-6 workers, bsp: rounds of "
          f"{', '.join(f'{r * 1e3:.1f}' for r in rounds)} ms)\n")
    print("| paradigm | workers | measured iterations/s | predicted | error |")
    print("|---|---|---|---|---|")
    for paradigm, n, measured, predicted, err in rows:
        print(f"| {paradigm} | {n} | {measured:.1f} | {predicted:.1f} | {err:+.1%} |")
    print(f"\nworst error: {max(abs(r[4]) for r in rows):.1%}")


if __name__ == "__main__":
    main()
