#!/bin/bash
# shellcheck disable=SC1090,SC1091  # --setup lines may source files shellcheck cannot see
# hpcps job without a batch system: run with `bash job.sh`.
# Rendered by: hpcps jobs render mpiexec --ntasks-per-node 5 -- --paradigm bsp
set -euo pipefail

# environment set-up (modules, virtual environment): --setup lines, verbatim

export OMP_NUM_THREADS=1

RUN_DIR="$PWD/runs/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$RUN_DIR"
export HPCPS_RUN_DIR="$RUN_DIR"  # hpcps.train() scripts write their metrics here by default

mpiexec -n 5 hpcps train --paradigm bsp --out "$RUN_DIR/metrics.h5"
echo "hpcps: run directory $RUN_DIR"
