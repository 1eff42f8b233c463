#!/usr/bin/env python3
"""Run the same job under several paradigms, scenarios and seeds; print comparison tables.

Each run is a real ``mpiexec -n NP hpcps train`` job; results are read back
from the HDF5 files (h5py only). Scenarios: ``homogeneous`` (as given) and
``heterogeneous`` (the last worker ``--straggler`` times slower) and, in a box, ``slow-link`` (the
last worker's link at ``--slow-link``: a network straggler). Ratios are
against BSP in the same scenario and invocation, because absolute times on a
shared machine are noise.

Every paradigm runs at the same ``--lr``, which hpcps divides by the updates
a paradigm applies per step of every worker (``--lr-scaling auto``, its
default: 1 for bsp and hsp, the group count for grouped, the worker count
for the asynchronous ones), so every paradigm moves the model as far per
training sample; each row names the rate per update. A paradigm of your own
(``path/file.py:Class``, ``pkg.mod:Class``) runs as the built-ins do, with
``--paradigm-option NAME=VALUE`` (given to plug-ins only). ``--lr-staleness none inverse`` runs the
paradigms that can see staleness both ways. The last line is the ratio of
the fastest paradigm's time to target to BSP's, in the last scenario.
``--ssp-staleness 0 1 2 3 4`` runs ssp at each fixed threshold; ``--layout NAME=OPTIONS`` (repeatable)
runs every paradigm but auto once more with OPTIONS added (a layout: ``--pull``, ``--partition-mb``,
``--servers``...), its rows named ``paradigm [NAME]``: a grid of paradigms by layouts, against which auto,
which chooses the paradigm and leaves the layout to its defaults, is measured. ``--emulate`` runs every job in a
cluster in a box (``{np}``: the job's ranks, ``{last}``: its last rank, the straggler's). ``auto``
(``--paradigm auto``) runs as a paradigm, with ``--from-launch``: every row's wall time and time to target
then count from the command's launch (start-up, and auto's trials: what its user waits for), and a line
under the table names what auto chose in each run.

    python tools/bench_paradigms.py --paradigms bsp asp ssp dssp --seeds 0 1 2 \
        --scenarios homogeneous heterogeneous -- --compute-time 0.01 --eval-interval 0.05
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import shlex
import sys
import time
import tempfile
from pathlib import Path

import numpy as np

from benchlib import fmt, parser, train, train_options
from hpcps.options.config import AUTO_GROUPS
from hpcps.policies import policy_class
from hpcps.plugins import is_plugin
from hpcps.analysis.report import worker_rates
from hpcps.options.targets import Target

#: paradigms whose workers can know a gradient's staleness (bsp's, hsp's rounds and grouped's groups never are)
SEES_STALENESS = ("asp", "ssp", "dssp", "eager")


def goal(spec: str) -> Target:
    """``--target``: an accuracy to reach (``0.9``), or ``loss<=VALUE`` / ``accuracy>=VALUE`` (a language
    model's evaluation gives a loss and no accuracy)."""
    try:
        target = Target("accuracy", ">=", float(spec))
    except ValueError:
        try:
            target = Target.parse(spec)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    if target.name not in ("loss", "accuracy"):
        raise argparse.ArgumentTypeError(f"{spec}: the bench reads the evaluation's loss or accuracy, "
                                         f"not {target.name}")
    return target


def label(target: Target) -> str:
    """How the tables name the target: ``85%`` for an accuracy, ``loss 2.5`` for a loss."""
    return f"{target.value:.0%}" if target.name == "accuracy" else f"{target.name} {target.value:g}"


def run(np_: int, paradigm: str, seed: int, out: Path, extra: list[str], target: Target,
        emulate: str | None = None, from_launch: bool = False, timeout: float = 900) -> dict:
    launched = time.time()
    r = train(np_, out, ["--paradigm", paradigm, "--seed", str(seed), *extra], emulate=emulate, diverged_ok=True,
              timeout=timeout)
    it, s = r["it"], r["summary"]
    per_worker = list(worker_rates(it).values())
    # the run's t = 0 after the launch (start-up, --paradigm auto's trials too); a file without it, its creation
    started = r["clock_start"] or datetime.datetime.fromisoformat(r["start_time"]).timestamp()
    before = started - launched if from_launch else 0.0
    reached = target.first_time(r["ev"]["t"], r["ev"][target.name])
    return {"final": float(s[f"final_{target.name}"]), "wall": before + float(s["wall_s"]),
            "ttt": before + reached, "its": float(np.mean(per_worker)),
            "ttt_run": reached,  # from the run's own t = 0
            "workers": len(per_worker),  # the layout's (--servers auto puts a shard on every node of a box)
            "wait": float(it["wait_s"].mean() * 1e3), "chose": r["paradigm"],
            "stopped": str(s.get("stopped_by", "")),  # "diverged": its watch ended it (a row says so)
            "stale": float(it["staleness"][it["staleness"] >= 0].mean())}  # of the gradients applied (-1: dropped)


def main() -> None:
    p = parser(__doc__, seeds=[0, 1, 2])
    p.add_argument("--paradigms", nargs="+", default=["bsp", "asp", "ssp"])
    p.add_argument("--np", type=int, default=5, help="MPI ranks (default 5: 1 server + 4 workers)")
    p.add_argument("--scenarios", nargs="+", default=["heterogeneous"],
                   choices=["homogeneous", "heterogeneous", "slow-link"])
    p.add_argument("--slow-link", dest="slow_link", default="250mbit", metavar="RATE",
                   help="slow-link scenario (with --emulate): the last worker's node's link runs at RATE "
                        "(a network straggler; default 250mbit)")
    p.add_argument("--straggler", type=float, default=3.0, help="slowdown of the last worker when heterogeneous")
    p.add_argument("--target", type=goal, default=goal("0.9"),
                   help="accuracy whose first evaluation counts as time-to-target (runs are not stopped there), "
                        "or loss<=VALUE (a language model's)")
    p.add_argument("--paradigm-option", action="append", default=[], dest="paradigm_option", metavar="NAME=VALUE",
                   help="an option of the plug-in paradigms (repeatable), as hpcps train takes it")
    p.add_argument("--lr-staleness", nargs="+", default=[None], metavar="SCHEDULE",
                   help="--lr-staleness values to run the paradigms that see staleness with (default: as given)")
    p.add_argument("--keep", metavar="DIR",
                   help="keep every run's metrics file in DIR/SCENARIO/ (for hpcps report, e.g. at another "
                        "--target); default: a temporary directory")
    p.add_argument("--ssp-staleness", nargs="+", type=int, default=[], metavar="S", dest="ssp_staleness",
                   help="run ssp once per threshold S (e.g. 0 1 2 3 4: every fixed threshold DSSP's range covers)")
    p.add_argument("--layout", action="append", default=[], type=layout, metavar="NAME=OPTIONS",
                   help="run every paradigm but auto once more with OPTIONS added, its rows named "
                        "'paradigm [NAME]' (repeatable), e.g. 'reads 1 MB=--pull get --partition-mb 1'")
    p.add_argument("--from-launch", action="store_true", dest="from_launch",
                   help="wall time and time to target from the command's launch (needed with auto)")
    p.add_argument("--run-timeout", type=float, default=900, metavar="SECONDS", dest="run_timeout",
                   help="end a run that takes longer (default 900: 15 minutes; ResNet-18 at 100 Mbit/s in the box "
                        "takes 9 s a step)")
    p.add_argument("--groups", default="2",
                   help="grouped: group servers (extra ranks), or auto: 2 groups formed by measured speed")
    a = p.parse_args()
    if "slow-link" in a.scenarios and not a.emulate:
        p.error("the slow-link scenario needs --emulate (a cluster in a box)")
    if "auto" in a.paradigms and not a.from_launch:
        p.error("auto's trials come before its run's clock: give --from-launch, to time every row from its launch")
    names = [name for name, _ in a.layout]
    if len(set(names)) < len(names):
        p.error(f"--layout names {sorted({n for n in names if names.count(n) > 1})} twice: each names its rows")
    extra = train_options(a)
    rows = {}
    for scenario in a.scenarios:
        rows = {}
        with (contextlib.nullcontext(a.keep) if a.keep else tempfile.TemporaryDirectory()) as tmp:
            Path(tmp, scenario).mkdir(parents=True, exist_ok=True)
            for paradigm in a.paradigms:
                np_ = a.np + (n_groups(a) if paradigm == "grouped" else 0)  # the same workers, plus group servers
                slow = ["--slowdown", f"{np_ - 1}={a.straggler:g}"] if scenario == "heterogeneous" else []
                box = a.emulate + f" --link {{last}}={a.slow_link}" if scenario == "slow-link" else a.emulate
                thresholds = a.ssp_staleness if paradigm == "ssp" and a.ssp_staleness else [None]
                variants = [(x, b) for x in (a.lr_staleness if paradigm in SEES_STALENESS else [None])
                            for b in thresholds]
                layouts = [("", [])] + (a.layout if paradigm != "auto" else [])
                for (schedule, bound), (k, (where, laid)) in itertools.product(variants, enumerate(layouts)):
                    own = variant_options(paradigm, schedule, a) + laid
                    if bound is not None:
                        own += ["--staleness", str(bound)]
                    stem = paradigm.rpartition(":")[2] if is_plugin(paradigm) else paradigm
                    at = f"-layout{k}" if k else ""
                    rs = [run(np_, paradigm, s, Path(tmp, scenario, f"{stem}-{schedule}-{bound}{at}-{s}.h5"),
                              extra + slow + own, a.target, box, a.from_launch, a.run_timeout) for s in a.seeds]
                    name = variant_name(paradigm, schedule, a, extra + laid, rs[0]["workers"])
                    name += f", s={bound}" if bound is not None else ""
                    name += f" [{where}]" if where else ""
                    rows[name] = rs
                    print(f"  {scenario} {name}: done", file=sys.stderr)
        table(scenario, rows, a, extra)
    print(f"\n{verdict(rows, a.target)} ({a.scenarios[-1]})")


def layout(spec: str) -> tuple[str, list[str]]:
    """``--layout NAME=OPTIONS``: the row's name and the options (shell words) its runs add."""
    name, eq, options = spec.partition("=")
    words = shlex.split(options)
    if not eq or not name.strip() or not words:
        raise argparse.ArgumentTypeError(f"{spec!r}: give NAME=OPTIONS, e.g. 'reads 1 MB=--pull get "
                                         "--partition-mb 1'")
    return name.strip(), words


def n_groups(a) -> int:
    return AUTO_GROUPS if a.groups == "auto" else int(a.groups)


def verdict(rows: dict, target: Target) -> str:
    """The last line: which paradigm reached the target first, as a ratio of BSP's time."""
    times = {name: np.mean([r["ttt"] for r in rs]) for name, rs in rows.items()
             if all(not np.isnan(r["ttt"]) for r in rs)}
    if not times:
        return f"no paradigm reached {label(target)} in every run"
    best = min(times, key=times.get)
    bsp = next((t for name, t in times.items() if name.startswith("bsp")), float("nan"))
    return f"fastest to {label(target)}: {best}, time ratio to bsp {times[best] / bsp:.2f}"


def variant_options(paradigm: str, schedule: str | None, a) -> list[str]:
    """The options of this paradigm's runs: groups, plug-in options, staleness schedule."""
    own = ["--groups", str(a.groups)] if paradigm == "grouped" else []
    if is_plugin(paradigm):
        own += [arg for option in a.paradigm_option for arg in ("--paradigm-option", option)]
    return own + (["--lr-staleness", schedule] if schedule is not None else [])


def variant_name(paradigm: str, schedule: str | None, a, extra: list[str], workers: int) -> str:
    """The row's name: the paradigm and the rate per update that ``--lr-scaling`` makes of ``--lr`` for the
    run's ``workers`` (counted in its file: the layout decides them, not ``--np`` alone)."""
    if paradigm == "auto":
        return "auto (the chosen one's rate; trials counted)"
    cls = policy_class(paradigm)
    name = cls.name if is_plugin(paradigm) and cls.name else paradigm
    lr = float(extra[extra.index("--lr") + 1]) if "--lr" in extra else 0.1
    if "none" not in option_values(extra, "--lr-scaling"):
        lr *= cls.lr_scale(n_groups(a) if paradigm == "grouped" else workers)
    return f"{name} (lr {lr:g})" + (f", {schedule}" if schedule is not None else "")


def option_values(args: list[str], option: str) -> list[str]:
    """The values ``option`` takes in ``args`` (``--opt V`` or ``--opt=V``)."""
    return [args[k + 1] for k, arg in enumerate(args[:-1]) if arg == option] + \
        [arg.split("=", 1)[1] for arg in args if arg.startswith(option + "=")]


def _mean_reached(times: list[float]) -> float:
    """The mean time to the target of the runs that reached it (nan where none did: no ratio, no warning)."""
    reached = [t for t in times if np.isfinite(t)]
    return float(np.mean(reached)) if reached else float("nan")


def stopped_note(rs: list[dict], seeds: list[int]) -> str:
    """What a row's final cell adds for the runs their divergence watch ended (their final figures left
    out of the mean: a diverged model's), e.g. `` (diverged: seeds 0, 1)``; empty where none was."""
    stopped = [str(seed) for seed, r in zip(seeds, rs) if r["stopped"]]
    return f" (diverged: seed{'s' if len(stopped) > 1 else ''} {', '.join(stopped)})" if stopped else ""


def table(scenario: str, rows: dict, a, options: list[str]) -> None:
    bsp = next((rs for name, rs in rows.items() if name.startswith("bsp")), None)
    base = _mean_reached([r["ttt"] for r in bsp]) if bsp else float("nan")
    slow = {"heterogeneous": f", the last worker {a.straggler:g}x slower",
            "slow-link": f", the last worker's link at {a.slow_link}"}.get(scenario, "")
    slow += f", in a box: {a.emulate}" if a.emulate else ""
    launch = ", times from the launch" if a.from_launch else ""
    workers = sorted({r["workers"] for rs in rows.values() for r in rs})
    print(f"\n{scenario}: {'/'.join(map(str, workers))} workers{slow}, seeds {a.seeds}{launch}, "
          f"options: {' '.join(options)}\n")
    goal_ = label(a.target)
    in_run = f" {goal_} in the run s |" if a.from_launch else ""  # (the time to target without start-up)
    print(f"| paradigm | final {a.target.name} | wall s | time to {goal_} s | vs BSP |{in_run} iterations/s per worker | "
          "mean wait ms | mean staleness |")
    print("|---|---|---|---|---|" + ("---|" if in_run else "") + "---|---|---|")
    for paradigm, rs in rows.items():
        ttt = _mean_reached([r["ttt"] for r in rs])
        run_cell = f" {fmt([r['ttt_run'] for r in rs], 2)} |" if in_run else ""
        kept = [r["final"] for r in rs if not r["stopped"]]
        final = (fmt(kept, 3) if kept else "-") + stopped_note(rs, a.seeds)
        print(f"| {paradigm} | {final} | {fmt([r['wall'] for r in rs], 2)} | "
              f"{fmt([r['ttt'] for r in rs], 2)} | {ttt / base:.2f} |{run_cell} {fmt([r['its'] for r in rs], 0)} | "
              f"{fmt([r['wait'] for r in rs], 2)} | {fmt([r['stale'] for r in rs], 2)} |", flush=True)
    for paradigm, rs in rows.items():
        if paradigm.startswith("auto"):
            print(f"\nauto chose, seed by seed: {', '.join(r['chose'] for r in rs)}")


if __name__ == "__main__":
    main()
