"""``--compress``: 16-bit pushes and pulls, top-k with error feedback, end to end on 1 server + 4 workers
(mpiexec -n 5); each against a single-process replay of what the wire carries."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mpitest import share, train
from hpcps.data.sharding import batch_indices
from hpcps.data.loaders import load_dataset
from hpcps.runtime.checkpoints.files import read_checkpoint
from hpcps.training.flat import FlatParameters
from hpcps.training.models import build_model
from hpcps.transport.compress import TopK

pytestmark = pytest.mark.mpi(min_size=5)

STEPS, BATCH, LR, SEED = 15, 16, 0.2, 5


def _replay(steps, *, half=None, topk=None, n_workers=4):
    """Single-process BSP as the wire carries it: each worker's gradient on the parameters it pulled
    (``half``: rounded to that 16-bit type), sent rounded (``half``) or top-k with a residual of its own
    (``topk``: the ratio), the shard's fp32 master stepped by the mean of what arrived."""
    data = load_dataset("digits")
    model = build_model("mlp", data.in_shape, data.n_classes, seed=SEED)
    flat = FlatParameters(model)
    master = flat.params.copy()
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    codecs = [TopK(topk) for _ in range(n_workers)] if topk else None
    for k in range(steps):
        pulled = torch.from_numpy(master)
        flat.params[:] = (pulled.to(half).float() if half else pulled).numpy()
        total = torch.zeros(flat.size)
        for w in range(n_workers):
            idx = batch_indices(len(y), batch_size=BATCH, n_workers=n_workers, worker=w, step=k, seed=SEED)
            flat.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            g = torch.from_numpy(flat.grads.copy())
            if half:
                g = g.to(half).float()
            if topk:
                out = codecs[w].new_push_buffer([(0, flat.size)])
                codecs[w].encode(g, out, [(0, flat.size)])
                g = codecs[w].gradient(out, flat.size)
            total += g
        master -= LR * (total / n_workers).numpy()
    return master


def _run(world, path, **options):
    result, t = train(path, paradigm="bsp", steps=STEPS, batch_size=BATCH, lr=LR, seed=SEED, **options)
    if world.rank != 0:
        return None
    return result.params, json.loads(t["attrs"]["compress"]), t["summary"]


def test_bf16_bsp_is_the_replay_of_rounded_pushes_and_pulls_on_fp32_masters_with_half_the_bytes(world, mpi_tmp_path):
    bf16 = _run(world, mpi_tmp_path / "bf16.h5", compress="bf16")
    fp32 = _run(world, mpi_tmp_path / "fp32.h5")
    facts = None
    if world.rank == 0:
        (params, wire, summary), (plain, plain_wire, _) = bf16, fp32
        reference = _replay(STEPS, half=torch.bfloat16)
        facts = {
            "replay": float(np.abs(params - reference).max()),
            "from_fp32": float(np.abs(params - plain).max()),
            # the final parameters are the shards' fp32 masters, not the bf16 copies workers pull
            "fp32_master": bool((torch.from_numpy(params).bfloat16().float().numpy() != params).any()),
            "bytes": (wire["push_bytes"], wire["pull_bytes"], plain_wire["push_bytes"], plain_wire["pull_bytes"]),
            "applied": int(summary["gradients_applied"]),
        }
    facts = share(world, facts)
    assert facts["replay"] < 1e-5
    assert facts["from_fp32"] > 1e-4  # the rounding shows: the replay above is not fp32's
    assert facts["fp32_master"]
    push, pull, push32, pull32 = facts["bytes"]
    assert 2 * push == push32 and 2 * pull == pull32  # exactly half the bytes, both ways
    assert facts["applied"] == 4 * STEPS


def test_fp16_bsp_stays_within_a_stated_tolerance_of_the_fp32_run(world, mpi_tmp_path):
    fp16 = _run(world, mpi_tmp_path / "fp16.h5", compress="fp16")
    fp32 = _run(world, mpi_tmp_path / "fp32.h5")
    facts = None
    if world.rank == 0:
        facts = {"diff": float(np.abs(fp16[0] - fp32[0]).max()),
                 "replay": float(np.abs(fp16[0] - _replay(STEPS, half=torch.float16)).max()),
                 "moved": float(np.abs(fp32[0] - _replay(0)).max())}
    facts = share(world, facts)
    assert facts["moved"] > 1e-2
    # 15 steps at lr 0.2 on rounded gradients and parameters (fp16: 11 bits of mantissa)
    assert facts["diff"] < 2e-3
    assert facts["replay"] < 1e-5


