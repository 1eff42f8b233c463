"""Every tool in tools/ runs its documented command at a tiny size and prints its table, so a benchmark cannot
rot unseen (bench_allreduce's plain-machine mode crashed for weeks on a tuple one element short; the server
memory benchmark's own default ended in 'diverged' on 2 workers).

CI runs the quick ones (seconds each); the slow ones (tens of seconds: the box's, those that launch many jobs)
run with ``HPCPS_TOOLS_ALL=1``, in the soak's spirit. Tools that need a box skip where none can be built, and
bench_runthrough (ULFM) runs under Open MPI only, bench_peers under Open MPI with torchft installed. ``--help`` of every tool is tests/unit/test_tools.py's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

from launching import FAMILY, box_missing, needs_mpiexec, run_bounded

TOOLS = Path(__file__).resolve().parents[2] / "tools"
ALL = os.environ.get("HPCPS_TOOLS_ALL") == "1"
BOX = box_missing()

#: tool -> (its documented command at a tiny size, what it needs: None, "box", "openmpi"; quick in CI)
TINY: dict[str, tuple[list[str], str | None, bool]] = {
    "bench_allreduce": (["--workers", "2", "--steps", "3", "--seeds", "0"], None, True),
    "bench_bn_stats": (["--workers", "2", "--seeds", "0", "--bn-momentum", "0.1", "--", "--steps", "4"], None, True),
    "bench_compress": (["--seeds", "0", "--np", "3", "--variants", "none", "bf16", "--", "--steps", "4"], None, True),
    "bench_eager": (["--seeds", "0", "--np", "3", "--variants", "eager", "asp", "--", "--steps", "4"], None, True),
    "bench_eval_latency": (["--steps", "3", "--samples", "100"], None, False),
    "bench_gpu": (["--device", "cpu", "--models", "mlp", "--dataset", "digits", "--paradigms", "bsp", "--workers", "2",
                   "--steps", "4", "--warmup", "1"], None, True),
    "bench_local": (["--nodes", "2", "--link", "1gbit", "--seeds", "0", "--steps", "20", "--budget", "20"], "box", False),
    "bench_mpis": (["--python", f"{FAMILY}={sys.executable}", "--seeds", "0", "--steps", "3", "--reps", "2"], "box",
                   False),
    "bench_paradigms": (["--paradigms", "bsp", "asp", "--np", "3", "--seeds", "0", "--scenarios", "homogeneous",
                         "--target", "loss<=9", "--layout", "reads=--pull get --partition-mb 1", "--",
                         "--steps", "4"], None, True),
    "bench_partitions": (["--seeds", "0", "--np", "3", "--", "--steps", "4"], None, True),
    "bench_patterns": (["--nodes", "3", "--link", "1gbit", "--mb", "0.1", "--reps", "1"], "box", True),
    "bench_piecewise": (["--workers", "2", "--steps", "3", "--seeds", "0", "--link", "1gbit"], "box", False),
    "bench_peers": (["faults", "--seeds", "0", "--steps", "20", "--kill-at", "10", "--heartbeats-ms", "1000",
                     "--checkpoint-every", "5"], "torchft", False),
    "bench_policies": (["--workers", "4", "--pushes", "2"], None, True),
    "bench_pull": (["--np", "3", "--seeds", "0", "--", "--steps", "4"], None, True),
    "probe_join": (["--ways", "spawn", "--ranks", "3"], "openmpi", True),
    "bench_runthrough": (["--paradigms", "asp", "--ranks", "3", "--rank", "2", "--steps", "10", "--kill-at", "4"], "openmpi",
                         True),
    "bench_chaos": (["--paradigms", "asp", "--nodes", "3", "--node", "2", "--steps", "20", "--kill-at", "8"], "box",
                    False),
    "bench_server_memory": (["--workers", "2", "--paradigms", "asp"], None, True),
    "bench_shard_apply": (["--mib", "1", "--reps", "2"], None, True),
    "bench_shards": (["--seeds", "0", "--shards", "1", "2", "--workers", "2", "--", "--steps", "4"], None, True),
    "bench_stream_memory": (["--seeds", "0", "--gigabytes", "0.01", "--workers", "2"], None, True),
    "bench_transport": (["--sizes", "1000", "--reps", "2"], None, False),
    "validate_layout": (["--nodes", "2", "--steps", "8", "--", "--compute-time", "0.01"], "box", False),
    "validate_simulator": (["--workers", "2", "--paradigms", "bsp", "--steps", "5"], None, False),
}


def test_every_tool_has_a_tiny_command():
    tools = sorted(p.stem for p in TOOLS.glob("*.py") if p.stem not in ("benchlib", "soak"))
    assert sorted(TINY) == tools


def _skip_reason(needs: str | None, quick: bool) -> str | None:
    if not quick and not ALL:
        return "a slow tool: HPCPS_TOOLS_ALL=1 runs it"
    if needs == "box" and BOX is not None:
        return f"no box here: {BOX}"
    if needs in ("openmpi", "torchft") and FAMILY != "openmpi":
        return "run-through needs Open MPI's ULFM (the Open MPI stage runs it)"
    if needs == "torchft" and importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install '.[peers]')"
    return None


@needs_mpiexec
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("tool", sorted(TINY))
def test_the_tools_documented_command_runs_at_a_tiny_size(tool, tmp_path):
    args, needs, quick = TINY[tool]
    reason = _skip_reason(needs, quick)
    if reason:
        pytest.skip(reason)
    proc = run_bounded([sys.executable, str(TOOLS / f"{tool}.py"), *args], timeout=360, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    # its results: a markdown table, or (bench_shard_apply) its ratio line
    assert re.search(r"^\|[-|]+\|$", proc.stdout, re.M) or "ratio vs copy:" in proc.stdout, proc.stdout[-2000:]
    if tool == "bench_paradigms":  # a row per paradigm and layout: as given, then --layout's
        rows = [line.split(" | ")[0] for line in proc.stdout.splitlines() if line.startswith("| bsp")
                or line.startswith("| asp")]
        assert [r.endswith(" [reads]") for r in rows] == [False, True, False, True], rows


@needs_mpiexec
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_allreduce_puts_torchfts_ddp_beside_hpcps_where_torchft_is_installed(tmp_path):
    """``--torchft``: a row of torchft's fault-tolerant DDP (a lighthouse, a replica group per rank), every
    step committed (the bench fails on one that is not), and hpcps's best against it."""
    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed (pip install '.[peers]')")
    proc = run_bounded([sys.executable, str(TOOLS / "bench_allreduce.py"), "--workers", "2", "--steps", "5",
                        "--seeds", "0", "--torchft"], timeout=360, cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| torchft "))
    assert "DDP (gloo), 25 MB buckets | 2 |" in row, row
    assert re.search(r"^best hpcps bsp / best torchft DDP .*: \d+\.\d\d$", proc.stdout, re.M), proc.stdout[-2000:]
