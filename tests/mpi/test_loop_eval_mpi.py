"""The loop's own validation is the run's evaluation (``ps.evaluated``), averaged over the workers with
``ps.mean``; a target on it stops the run (mpiexec -n 5)."""

from __future__ import annotations

import math

import h5py
import numpy as np
import pytest
import torch

import hpcps
from mpitest import share
from test_step_api import TinyLM, batch

pytestmark = [pytest.mark.mpi(min_size=5), pytest.mark.timeout(240)]


def test_an_averaged_validation_loss_is_the_runs_evaluation_and_its_target_stops_the_run(world, mpi_tmp_path):
    """bsp, 4 workers: after each step every worker's 'validation loss' (20 - step + its index) averaged by
    ps.mean is 20 - step + 1.5 on all of them, as a float and as a tensor; worker 0 records it with
    ps.evaluated, with a perplexity; target loss<=12 stops every worker at the same step, the first
    whose loss meets it (after the step under way); /eval and the summary hold what the loop gave."""
    ps = hpcps.init(TinyLM, device="cpu", optimizer="sgd", lr=0.01, paradigm="bsp", steps=40, target="loss<=12", progress=False,
                    out=str(mpi_tmp_path / "eval.h5"), exit_on_error=False, comm=world)
    means = []
    with ps:
        while ps.running:
            ps.model(*batch(ps.iteration, 0, ps.worker_index)).backward()
            ps.step()
            if not ps.running:
                break
            value = 20.0 - ps.iteration + ps.worker_index
            loss = ps.mean(value)
            as_tensor = ps.mean(torch.tensor([value, 2 * value]))
            means.append((ps.iteration, loss, as_tensor.tolist()))
            ps.evaluated(loss=loss, perplexity=math.exp(loss / 10))
    gathered = world.gather(means, root=0)
    facts = None
    if world.rank == 0:
        with h5py.File(ps.result.path) as f:
            ev, named, it = f["eval"][()], f["eval_metrics"][()], f["workers/iterations"][()]
            summary = dict(f["summary"].attrs)
        facts = {"means": [m for m in gathered if m], "losses": ev["loss"].tolist(), "versions": ev["version"].tolist(),
                 "perplexity": named["value"].tolist(), "rows": len(it), "final": float(summary["final_loss"]),
                 "t_target": float(summary["time_to_target_s"])}
    facts = share(world, facts)
    means = facts["means"]
    assert len(means) == 4 and all(m == means[0] for m in means)  # every worker, the same steps and values
    assert all(loss == 20.0 - k + 1.5 and vec == [loss, 2 * loss] for k, loss, vec in means[0])
    # the first step whose loss meets 12 is step 10 (20 - 10 + 1.5 = 11.5): the last one evaluated
    assert [k for k, _, _ in means[0]] == list(range(1, 11))
    assert facts["losses"] == [loss for _, loss, _ in means[0]] and facts["versions"] == list(range(1, 11))
    assert np.allclose(facts["perplexity"], [math.exp(v / 10) for v in facts["losses"]])
    # each worker finishes the step under way when worker 0 raised the stop (step 10), then stops
    assert facts["rows"] == 4 * 11 and facts["final"] == 11.5 and facts["t_target"] > 0
