#!/usr/bin/env python3
"""hpcps beside torchft (PyTorch's fault-tolerance library), on the same workload and the same faults.

``faults``: a worker of four SIGKILLed at step ``--kill-at`` of ``--steps`` (``mlp`` on ``digits``,
``--compute-time`` seconds a step, hpcps's default workload), each method with the same run and nobody
killed beside it, for each seed. Per method it prints:

- **kill to next step**: from the kill (the dying process's own line, on its clock) until every survivor
  has finished a step without the dead worker: its update applied (hpcps), or committed in a quorum that
  left the dead replica out (torchft: a step whose all-reduce the dead one had joined may still commit
  just after the kill); the clean run's mean step beside it, since up to a step of that is the step under
  way;
- **steps thrown away**: the survivors' steps torchft computed and did not commit, or the gradients hpcps
  lost or dropped (the dead worker's in flight; the survivors' are all applied);
- **replacement's first step**: torchft's replica relaunched the moment the old one is seen dead, from its
  launch to its first committed step (Python and torch start-up, the quorum, the state fetched from a
  peer); hpcps's spare (``--spare-workers 1``) was launched with the job, so from the kill; under
  ``--respawn`` a process the survivors spawn after the death, from the spawn's call;
- **final loss** on the held-out set, killed against clean.

torchft's methods: DDP over gloo as shipped (0.2.0), and with its comm hook fixed
(``tools/peers/torchft_ddp.py --fixed-hook``: the shipped one asserts on a peer's death during the
all-reduce), each killed inside the all-reduce and between steps, at the lighthouse's heartbeat timeout of
1 s and 5 s and its join timeout of 1 s (a quorum forms without a replica that has not joined it within
that, heartbeat or not); one process per replica group, a lighthouse on the same machine. hpcps's: bsp run through
(``mpirun --with-ft ulfm``, no spare: bsp takes none), ssp with a spare, and ssp under ``--respawn`` (the run
stops at a checkpoint and resumes with a spawned process in the dead worker's place: kill to next step runs to
the survivors' first step in the resumed part). Each run is one launch; all of them in one invocation
(``--only TEXT``: the methods whose name holds it):

    /root/venvs/ompi/bin/python tools/bench_peers.py faults --seeds 0 1 2

Run it with the Python of an environment with Open MPI's mpi4py (ULFM) and torchft (``pip install
torchft``).

With ``--box`` (root) each run is on emulated nodes linked at ``--link``, one process each: hpcps's through
``hpcps emulate`` (its shard on node 0, a worker on each next node, the spare on the last), torchft's in a
box built here (its lighthouse on node 0, replica ``r`` on node ``r + 1``, the relaunch on the dead one's
node), each process started inside its node's namespace with gloo on the node's interface:

    /root/venvs/ompi/bin/python tools/bench_peers.py faults --seeds 0 1 2 --box --link 1gbit

torchft's other two comparisons live beside their hpcps rows: the step of its DDP against hpcps's bsp in
``tools/bench_allreduce.py --torchft`` (in a box with ``--link``), its DiLoCo against hpcps's in
``tools/bench_local.py --methods torchft-diloco``; both start torchft's replicas as the ranks of an MPI job
(``tools/peers/torchft_box.py``), so they run under either MPI.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import h5py
import numpy as np
from benchlib import openmpi_env, torchft_lighthouse

from hpcps.box.spec import NODE_IFACE, Cluster, make_cluster

HERE = os.path.dirname(os.path.abspath(__file__))
REPLICA = os.path.join(HERE, "peers", "torchft_ddp.py")
KILL_LINE = re.compile(r"--fault kill@(\d+):(\d+): SIGKILL at t=([0-9.]+) s")


@dataclass
class Outcome:
    """One run's figures (NaN where they do not apply); ``note`` says what went wrong, if anything."""
    step_s: float = float("nan")
    recovery_s: float = float("nan")
    thrown: float = float("nan")
    rejoin_s: float = float("nan")
    loss: float = float("nan")
    note: list[str] = field(default_factory=list)


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Nodes:
    """Where torchft's processes run: node ``k``'s address and the argv that starts a command there (in the
    node's namespace, gloo on its interface), or everything on this machine at 127.0.0.1 (``cluster`` None)."""
    cluster: Cluster | None = None

    def address(self, k: int) -> str:
        return "127.0.0.1" if self.cluster is None else self.cluster.address(k)

    def argv(self, k: int, command: list[str]) -> list[str]:
        if self.cluster is None:
            return command
        return ["ip", "netns", "exec", self.cluster.namespace(k), "env", f"GLOO_SOCKET_IFNAME={NODE_IFACE}",
                *command]


