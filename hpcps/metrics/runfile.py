"""The HDF5 file of one run (written by rank 0 only; h5py, no MPI).

Tree (schema version 1, fields in :mod:`hpcps.metrics.schema`)::

    run.h5
    ├── attrs: schema_version, hpcps_version, config (JSON), paradigm,
    │          world_size, n_workers, n_servers, n_groups, mpi_library, start_time, ...
    │          (docs/metrics.md; paradigm_choice under --paradigm auto)
    ├── workers/iterations   compound, chunked, resizable: one row per worker iteration
    ├── servers/updates      compound, chunked, resizable: one row per gradient per shard
    ├── eval                 compound, chunked, resizable: one row per evaluation
    └── summary              group; attrs: wall_s, gradients_pushed, gradients_applied,
                             gradients_dropped, final_accuracy, time_to_target_s

Rows are appended in batches and the file is flushed after each batch, so a
crash loses at most the batches not yet received.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import h5py
import numpy as np

from hpcps.metrics.schema import SCHEMA_VERSION, TABLES


class RunFile:
    """Create ``path`` and append metric rows to it."""

    def __init__(self, path: str | os.PathLike, attrs: Mapping[str, Any]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = os.fspath(path)
        self.h5: h5py.File | None = h5py.File(self.path, "w")
        self.h5.attrs["schema_version"] = SCHEMA_VERSION
        for key, value in attrs.items():
            self.h5.attrs[key] = value
        for name, dtype in TABLES.items():
            self.h5.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(1024,))
        self.h5.create_group("summary")
        self.h5.flush()

    def _live(self) -> h5py.File:
        if self.h5 is None:
            raise RuntimeError(f"run file {self.path} used after close()")
        return self.h5

    def append(self, table: str, rows: np.ndarray) -> None:
        if len(rows) == 0:
            return
        ds = self._live()[table]
        n = ds.shape[0]
        ds.resize((n + len(rows),))
        ds[n:] = rows

    def read(self, table: str) -> np.ndarray:
        return self._live()[table][()]

    def write_summary(self, summary: Mapping[str, float | int]) -> None:
        group = self._live()["summary"]
        for key, value in summary.items():
            group.attrs[key] = value

    def set_attrs(self, **attrs: Any) -> None:
        """Root attributes known only at the end (e.g. ``saved_model``)."""
        self._live().attrs.update(attrs)

    def flush(self) -> None:
        self._live().flush()

    def close(self) -> None:
        if self.h5 is not None:
            self.h5.close()
            self.h5 = None

    def __enter__(self) -> "RunFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
