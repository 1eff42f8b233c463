#!/usr/bin/env python3
"""BatchNorm running statistics under an asynchronous paradigm, against BSP's in the same invocation.

Each run is ``mpiexec -n NP hpcps train --model tools/bench_bn_stats.py:net``: the network of
``examples/train_script.py`` (two conv blocks with BatchNorm) with the BatchNorm momentum
``--bn-momentum`` (torch's default 0.1; a large one makes the running statistics follow each batch
closely), on digits. The running statistics are read from the saved model. For every BatchNorm layer it
prints the largest ``|running_mean|`` and the mean ``running_var`` of each paradigm, and last the largest
ratio between the asynchronous paradigm's and BSP's over the layers and seeds (1: the same).

    python tools/bench_bn_stats.py --workers 8 --paradigm asp --bn-momentum 0.1 0.5 --seeds 0 1 2 -- --steps 300
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from benchlib import parser, train, train_options

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from train_script import Net  # noqa: E402  (the example's network, to load the saved state_dict)


def net(n_classes: int = 10) -> Net:
    """The model plug-in: the example's network, its BatchNorm momentum from ``BENCH_BN_MOMENTUM``."""
    model = Net(n_classes)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = float(os.environ.get("BENCH_BN_MOMENTUM", "0.1"))
    return model


def statistics(path: Path) -> list[tuple[float, float]]:
    """``(max |running_mean|, mean running_var)`` of each BatchNorm layer of the saved model."""
    net = Net()
    net.load_state_dict(torch.load(path))
    return [(float(m.running_mean.abs().max()), float(m.running_var.mean()))
            for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]


def main() -> None:
    p = parser(__doc__, seeds=[0, 1, 2])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--paradigm", default="asp", help="the asynchronous paradigm to compare with bsp (default asp)")
    p.add_argument("--bn-momentum", nargs="+", type=float, default=[0.1], dest="bn_momentum")
    a = p.parse_args()
    options = ["--model", f"{Path(__file__).resolve()}:net", *train_options(a)]
    worst = {}
    with tempfile.TemporaryDirectory() as tmp:
        print("| BatchNorm momentum | seed | layer | bsp max abs mean | {0} max abs mean | bsp mean var | "
              "{0} mean var | {0} staleness |".format(a.paradigm))
        print("|---|---|---|---|---|---|---|---|")
        for momentum in a.bn_momentum:
            worst[momentum] = 0.0
            for seed in a.seeds:
                runs = {}
                for paradigm in ("bsp", a.paradigm):
                    out = Path(tmp, f"{paradigm}-{momentum}-{seed}.h5")
                    r = train(a.workers + 1, out, ["--paradigm", paradigm, "--seed", str(seed), *options],
                              env={"BENCH_BN_MOMENTUM": str(momentum)})
                    runs[paradigm] = (statistics(out.with_suffix(".pt")), float(r["it"]["staleness"].mean()))
                for layer, ((bm, bv), (am, av)) in enumerate(zip(runs["bsp"][0], runs[a.paradigm][0])):
                    print(f"| {momentum:g} | {seed} | {layer} | {bm:.3g} | {am:.3g} | {bv:.3g} | {av:.3g} | "
                          f"{runs[a.paradigm][1]:.1f} |", flush=True)
                    worst[momentum] = max(worst[momentum], am / bm, av / bv, bm / am, bv / av)
    print()
    for momentum, ratio in worst.items():
        print(f"BatchNorm momentum {momentum:g}: largest ratio between {a.paradigm}'s and bsp's statistics "
              f"(either way) {ratio:.3g}")


if __name__ == "__main__":
    main()
