"""Checkpoints: the global parameters of one consistent version, and exact resume (h5py, no MPI).

Tree (format 1)::

    step-000020.h5
    ├── params   float32[n]: the flat parameter vector, every shard at ``version``
    └── attrs: format, hpcps_version, paradigm, version, worker_clocks (int64[N]),
               n_params, n_workers, n_servers, config (JSON)

Written atomically: to ``<name>.tmp``, then renamed. Only BSP checkpoints are
consistent in this release (every shard and every worker at one version).
Nothing else is needed for an exact resume: plain SGD has no optimizer
state, the batch schedule is a pure function of (seed, step), and the
models have no randomness in training. A BSP run resumed from its step-k
checkpoint therefore ends with exactly the parameters of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import h5py
import numpy as np

import hpcps
from hpcps.errors import UserError

FORMAT = 1
#: options that must match between the checkpointed run and the resuming one
MUST_MATCH = ("paradigm", "model", "hidden", "dataset", "batch_size", "lr", "seed", "test_fraction", "servers")


@dataclass(frozen=True)
class Checkpoint:
    params: np.ndarray
    version: int
    worker_clocks: np.ndarray
    config: dict
    n_servers: int


def checkpoint_path(directory: str, version: int) -> str:
    return os.path.join(directory, f"step-{version:06d}.h5")


def write_checkpoint(path: str, params: np.ndarray, *, version: int, worker_clocks, config: dict,
                     n_servers: int) -> str:
    """Write atomically (temporary file, then rename); return ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        f.create_dataset("params", data=params)
        f.attrs.update({"format": FORMAT, "hpcps_version": hpcps.__version__, "paradigm": config["paradigm"],
                        "version": version, "worker_clocks": np.asarray(worker_clocks, np.int64),
                        "n_params": len(params), "n_workers": len(worker_clocks), "n_servers": n_servers,
                        "config": json.dumps(config, sort_keys=True)})
    os.replace(tmp, path)
    return path


def read_checkpoint(path: str) -> Checkpoint:
    try:
        with h5py.File(path, "r", locking=False) as f:
            return Checkpoint(f["params"][()], int(f.attrs["version"]), np.asarray(f.attrs["worker_clocks"]),
                              json.loads(f.attrs["config"]), int(f.attrs["n_servers"]))
    except FileNotFoundError:
        raise UserError(f"--resume {path}: no such file") from None
    except (OSError, KeyError) as exc:
        raise UserError(f"--resume {path}: not an hpcps checkpoint ({exc})") from None


def check_compatible(ckpt: Checkpoint, path: str, config: dict, *, n_params: int, n_workers: int) -> None:
    """UserError naming every way ``ckpt`` does not fit this run."""
    problems = [f"{key} is {config.get(key)!r} here but {ckpt.config.get(key)!r} in the checkpoint"
                for key in MUST_MATCH if config.get(key) != ckpt.config.get(key)]
    if len(ckpt.params) != n_params:
        problems.append(f"the model has {n_params} parameters, the checkpoint {len(ckpt.params)}")
    if len(ckpt.worker_clocks) != n_workers:
        problems.append(f"{n_workers} workers here, {len(ckpt.worker_clocks)} in the checkpoint")
    if problems:
        raise UserError(f"--resume {path} does not fit this run: " + "; ".join(problems))
