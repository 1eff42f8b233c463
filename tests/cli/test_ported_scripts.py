"""Public training scripts nobody here wrote, ported from DDP to hpcps (examples/ported/), run as their users
run them. nanoGPT's train.py (karpathy/nanoGPT): the port with one worker draws and trains what the original
single process does, step for step; with two workers it trains; a run it resumes from its own checkpoint goes
on at its iteration and keeps the earlier run file."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from launching import failure, launch, needs_mpiexec

ROOT = Path(__file__).resolve().parents[2]
NANOGPT = ROOT / "examples" / "ported" / "nanogpt"
#: a model and a run small enough for a test, on a character-level data set made of this repository's README
#: (nanoGPT's own prepare.py downloads Shakespeare)
ARGS = ["--device=cpu", "--compile=False", "--dataset=readme", "--n_layer=2", "--n_head=2", "--n_embd=32",
        "--block_size=32", "--batch_size=4", "--gradient_accumulation_steps=2", "--eval_interval=10",
        "--eval_iters=2", "--warmup_iters=5", "--lr_decay_iters=20", "--learning_rate=1e-3"]

pytestmark = [needs_mpiexec, pytest.mark.timeout(300)]


@pytest.fixture
def nanogpt(tmp_path) -> Path:
    """The two scripts, nanoGPT's model.py and configurator.py, and data/readme/{train,val}.bin, meta.pkl, as
    nanoGPT's prepare.py writes them."""
    for name in ("train.py", "train_ddp.py", "model.py", "configurator.py"):
        shutil.copy(NANOGPT / name, tmp_path / name)
    text = (ROOT / "README.md").read_text()
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], np.uint16)
    data = tmp_path / "data" / "readme"
    data.mkdir(parents=True)
    n = int(0.9 * len(ids))
    ids[:n].tofile(data / "train.bin")
    ids[n:].tofile(data / "val.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars)}, f)
    return tmp_path


def _losses(stdout: str) -> list[str]:
    """nanoGPT's own log: every iteration's loss and every evaluation, less the timings."""
    return [re.sub(r", time .*", "", line) for line in stdout.splitlines() if re.match(r"(iter|step) \d+:", line)]


def test_nanogpt_ported_with_one_worker_trains_as_the_original_single_process_step_for_step(nanogpt):
    # (with one torch thread, as hpcps gives each rank: a CPU kernel's reductions split by thread count)
    original = subprocess.run([sys.executable, "train_ddp.py", *ARGS, "--max_iters=20", "--out_dir=original"],
                              cwd=nanogpt, capture_output=True, text=True, timeout=240,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert original.returncode == 0, failure(original.stderr)
    port = launch(2, sys.executable, "train.py", *ARGS, "--max_iters=20", "--out_dir=port", cwd=str(nanogpt),
                  timeout=240)
    assert port.returncode == 0, failure(port.stderr)
    assert len(_losses(original.stdout)) == 21 + 3
    assert _losses(port.stdout) == _losses(original.stdout)  # reseed=False: the original's batches, its losses
    # the checkpoint nanoGPT wrote at its last evaluation (iteration 20): the same model, to the last bit
    mine, theirs = (torch.load(nanogpt / d / "ckpt.pt", weights_only=False) for d in ("port", "original"))
    assert mine["iter_num"] == theirs["iter_num"] == 20
    assert all(torch.equal(mine["model"][k], theirs["model"][k]) for k in theirs["model"])
    assert [g["lr"] for g in mine["optimizer"]["param_groups"]] == [g["lr"] for g in theirs["optimizer"]["param_groups"]]


def test_nanogpt_ported_trains_with_two_workers_and_resumes_from_its_own_checkpoint(nanogpt):
    """Two workers split the accumulation (1 micro-batch each, as DDP's ranks would); the run's file records
    both. Then nanoGPT's own resume (--init_from=resume, its ckpt.pt of iteration 10): the run goes on at
    iteration 10, its versions too, and the first run's metrics are kept beside the new ones."""
    first = launch(3, sys.executable, "train.py", *ARGS, "--max_iters=10", "--out_dir=out", cwd=str(nanogpt),
                   timeout=240)
    assert first.returncode == 0, failure(first.stderr)
    assert re.findall(r"^iter (\d+):", first.stdout, re.M) == [str(i) for i in range(11)]
    resumed = launch(3, sys.executable, "train.py", *ARGS, "--max_iters=20", "--out_dir=out", "--init_from=resume",
                     cwd=str(nanogpt), timeout=240)
    assert resumed.returncode == 0, failure(resumed.stderr)
    assert re.findall(r"^iter (\d+):", resumed.stdout, re.M) == [str(i) for i in range(10, 21)]
    assert "kept as " in resumed.stderr and (nanogpt / "out" / "hpcps.1.h5").exists()
    with h5py.File(nanogpt / "out" / "hpcps.h5") as f:
        rows = f["workers/iterations"][()]
        assert f.attrs["start_iteration"] == 10 and f.attrs["start_version"] == 10
        assert sorted(set(rows["step"].tolist())) == list(range(10, 21))
        assert sorted(set(rows["rank"].tolist())) == [1, 2] and np.isfinite(rows["loss"]).all()
        assert int(f["servers/updates"]["version"].min()) == 10
    with h5py.File(nanogpt / "out" / "hpcps.1.h5") as f:
        assert sorted(set(f["workers/iterations"]["step"].tolist())) == list(range(11))