@contextlib.contextmanager
def torchft_nodes(args):
    """:class:`Nodes` for one torchft job: with ``--box``, a box of ``args.workers + 1`` nodes at ``args.link``
    built for it and removed after (whatever happens: a reaper removes it if this process dies). One box at a
    time: ``hpcps emulate`` (hpcps's runs) removes a box whose owner is not an hpcps command as stale."""
    if not args.box:
        yield Nodes()
        return
    from hpcps.box import net

    net.check_host()
    cluster = make_cluster(args.workers + 1, [args.link], buffer=args.buffer, prefix=f"hpcps{os.getpid()}-")
    with net.built(cluster):
        yield Nodes(cluster)


# -- torchft ------------------------------------------------------------------------------------------------

def torchft_run(args, seed: int, *, kill_in: str | None, heartbeat_ms: int, fixed: bool, tmp: str) -> Outcome:
    """One torchft job: a lighthouse, ``args.workers`` replica groups started together, replica 2 killed
    (``kill_in``: ``allreduce``, ``between`` or None) and relaunched at once (on its node, in a box)."""
    with torchft_nodes(args) as nodes:
        return _torchft_job(args, seed, nodes, kill_in=kill_in, heartbeat_ms=heartbeat_ms, fixed=fixed, tmp=tmp)


def _torchft_job(args, seed: int, nodes: Nodes, *, kill_in: str | None, heartbeat_ms: int, fixed: bool,
                 tmp: str) -> Outcome:
    log, go = os.path.join(tmp, f"tft-{time.monotonic_ns()}.jsonl"), os.path.join(tmp, f"go-{time.monotonic_ns()}")
    port = free_port()
    serve = [torchft_lighthouse(), "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", str(args.join_timeout_ms),
             "--heartbeat_timeout_ms", str(heartbeat_ms), "--bind", f"[::]:{port}"]
    lighthouse = subprocess.Popen(nodes.argv(0, serve), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://{nodes.address(0)}:{port}"}
    killed = 2

    def replica(r: int, kill: bool) -> subprocess.Popen:
        cmd = [sys.executable, REPLICA, "--replica", str(r), "--replicas", str(args.workers), "--steps",
               str(args.steps), "--seed", str(seed), "--compute-time", str(args.compute_time), "--store-port",
               str(free_port()), "--address", nodes.address(r + 1), "--log", log, "--go", go] + \
            (["--fixed-hook"] if fixed else [])
        if kill:
            cmd += ["--kill-at", str(args.kill_at), "--kill-in", kill_in]
        return subprocess.Popen(nodes.argv(r + 1, cmd), env=env, stdout=subprocess.DEVNULL,
                                stderr=open(f"{log}.{r}.err", "a"))

    procs = {r: replica(r, kill_in is not None and r == killed) for r in range(args.workers)}
    out, relaunched, started = Outcome(), None, float("nan")
    try:
        deadline = time.monotonic() + args.timeout
        while len([e for e in events(log) if e["event"] == "ready"]) < args.workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"torchft's replicas did not all start (see {log}.*.err)")
            time.sleep(0.05)
        open(go, "w").close()
        started = time.time()
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() > deadline:
                out.note.append("timed out")
                break
            if kill_in is not None and relaunched is None and procs[killed].poll() is not None:
                relaunched = time.time()
                procs[f"{killed}b"] = replica(killed, kill=False)  # the relaunch: a supervisor's
            time.sleep(0.01)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        lighthouse.kill()
        lighthouse.wait()
    out = torchft_figures(events(log), out, killed if kill_in else None, started, relaunched, args.steps)
    crashed = [str(r) for r, p in procs.items() if r != killed and p.returncode not in (0, None)]
    if crashed:  # (the job ended there: nothing after the kill to measure)
        out.note.append(f"replica(s) {', '.join(crashed)} crashed too")
        out.thrown = out.recovery_s = out.rejoin_s = out.loss = float("nan")
    return out


