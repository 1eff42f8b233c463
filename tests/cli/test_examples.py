"""Every script and plug-in in examples/ runs, at a small size, as the user would launch it (mpiexec)."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import h5py
import pytest
import torch

from hpcps.runtime.checkpoints.files import read_user_state
from launching import failure, launch, needs_mpiexec

pytestmark = [needs_mpiexec, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _module(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + failure(proc.stderr)
    assert "Traceback" not in proc.stderr, failure(proc.stderr)


def test_the_script_trains_a_batchnorm_model_with_adamw_and_cosine_and_its_saved_model_loads_in_plain_torch(tmp_path):
    out = tmp_path / "runs" / "script.h5"
    proc = launch(5, sys.executable, str(EXAMPLES / "train_script.py"), "--steps", "80", "--out", str(out),
                  timeout=240, cwd=str(tmp_path))
    _ok(proc)
    example = _module("train_script")
    net = example.Net()
    net.load_state_dict(torch.load(out.with_suffix(".pt")))  # no hpcps import needed to load it
    net.eval()
    _, test = example.digits()
    x, y = test.tensors
    with torch.no_grad():
        accuracy = float((net(x).argmax(1) == y).double().mean())
    with h5py.File(out) as f:
        config = json.loads(f.attrs["config"])
        final = f["summary"].attrs["final_accuracy"]
        assert f.attrs["saved_model"] == str(out.with_suffix(".pt"))
        assert f["summary"].attrs["gradients_pushed"] == 4 * 80
    assert (config["paradigm"], config["optimizer"], config["lr_schedule"]) == ("dssp", "adamw", "cosine")
    assert accuracy == final  # the run's reported accuracy is the saved model's, computed in plain torch
    assert final > 0.7
    assert float(net.features[1].running_var.sub(1).abs().max()) > 1e-3  # the servers' BatchNorm statistics
    assert f"final accuracy {final:.4f}" in proc.stdout


def test_the_regression_example_loss_falls(tmp_path):
    out = tmp_path / "reg.h5"
    proc = launch(5, sys.executable, str(EXAMPLES / "regression.py"), "--steps", "200", "--out", str(out),
                  timeout=240, cwd=str(tmp_path))
    _ok(proc)
    with h5py.File(out) as f:
        loss = f["eval"]["loss"][-1]
        names = set(f["eval_metrics"]["name"].tolist())
        pushed = f["summary"].attrs["gradients_pushed"]
    assert pushed == 4 * 200 and names == {b"mae"}
    example = _module("regression")
    x = torch.linspace(-2, 2, 200).unsqueeze(1)
    predicting_zero = float(example.target(x).pow(2).mean())  # 0.52: the error of a net that learnt nothing
    # float targets, an MSE loss: it learns (0.04-0.08 here over 5 runs, ASP's staleness about 8)
    assert loss < 0.3 * predicting_zero, loss


def test_the_cnn_plugin_trains_on_an_hdf5_file_with_momentum_weight_decay_and_warmup(tmp_path):
    data = tmp_path / "digits.h5"
    _module("cnn_plugin").write_digits(str(data))
    out = tmp_path / "cnn.h5"
    proc = launch(5, sys.executable, "-m", "hpcps", "train", "--dataset", str(data),
                  "--model", f"{EXAMPLES / 'cnn_plugin.py'}:cnn", "--optimizer", "sgd", "--momentum", "0.9",
                  "--weight-decay", "5e-4", "--lr-schedule", "cosine", "--warmup-steps", "50", "--lr", "0.05",
                  "--steps", "150", "--out", str(out), timeout=240, cwd=str(tmp_path))
    _ok(proc)
    with h5py.File(out) as f:
        assert f["summary"].attrs["final_accuracy"] > 0.8
    state = torch.load(out.with_suffix(".pt"))  # saved beside the metrics by default
    assert "4.running_var" in state and "10.weight" in state  # BatchNorm statistics and the head


def test_the_api_ends_every_rank_with_one_line_on_bad_input(tmp_path):
    proc = launch(3, sys.executable, "-c", "import hpcps, torch\n"
                  "hpcps.train(model=lambda: torch.nn.Linear(64, 10), data='digits', paradigm='ssq', steps=5)",
                  timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == ["hpcps: error: --paradigm: unknown paradigm 'ssq' (known: asp, bsp, diloco, dssp, eager, "
                      "grouped, hsp, localsgd, ssp; or your own as path/to/file.py:Class or package.module:Class)"], proc.stderr


def _val_losses(stdout: str) -> list[float]:
    return [float(v) for v in re.findall(r"val loss ([0-9.]+)$", stdout, re.M)]


def test_the_nanogpt_style_loop_trains_under_bsp_ssp_and_dssp_and_resumes_its_own_fields(tmp_path):
    """The user's own loop (accumulation, bf16 autocast, clipping, AdamW with decay groups, warm-up and
    cosine to min_lr, validation every 10 iterations): the validation loss falls under every paradigm;
    the bsp run's checkpoint carries the loop's fields, and the resumed run continues from them."""
    small = ["--max-iters", "30", "--eval-interval", "10", "--eval-iters", "4", "--warmup-iters", "5"]
    script = str(EXAMPLES / "nanogpt_style.py")
    for paradigm in ("ssp", "dssp"):
        proc = launch(5, sys.executable, script, "--paradigm", paradigm, *small, "--out",
                      str(tmp_path / f"{paradigm}.h5"), timeout=240, cwd=str(tmp_path))
        _ok(proc)
        losses = _val_losses(proc.stdout)
        assert len(losses) == 3 and losses[-1] < losses[0], proc.stdout  # steps 0, 10, 20
    out = tmp_path / "bsp.h5"
    proc = launch(5, sys.executable, script, "--paradigm", "bsp", *small, "--checkpoint-every", "20",
                  "--out", str(out), timeout=240, cwd=str(tmp_path))
    _ok(proc)
    first = _val_losses(proc.stdout)
    assert first[-1] < first[0], proc.stdout
    with h5py.File(out) as f:
        scalars = f["workers/scalars"][()]
        optimizer = json.loads(f.attrs["optimizer"])
    assert sorted(set(scalars["name"].tolist())) == [b"train_loss", b"val_loss"]
    assert sorted(set(scalars["step"].tolist())) == [0, 10, 20]
    assert optimizer["class"] == "torch.optim.adamw.AdamW" and optimizer["defaults"]["lr"] == 3e-3
    assert [g["weight_decay"] for g in optimizer["param_groups"]] == [0.1, 0.0]
    checkpoint = tmp_path / "bsp-checkpoints" / "step-000020.h5"
    saved = read_user_state(str(checkpoint))
    # as the loop was at its first training pass on version 20: after step 20's validation
    assert saved["iter_num"] == 20 and abs(saved["best_val_loss"] - min(first[:3])) < 1e-4  # printed to 4 places
    example = _module("nanogpt_style")
    state = torch.load(out.with_suffix(".pt"))
    model = example.GPT(state["tok.weight"].shape[0], 32)
    model.load_state_dict(state)  # the trained model loads into the plain class
    resumed = launch(5, sys.executable, script, "--paradigm", "bsp", *small, "--resume", str(checkpoint),
                     "--out", str(tmp_path / "resumed.h5"), timeout=240, cwd=str(tmp_path))
    _ok(resumed)
    assert re.search(r"^step 20 \(version 20\)", resumed.stdout, re.M), resumed.stdout
    assert "step 0 " not in resumed.stdout and "after 30 iterations" in resumed.stdout


def test_the_backup_workers_paradigm_runs_from_its_file_and_says_what_it_dropped(tmp_path):
    """The plug-in paradigm as a user names it on the command line; its late gradients are in the file as
    dropped by the paradigm, and a bad option ends every rank with one line before training starts."""
    spec = f"{EXAMPLES / 'backup_workers.py'}:BackupWorkers"
    out = tmp_path / "backup.h5"
    proc = launch(5, "hpcps", "train", "--paradigm", spec, "--paradigm-option", "backups=1", "--slowdown", "4=3",
                  "--compute-time", "0.01", "--steps", "40", "--out", str(out), timeout=240, cwd=str(tmp_path))
    _ok(proc)
    with h5py.File(out) as f:
        s, up = f["summary"].attrs, f["servers/updates"][()]
        assert f.attrs["paradigm"] == spec
        assert s["gradients_pushed"] == 160 == s["gradients_applied"] + s["gradients_dropped"]
        assert s["gradients_dropped"] == (up["reason"] == 3).sum() > 0
    proc = launch(5, "hpcps", "train", "--paradigm", spec, "--paradigm-option", "backups=4", "--steps", "5",
                  timeout=120, cwd=str(tmp_path))
    errors = [x for x in proc.stderr.splitlines() if x.startswith("hpcps: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "backups must be 0 to 3 with 4 workers; got 4" in errors[0]


def test_the_horovod_style_loop_applies_its_per_batch_schedule_on_the_servers(tmp_path):
    """The loop edits ps.optimizer's param groups before every batch (warm-up over the first epoch, a
    tenth from epoch 2): every gradient is applied at the rate the loop set for its batch."""
    out = tmp_path / "hvd.h5"
    proc = launch(5, sys.executable, str(EXAMPLES / "horovod_style.py"), "--epochs", "3", "--out", str(out),
                  "--checkpoint-format", str(tmp_path / "ckpt-{epoch}.pt"), timeout=240, cwd=str(tmp_path))
    _ok(proc)
    example = _module("horovod_style")
    with h5py.File(out) as f:
        up, scalars, ev = f["servers/updates"][()], f["workers/scalars"][()], f["eval"][()]
        final_loss = float(f["summary"].attrs["final_loss"])
    # the averaged validation loss is the run's evaluation; each epoch's checkpoint holds the servers'
    # momentum, shaped as the model's parameters
    worker0 = scalars[(scalars["rank"] == 1) & (scalars["name"] == b"val_loss")]["value"]
    assert ev["loss"].tolist() == worker0.tolist() and final_loss == worker0[-1] and len(ev) == 3
    saved = torch.load(tmp_path / "ckpt-3.pt")
    shapes = [tuple(v.shape) for k, v in saved["model"].items()]
    momenta = [tuple(saved["optimizer"]["state"][i]["momentum_buffer"].shape) for i in sorted(saved["optimizer"]["state"])]
    assert momenta == shapes and float(saved["optimizer"]["state"][0]["momentum_buffer"].abs().max()) > 0
    n, per_epoch, scaled = 4, 4, 0.0125 * 4 * 2  # 512 samples / 4 workers / (16 x 2) per step
    step = up["worker_clock"] - 1
    want = [scaled * example.warmup_then_steps(int(k) // per_epoch, (int(k) % per_epoch + 1) / per_epoch,
                                               warmup=1.0, n_workers=n, cuts=(2,)) for k in step]
    assert len(up) == 4 * 3 * per_epoch and up["applied"].all()
    assert max(abs(a - b) / b for a, b in zip(up["lr"], want)) < 1e-12
    assert sorted(set(round(x, 9) for x in up["lr"])) == [round(scaled * 0.1, 9), round(scaled * 0.4375, 9),
                                                          round(scaled * 0.625, 9), round(scaled * 0.8125, 9),
                                                          round(scaled, 9)]
    assert list(scalars["name"]).count(b"val_loss") == 4 * 3  # each worker, each epoch
    assert "epoch 2: validation loss" in proc.stdout


def test_the_pull_with_push_plugin_computes_gradients_without_its_workers_last_one(tmp_path):
    """asp as it was: the pull begun with the push reads the shard before that push is applied, so a
    gradient is computed on a version older than its worker's previous update made (asp never does:
    tests/mpi/test_paradigms.py). Every gradient is still applied, on arrival."""
    out = tmp_path / "former.h5"
    proc = launch(5, sys.executable, "-m", "hpcps", "train", "--paradigm",
                  f"{EXAMPLES / 'pull_with_push.py'}:PullWithPush", "--steps", "30", "--out", str(out),
                  timeout=240, cwd=str(tmp_path))
    _ok(proc)
    with h5py.File(out) as f:
        up = f["servers/updates"][()]
    missed = 0
    for w in set(up["worker"].tolist()):
        mine = up[up["worker"] == w]
        mine = mine[mine["worker_clock"].argsort()]
        computed_on = mine["version"] - mine["staleness"]
        missed += int((computed_on[1:] < mine["version"][:-1] + 1).sum())
    assert len(up) == 4 * 30 and up["applied"].all()
    assert missed > 0  # (begun before the push leaves, a pull cannot wait for it: here nearly every one misses)