def test_topk_bsp_is_the_replay_of_error_feedback_with_each_workers_own_residual(world, mpi_tmp_path):
    out = _run(world, mpi_tmp_path / "topk.h5", compress="topk:0.05")
    facts = None
    if world.rank == 0:
        params, wire, _ = out
        facts = {"replay": float(np.abs(params - _replay(STEPS, topk=0.05)).max()),
                 "dense": float(np.abs(params - _replay(STEPS)).max()),
                 "ratio": wire["push_bytes"] / wire["fp32_bytes"], "pull": wire["pull_bytes"] / wire["fp32_bytes"]}
    facts = share(world, facts)
    assert facts["replay"] < 1e-5
    assert facts["dense"] > 1e-3
    assert abs(facts["ratio"] - 0.1) < 1e-3 and facts["pull"] == 1.0  # 5% of values, 8 bytes each; pulls fp32


@pytest.mark.parametrize("compress", ["bf16", "topk:0.1"])
@pytest.mark.parametrize("paradigm", ["asp", "eager", "hsp", "ssp"])
def test_nothing_is_lost_under_every_paradigm(world, mpi_tmp_path, paradigm, compress):
    _, t = train(mpi_tmp_path / f"{paradigm}.h5", paradigm=paradigm, steps=20, servers=2, compress=compress,
                 slowdown=["4=2"])
    facts = None
    if world.rank == 0:
        s = t["summary"]
        facts = (int(s["gradients_pushed"]), int(s["gradients_applied"]), int(s["gradients_dropped"]))
    assert share(world, facts) == (3 * 20, 3 * 20, 0)


def test_a_bf16_checkpoint_holds_the_fp32_masters_and_resumes_bit_for_bit(world, mpi_tmp_path):
    ckdir = mpi_tmp_path / "ck"
    common = dict(paradigm="bsp", steps=30, servers=2, seed=4, compress="bf16", checkpoint_every=15,
                  checkpoint_dir=str(ckdir))
    full, _ = train(mpi_tmp_path / "full.h5", **common)
    resumed, _ = train(mpi_tmp_path / "resumed.h5", resume=str(ckdir / "step-000015.h5"),
                       **{**common, "checkpoint_dir": str(ckdir / "again")})
    facts = None
    if world.rank == 0:
        saved = read_checkpoint(str(ckdir / "step-000015.h5")).params
        facts = {"equal": bool(np.array_equal(full.params, resumed.params)),
                 "fp32": bool((torch.from_numpy(saved).bfloat16().float().numpy() != saved).any())}
    facts = share(world, facts)
    assert facts["equal"] and facts["fp32"]


@pytest.mark.parametrize("compress", ["bf16", "topk:0.1"])
def test_group_servers_carry_compressed_pushes_and_pulls_and_lose_nothing(world, mpi_tmp_path, compress):
    """grouped (1 central shard, 2 group servers of 1 worker each): every worker gradient and every group
    round is applied, the file records the compressed bytes, and the run trains as the fp32 one does."""
    common = dict(paradigm="grouped", groups=2, steps=20, seed=2, lr=0.2)
    _, t = train(mpi_tmp_path / f"grouped-{compress}.h5", compress=compress, **common)
    _, t32 = train(mpi_tmp_path / "grouped-fp32.h5", **common)
    facts = None
    if world.rank == 0:
        s, wire = t["summary"], json.loads(t["attrs"]["compress"])
        facts = {"counts": (int(s["gradients_pushed"]), int(s["gradients_applied"]), int(s["gradients_dropped"])),
                 "group_rounds": len(t["groups/updates"]), "ratio": wire["push_bytes"] / wire["fp32_bytes"],
                 "pull": wire["pull_bytes"] / wire["fp32_bytes"],
                 "accuracy": (float(s["final_accuracy"]), float(t32["summary"]["final_accuracy"]))}
    facts = share(world, facts)
    assert facts["counts"] == (2 * 20, 2 * 20, 0)
    assert facts["group_rounds"] == 2 * 20
    if compress == "bf16":
        assert facts["ratio"] == facts["pull"] == 0.5
    else:  # 10% of the values, an index and a value each: a fifth of the bytes; pulls fp32
        assert abs(facts["ratio"] - 0.2) < 1e-3 and facts["pull"] == 1.0
    assert facts["accuracy"][0] > facts["accuracy"][1] - 0.1  # trains about as the fp32 run does