def events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def torchft_figures(evs: list[dict], out: Outcome, killed: int | None, start: float, relaunched: float | None,
                    steps: int) -> Outcome:
    """The figures of one torchft job's events, its replicas let go at ``start`` (the replacement's are those
    after ``relaunched``)."""
    kill = [e["t"] for e in evs if e["event"] == "kill"]
    first = [e for e in evs if e["event"] == "step"]
    if not first:
        out.note.append("no step")
        return out
    survivors = sorted({e["replica"] for e in first if e["replica"] != killed})
    last = max(e["t"] for e in first if e["replica"] in survivors)
    out.step_s = (last - start) / steps
    if kill:
        t = kill[0]
        # (a step committed in a quorum without the dead: one it was in may commit after the kill)
        nexts = [min((e["t"] for e in first if e["replica"] == r and e["committed"] and e["t"] > t
                      and e["participants"] <= len(survivors)), default=float("nan")) for r in survivors]
        out.recovery_s = max(nexts) - t
        out.thrown = sum(1 for e in first if e["replica"] in survivors and not e["committed"])
        if relaunched is not None:
            mine = [e["t"] for e in first if e["replica"] == killed and e["t"] > relaunched and e["committed"]]
            out.rejoin_s = (min(mine) - relaunched) if mine else float("nan")
    ends = [e for e in evs if e["event"] == "end" and e["replica"] in survivors]
    out.loss = ends[0]["test_loss"] if ends else float("nan")
    return out


# -- hpcps --------------------------------------------------------------------------------------------------

def train_argv(args, seed: int, paradigm: str, run_file: str, kill: bool) -> list[str]:
    """``hpcps train`` on the benchmark's workload, worker rank 3 killed at ``args.kill_at`` where ``kill``."""
    argv = [sys.executable, "-m", "hpcps", "train", "--paradigm", paradigm, "--steps", str(args.steps),
            "--compute-time", str(args.compute_time), "--no-progress", "--seed", str(seed), "--out", run_file]
    return argv + (["--fault", f"kill@3:{args.kill_at}"] if kill else [])


def launcher(args, ranks: int, *, ulfm: bool) -> list[str]:
    """The command that launches an hpcps job of ``ranks`` ranks: Open MPI's ``mpirun`` (with its fault
    tolerance where ``ulfm``), or with ``--box`` ``hpcps emulate`` on one node a rank at ``args.link``."""
    from hpcps.cluster.launcher import ULFM_LAUNCH, find_mpiexec

    if args.box:
        return [sys.executable, "-m", "hpcps", "emulate", *(["--ulfm"] if ulfm else []), "--nodes", str(ranks),
                "--link", args.link, "--buffer", args.buffer, "--"]
    return [find_mpiexec(), *(ULFM_LAUNCH if ulfm else []), "-n", str(ranks)]


def hpcps_run(args, seed: int, *, paradigm: str, kill: bool, spare: bool, tmp: str) -> Outcome:
    """One hpcps job run through (ULFM): a shard and four workers (and a spare), worker rank 3 killed at step
    ``args.kill_at`` where ``kill``."""
    run_file = os.path.join(tmp, f"hpcps-{time.monotonic_ns()}.h5")
    train = train_argv(args, seed, paradigm, run_file, kill)
    if spare:
        train += ["--spare-workers", "1"]
    env = openmpi_env()
    proc = subprocess.run([*launcher(args, 1 + args.workers + spare, ulfm=True), *train],
                          capture_output=True, text=True, timeout=args.timeout, env=env)
    out = Outcome()
    if proc.returncode != 0 or "done in" not in proc.stderr:
        out.note.append(f"failed: {proc.stderr.strip().splitlines()[-1:]}")
        return out
    with h5py.File(run_file) as f:
        s, it = f["summary"].attrs, f["workers/iterations"][()]
        out.loss = float(s["final_loss"])
        lost = int(s["gradients_lost"]) + int(s["gradients_dropped"])
    spare_rank = 1 + args.workers if spare else None
    survivors = [r for r in np.unique(it["rank"]) if r not in ({3, spare_rank} if kill else {spare_rank})]
    rows = it[np.isin(it["rank"], survivors)]
    out.step_s = float(rows["t_end"].max() - rows["t_start"].min()) / args.steps
    found = KILL_LINE.search(proc.stderr)
    if kill:
        if found is None:
            out.note.append("no kill line")
            return out
        t = float(found.group(3))
        after = [rows["t_end"][(rows["rank"] == r) & (rows["t_end"] > t)] for r in survivors]
        out.recovery_s = max(float(a.min()) if len(a) else float("nan") for a in after) - t
        out.thrown = lost
        if spare:
            mine = it["t_end"][it["rank"] == spare_rank]
            out.rejoin_s = float(mine.min()) - t if len(mine) else float("nan")
    return out


def hpcps_respawn_run(args, seed: int, *, paradigm: str, tmp: str) -> Outcome:
    """One hpcps job under ``--respawn`` (ULFM, no spare launched): worker rank 3 killed at ``args.kill_at``;
    the run stops at a checkpoint, the survivors spawn a process in its place and the job resumes, its second
    part in ``<run>-respawn1.h5``. Times on the wall clock, from each part's ``clock_start``: the kill (its
    line, on the first part's clock) to every survivor's first step in the resumed part, and the spawn's call
    (the second file's ``respawn`` note) to the newcomer's first step."""
    run_file = os.path.join(tmp, f"hpcps-{time.monotonic_ns()}.h5")
    train = train_argv(args, seed, paradigm, run_file, kill=True) + ["--respawn"]
    proc = subprocess.run([*launcher(args, 1 + args.workers, ulfm=True), *train],
                          capture_output=True, text=True, timeout=args.timeout, env=openmpi_env())
    out = Outcome()
    second = os.path.splitext(run_file)[0] + "-respawn1.h5"
    found = KILL_LINE.search(proc.stderr)
    if proc.returncode != 0 or not os.path.exists(second) or found is None:
        out.note.append(f"failed: {proc.stderr.strip().splitlines()[-1:]}")
        return out
    with h5py.File(run_file) as f:
        s, start = f["summary"].attrs, float(f.attrs["clock_start"])
        out.thrown = int(s["gradients_lost"]) + int(s["gradients_dropped"])
    with h5py.File(second) as f:
        s, it, again = f["summary"].attrs, f["workers/iterations"][()], float(f.attrs["clock_start"])
        note = json.loads(f.attrs["respawn"])
        out.loss = float(s["final_loss"])
    killed = start + float(found.group(3))
    firsts = {int(r): again + float(it["t_end"][it["rank"] == r].min()) for r in np.unique(it["rank"])}
    out.recovery_s = max(t for r, t in firsts.items() if r != 3) - killed
    out.rejoin_s = firsts[3] - note["spawned"] if 3 in firsts else float("nan")
    return out


def hpcps_restart_run(args, seed: int, *, tmp: str) -> Outcome:
    """bsp under ``hpcps supervise`` and Open MPI's launcher without ULFM (a death ends the job), checkpoints
    every ``args.checkpoint_every`` steps, ``--resume auto``: worker rank 3 killed at step ``args.kill_at``,
    the job launched again at once and resumed. Times are read from the supervisor's output as it comes (the
    kill's line, the relaunch's line) and from the resumed run's file (its first step)."""
    where = os.path.join(tmp, f"restart-{time.monotonic_ns()}")
    os.makedirs(where)
    run_file = os.path.join(where, "run.h5")
    env = openmpi_env()
    proc = subprocess.Popen([sys.executable, "-m", "hpcps", "supervise", "--delay", "0", "--restarts", "2", "--",
                             *launcher(args, 1 + args.workers, ulfm=False),
                             *train_argv(args, seed, "bsp", run_file, kill=True), "--checkpoint-every",
                             str(args.checkpoint_every), "--resume", "auto"],
                            cwd=where, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in proc.stderr), daemon=True)
    reader.start()
    out = Outcome()
    try:
        proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out.note.append("timed out")
        return out
    reader.join(5)
    killed = [t for t, line in lines if KILL_LINE.search(line)]
    again = [t for t, line in lines if "launching again" in line]
    if proc.returncode != 0 or not killed or not again:
        out.note.append(f"failed: {[line.strip() for _, line in lines[-1:]]}")
        return out
    with h5py.File(run_file) as f:
        s, it, start = f["summary"].attrs, f["workers/iterations"][()], float(f.attrs["clock_start"])
        out.loss, resumed = float(s["final_loss"]), f.attrs["resumed_from"]
    cut = 0  # (no checkpoint before the kill: the second launch started afresh)
    if resumed:
        with h5py.File(resumed) as f:
            cut = int(f.attrs["worker_clocks"].sum())
    first = start + float(it["t_end"].min())
    out.recovery_s, out.rejoin_s = first - killed[0], first - again[0]
    out.thrown = args.workers * args.kill_at - cut  # (each worker had pushed its steps before the kill's)
    return out


# -- the table ----------------------------------------------------------------------------------------------

def ms(values: list[float]) -> str:
    """Seconds as milliseconds, mean ± sd over the runs that have the figure ("-" where none has)."""
    v = np.array(values, dtype=float)
    v = v[~np.isnan(v)]
    if not len(v):
        return "-"
    return f"{1e3 * v.mean():.0f}" + (f" ± {1e3 * v.std():.0f}" if len(v) > 1 else "")


def mean(values: list[float], spec: str) -> str:
    """The mean over the runs that have the figure, as ``spec`` formats it ("-" where none has)."""
    v = np.array(values, dtype=float)
    v = v[~np.isnan(v)]
    return format(float(v.mean()), spec) if len(v) else "-"


def faults(args) -> None:
    methods = []
    for heartbeat in args.heartbeats_ms:
        for fixed in (False, True):
            for where in ("allreduce", "between"):
                name = f"torchft DDP {'comm hook fixed' if fixed else 'as shipped'}, heartbeat {heartbeat / 1e3:g} s, " \
                       f"killed {'in the all-reduce' if where == 'allreduce' else 'between steps'}"
                methods.append((name, ("torchft", heartbeat, fixed, where)))
    methods += [("hpcps bsp, run through (ULFM; bsp takes no spare)", ("hpcps", "bsp", False)),
                ("hpcps ssp, run through with a spare (ULFM)", ("hpcps", "ssp", True)),
                ("hpcps ssp, a process spawned in the dead one's place after the death (`--respawn`, ULFM)",
                 ("respawn", "ssp")),
                (f"hpcps bsp, restarted by `hpcps supervise` from its checkpoint (every {args.checkpoint_every} "
                 f"steps; Open MPI without ULFM)", ("restart",))]
    if args.only:
        methods = [(name, how) for name, how in methods if any(text in name for text in args.only)]
    where = f"in a box, a node a process at {args.link}" if args.box else "on one machine"
    print(f"faults: {args.workers} workers, {args.steps} steps of {args.compute_time * 1e3:g} ms, worker 2 (hpcps "
          f"rank 3) SIGKILLed at step {args.kill_at}, {where}; seeds {args.seeds}; mean ± sd over the seeds",
          flush=True)
    print("| method | clean step ms | kill to every survivor's next step ms | steps thrown away | "
          "replacement's first step ms | final loss, killed / clean | notes |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        os.makedirs(tmp, exist_ok=True)
        clean = {}
        for name, how in methods:
            rows, notes = [], []
            for seed in args.seeds:
                key = ("torchft", None, seed) if how[0] == "torchft" else \
                    ("hpcps", "bsp" if how[0] == "restart" else how[1], seed)
                if key not in clean:
                    clean[key] = (torchft_run(args, seed, kill_in=None, heartbeat_ms=how[1], fixed=False, tmp=tmp)
                                  if how[0] == "torchft" else
                                  hpcps_run(args, seed, paradigm=key[1], kill=False, spare=False, tmp=tmp))
                if how[0] == "torchft":
                    killed = torchft_run(args, seed, kill_in=how[3], heartbeat_ms=how[1], fixed=how[2], tmp=tmp)
                elif how[0] == "restart":
                    killed = hpcps_restart_run(args, seed, tmp=tmp)
                elif how[0] == "respawn":
                    killed = hpcps_respawn_run(args, seed, paradigm=how[1], tmp=tmp)
                else:
                    killed = hpcps_run(args, seed, paradigm=how[1], kill=True, spare=how[2], tmp=tmp)
                rows.append((clean[key], killed))
                notes += [f"seed {seed}: {n}" for n in killed.note]
            c, k = [r[0] for r in rows], [r[1] for r in rows]
            print(f"| {name} | {ms([o.step_s for o in c])} | {ms([o.recovery_s for o in k])} | "
                  f"{mean([o.thrown for o in k], '.1f')} | {ms([o.rejoin_s for o in k])} | "
                  f"{mean([o.loss for o in k], '.4f')} / {mean([o.loss for o in c], '.4f')} | {'; '.join(notes)} |",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["faults"], help="the comparison to run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", type=int, default=100)
    p.add_argument("--compute-time", type=float, default=0.02)
    p.add_argument("--checkpoint-every", type=int, default=30, help="the restarted hpcps run's checkpoints")
    p.add_argument("--heartbeats-ms", type=int, nargs="+", default=[1000, 5000],
                   help="torchft lighthouse's heartbeat timeouts to try (default 1000 5000)")
    p.add_argument("--join-timeout-ms", type=int, default=1000,
                   help="how long torchft's lighthouse waits for a heartbeating replica to join a quorum before it "
                        "forms one without (default 1000; torchft's README shows 10000)")
    p.add_argument("--timeout", type=float, default=180, help="seconds a run may take before it is killed")
    p.add_argument("--box", action="store_true", help="every process on an emulated node of its own (root)")
    p.add_argument("--link", default="1gbit", help="the box's links (default 1gbit)")
    p.add_argument("--buffer", default="512kb", help="the box's switch queue per port (default 512kb)")
    p.add_argument("--only", nargs="+", metavar="TEXT",
                   help="run only the methods whose name holds one of these (e.g. --only torchft, --only respawn)")
    p.add_argument("--keep", help="keep every run's files (torchft's events, hpcps's run files) in this directory")
    args = p.parse_args()
    if importlib.util.find_spec("torchft") is None:
        sys.exit("bench_peers: needs torchft (pip install torchft)")
    faults(args)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
