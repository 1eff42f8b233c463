"""``hpcps`` command line: ``hpcps train`` and ``hpcps check`` (under mpiexec/srun), ``hpcps report``,
``hpcps simulate``, ``hpcps jobs render`` and ``hpcps emulate`` (a cluster in a box).

Options are parsed before MPI starts; every flag can also come from a TOML
file (``--config``), and flags given on the command line win. Bad input
ends every rank with exit status 2 and one ``hpcps: error: ...`` line
(printed by rank 0 only, so a 64-rank job does not print it 64 times).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Literal, get_args, get_origin
from typing import Sequence

import hpcps
from hpcps.box.spec import CONGESTION
from hpcps.cluster.launcher import RANK_VARS as _RANK_VARS, launcher_rank
from hpcps.errors import DIVERGED_STATUS, UserError, print_error


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors print on rank 0 only, and, under a launcher, leave only once
    every rank has parsed: Open MPI's launcher ends the job at the first rank's exit status, and rank 0's
    line was lost now and then when another rank left first."""

    def error(self, message: str):
        if launcher_rank() == 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
            sys.stderr.flush()
        if any(var in os.environ for var in _RANK_VARS):  # every rank parsed the same flags: all are here
            from mpi4py import MPI

            MPI.COMM_WORLD.Barrier()
        sys.exit(2)


def _user_error(exc: UserError, *, show: bool = True) -> int:
    """Print one ``hpcps: error:`` line (where ``show``) and return the exit status for bad input."""
    if show:
        print_error(str(exc))
    return exc.exit_code


def _paradigm_help() -> str:
    from hpcps.policies import paradigms

    return "; ".join(f"{name}: {cls.summary}" for name, cls in sorted(paradigms().items()))


def _config_default(name: str) -> str:
    """The config's default of option ``name`` as its help shows it (``on``/``off``, ``0.9,0.999``, ``1e-08``)."""
    from hpcps.options.config import TrainConfig

    value = TrainConfig.model_fields[name].get_default(call_default_factory=True)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _from_config(parser: argparse.ArgumentParser) -> None:
    """What the help says of each option the config declares, from the config (written once): ``{default}``
    in a help text becomes the config's default, and an option the config types as a choice among names
    shows them as its metavar (``{sgd,adam,adamw}``)."""
    from hpcps.options.config import TrainConfig

    fields = TrainConfig.model_fields
    for action in parser._actions:
        if action.dest not in fields:
            continue
        if action.help and "{default}" in action.help:
            action.help = action.help.replace("{default}", _config_default(action.dest))
        names = [a for a in get_args(fields[action.dest].annotation) if a is not type(None)]
        if len(names) == 1 and get_origin(names[0]) is Literal:  # (an optional choice: Literal[...] | None)
            names = list(get_args(names[0]))
        if get_origin(fields[action.dest].annotation) is Literal or (names and all(isinstance(n, str) for n in names)):
            action.metavar = "{" + ",".join(names) + "}"


def add_train_options(t: argparse.ArgumentParser) -> None:
    """Every ``hpcps train`` option, on ``t`` (the train sub-command, or ``jobs render``'s check of it)."""
    _add_train_options(t)
    _from_config(t)


def _add_train_options(t: argparse.ArgumentParser) -> None:
    t.add_argument("--config", metavar="FILE", help="TOML file with any of the options below")
    g = t.add_argument_group("paradigm and topology")
    g.add_argument("--paradigm", metavar="NAME|PLUGIN",
                   help=f"synchronization paradigm (default {{default}}), or your own as path/file.py:Class or "
                        f"pkg.mod:Class (a subclass of hpcps.Policy; docs/paradigms.md). {_paradigm_help()}")
    g.add_argument("--paradigm-option", action="append", dest="paradigm_option", metavar="NAME=VALUE",
                   help="an option of your own paradigm, passed to its constructor as NAME=VALUE (repeatable)")
    g.add_argument("--paradigms", nargs="+", metavar="NAME",
                   help="--paradigm auto: a trial of --trial-steps steps under each of these (default bsp ssp dssp "
                        "asp, the paradigms that take the same step per sample), then the run under the one that "
                        "trained the most batches a second, or a less stale one within 5%% of it")
    g.add_argument("--trial-steps", dest="trial_steps", type=int, metavar="N",
                   help="steps per worker in each trial of --paradigm auto and of hpcps tune (default {default})")
    g.add_argument("--servers", metavar="S|auto",
                   help="central server shards, ranks 0..S-1, or auto (default {default}): one beside the workers "
                        "on each node when the job spans nodes of two ranks or more, else 1")
    g.add_argument("--placement",
                   help="where shards go: spread (default) puts shard s on node s mod M, renumbering the ranks "
                        "so the shards are ranks 0..S-1; rank keeps the launcher's order (shards on the first "
                        "ranks, in block placement all on the first node)")
    g.add_argument("--groups", metavar="G", help="group servers (default {default}; for paradigms that use them), or auto: "
                   "2 groups formed by measured speed after a warm-up")
    g.add_argument("--group-by", dest="group_by",
                   help="how workers are put in groups: contiguous rank blocks (default), or by speed measured "
                        "in a warm-up, so a straggler shares a group only with slow peers")
    g.add_argument("--staleness", type=int, metavar="S",
                   help="ssp: max clock lead over the slowest worker; dssp: the lower bound s_lo (default 2); "
                        "eager: never compute on parameters more than S versions behind the newest known "
                        "(default: no bound)")
    g.add_argument("--hsp-max-stale", type=int, dest="hsp_max_stale", metavar="K",
                   help="hsp: extra gradients a worker may compute per round while it waits (default {default})")
    g.add_argument("--staleness-max", type=int, dest="staleness_max", metavar="S_HI",
                   help="dssp: upper bound s_hi of the dynamic threshold (default --staleness + 4)")
    g = t.add_argument_group("local steps (the local-SGD family: docs/paradigms.md)")
    g.add_argument("--local-steps", type=int, dest="local_steps", metavar="H",
                   help="each worker takes H steps with its own inner optimizer, then pushes the change of its "
                        "parameters (a pseudo-gradient) that the servers' optimizer applies: the outer step. "
                        "The paradigm's rule then counts rounds: bsp lock-step, ssp/dssp bounded, asp free "
                        "(default: none; 8 under localsgd and diloco)")
    g.add_argument("--local-steps-by-speed", dest="local_steps_by_speed", action=argparse.BooleanOptionalAction,
                   help="dynamic local updates: the workers time their first round and each takes H times the "
                        "fastest's speed over its own steps per round from then on (at least 1), so a slow "
                        "worker's round ends with the others' (default {default})")
    g.add_argument("--overlap-steps", type=int, dest="overlap_steps", metavar="T",
                   help="hide the outer step behind computation (Streaming DiLoCo's overlap): after pushing a "
                        "round a worker takes the next round's first T steps on its own parameters, then takes "
                        "the new global ones with those T steps' change on top; 0 waits for them (less than H; "
                        "default {default})")
    g.add_argument("--inner-optimizer", dest="inner_optimizer",
                   help="the workers' inner torch.optim rule (default {default})")
    g.add_argument("--inner-lr", type=float, dest="inner_lr", metavar="LR",
                   help="the inner learning rate (default 0.1 for sgd, 1e-3 for adam and adamw)")
    g.add_argument("--inner-momentum", type=float, dest="inner_momentum", metavar="M",
                   help="inner sgd momentum (default {default})")
    g.add_argument("--inner-weight-decay", type=float, dest="inner_weight_decay", metavar="WD",
                   help="inner weight decay (default {default})")
    g = t.add_argument_group("model and data")
    g.add_argument("--model", metavar="NAME|PLUGIN",
                   help="mlp or cnn (default {default}), or your model factory as pkg.mod:name or path/file.py:name "
                        "(called with in_shape, n_classes, hidden where it takes them)")
    g.add_argument("--hidden", type=int, metavar="UNITS",
                   help="width of the model: units in the hidden layer of mlp and cnn (default 128), channels of "
                        "cnn1d's convolutions (default 64); large values make a big model")
    g.add_argument("--dataset", metavar="NAME|FILE.h5|PLUGIN",
                   help="digits, an HDF5 file with /x and /y (default {default}), or a plug-in pkg.mod:name or "
                        "file.py:name: a torch Dataset, a (train, test) pair, or a function returning either")
    g.add_argument("--loss", metavar="NAME|PLUGIN",
                   help="cross_entropy (default) or mse on (x, y) batches, or a plug-in (model, batch) -> loss")
    g.add_argument("--steps", type=int, help="iterations per worker (default 500 unless --epochs)")
    g.add_argument("--epochs", type=int, help="passes over each worker's share of the training set")
    g.add_argument("--batch-size", type=int, dest="batch_size", help="samples per worker iteration (default {default})")
    g.add_argument("--lr", type=float, help="learning rate of the server optimizer (default {default} for sgd, "
                                             "0.001 for adam and adamw; under --local-steps the outer rate, "
                                             "in units of the round's change: default 1 for sgd, 0.7 under "
                                             "diloco)")
    g.add_argument("--lr-scaling", dest="lr_scaling",
                   help="auto (default): --lr is the step BSP takes per round, and a paradigm that applies "
                        "each worker's gradient as its own update divides it among them (asynchronous ones by "
                        "the worker count, grouped by the group count); none: every update at --lr")
    g.add_argument("--lr-staleness", dest="lr_staleness",
                   help="scale each gradient's learning rate by the staleness its worker knows of: lr, lr/(1+s), "
                        "lr/sqrt(1+s), lr*exp(-s) (default inverse for eager, none otherwise)")
    g.add_argument("--seed", type=int, help="seed of model initialisation and batch order (default {default})")
    g.add_argument("--target-accuracy", type=float, dest="target_accuracy", metavar="ACC",
                   help="stop once held-out accuracy reaches ACC (0-1): --target accuracy>=ACC")
    g.add_argument("--target", metavar="METRIC<=VALUE",
                   help="stop at the first evaluation that meets it: any metric the evaluation returns, "
                        "e.g. loss<=0.3 or accuracy>=0.9 (default: run every step)")
    g.add_argument("--test-fraction", type=float, dest="test_fraction", help="held-out fraction (default {default})")
    g = t.add_argument_group("server optimizer (run by every shard on its slice)")
    g.add_argument("--optimizer", help="torch.optim rule (default {default})")
    g.add_argument("--momentum", type=float, help="sgd momentum (default {default})")
    g.add_argument("--fused", action=argparse.BooleanOptionalAction,
                   help="the built-in optimizers' kernel on the shards: --fused, torch's fused one (an error where "
                        "torch has none); --no-fused, torch's default, as a plain torch.optim.AdamW(params) has it "
                        "(to the last bit); unset, fused where torch has it (faster: default)")
    g.add_argument("--stale-momentum", dest="stale_momentum",
                   help="auto: each shard lowers the sgd momentum by what its updates' running "
                        "mean staleness s adds (to 1-(1-m)(1+s), at least 0) and raises the rate to keep "
                        "rate/(1-momentum), so one --momentum is safe under every paradigm (bsp: unchanged); "
                        "none: the momentum as given (default {default})")
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction, help="sgd: Nesterov momentum (default {default})")
    g.add_argument("--momentum-period", type=int, dest="momentum_period", metavar="N",
                   help="Delayed Nesterov (for asynchronous local SGD): the momentum updated once per N updates "
                        "of each tensor, with their mean gradient; plain steps between (default {default}: every "
                        "update)")
    g.add_argument("--weight-decay", type=float, dest="weight_decay", metavar="WD",
                   help="weight decay: L2 in the gradient for sgd and adam, decoupled for adamw (default {default})")
    g.add_argument("--betas", metavar="B1,B2", help="adam/adamw betas (default {default})")
    g.add_argument("--eps", type=float, help="adam/adamw epsilon (default 1e-8)")
    g.add_argument("--lr-schedule", dest="lr_schedule",
                   help="learning rate over the server version (updates applied): constant (default), step "
                        "(x --lr-gamma every --lr-step-every versions), cosine (to --min-lr, default 0, at the "
                        "last update)")
    g.add_argument("--warmup-steps", type=int, dest="warmup_steps", metavar="VERSIONS",
                   help="ramp the learning rate up linearly over the first VERSIONS updates (default {default})")
    g.add_argument("--lr-step-every", type=int, dest="lr_step_every", metavar="VERSIONS",
                   help="step schedule: decay every VERSIONS updates (default a third of the run)")
    g.add_argument("--min-lr", type=float, dest="min_lr", metavar="LR",
                   help="the cosine schedule's floor, as a learning rate (default 0)")
    g.add_argument("--lr-gamma", type=float, dest="lr_gamma", metavar="GAMMA",
                   help="step schedule: the decay factor (default {default})")
    g.add_argument("--clip-norm", type=float, dest="clip_norm", metavar="NORM",
                   help="each worker clips its gradient to this global L2 norm before pushing (default off)")
    g = t.add_argument_group("emulation and resources")
    g.add_argument("--slowdown", action="append", metavar="RANK=FACTOR",
                   help="make worker RANK's compute FACTOR times slower (repeatable)")
    g.add_argument("--compute-time", type=float, dest="compute_time", metavar="SECONDS",
                   help="emulate compute: each iteration takes SECONDS x the worker's --slowdown factor (a sleep "
                        "after the real pass), so many workers fit on few cores")
    g.add_argument("--compute-forward", type=float, dest="compute_forward", metavar="SHARE",
                   help="spend SHARE (0-1) of --compute-time inside the forward pass, layer by layer (each "
                        "module with parameters its share by parameter count, before its forward), the rest after "
                        "the pass as before; default {default}")
    g.add_argument("--compute-backward", type=float, dest="compute_backward", metavar="SHARE",
                   help="spend SHARE (0-1) of --compute-time inside the backward pass, layer by layer (each "
                        "parameter's gradient is ready once its share by parameter count has passed, last layers "
                        "first); default {default}")
    g.add_argument("--jitter", help="none, uniform, exponential or lognormal variation of --compute-time (default {default})")
    g.add_argument("--jitter-cv", type=float, dest="jitter_cv", metavar="CV",
                   help="coefficient of variation of --jitter (default {default}; exponential is always 1)")
    g.add_argument("--straggler-episodes", dest="straggler_episodes", metavar="FACTOR:SECONDS",
                   help="stragglers that come and go: one worker at a time is FACTOR times slower, the next one "
                        "every SECONDS of the run, round-robin (needs --compute-time; default off)")
    g.add_argument("--device",
                   help="where workers train: auto (default) takes cuda:<i> when GPUs are visible, i being the "
                        "worker's index among the node's workers; cuda insists on a GPU; servers: --server-device")
    g.add_argument("--cuda-aware", dest="cuda_aware",
                   help="push gradients straight from GPU memory (yes) or through pinned host buffers (no); "
                        "auto (default) asks the MPI library and its vendor's variables")
    g.add_argument("--server-device", dest="server_device",
                   help="where the server shards keep and step their slice, its optimizer state and sums: host "
                        "(default: in the window's host memory), cuda (the shard's GPU, the i-th shard of a node on "
                        "cuda:<i>; MPI still moves host memory) or cpu (the same code on the CPU, for tests)")
    g.add_argument("--threads", type=int, help="torch threads per rank (default {default})")
    g.add_argument("--compress", metavar="{none,bf16,fp16,topk:RATIO}",
                   help="what moves on the wire: none (fp32, default); bf16 or fp16 (pushes and pulls in 16 bits, "
                        "half the bytes; the servers keep fp32 weights and optimizer state); topk:RATIO (pushes "
                        "carry the RATIO largest-magnitude values of each shard's slice, the rest fed back into "
                        "the worker's next gradient; pulls stay fp32)")
    g.add_argument("--partition-mb", dest="partition_mb", metavar="MB|auto",
                   help="pull in partitions of MB megabytes, in the order the forward pass uses the layers, and "
                        "start each layer as soon as its own have arrived, and push each as backward produces it "
                        "(CPU workers; not eager, which pulls behind its computation); 0: whole transfers; auto "
                        "(default {default}): a fortieth of the model, within 0.1-4 MB, where the shards send the "
                        "rounds (a sixteenth, within 0.25-4 MB, where the workers read them), where the job spans "
                        "nodes, the workers use the CPU and the model is 4 MB or more, else whole transfers")
    g.add_argument("--shards-at-once", type=int, dest="shards_at_once", metavar="K",
                   help="a worker's (and a group server's) push goes to, and its pull reads from, at most K "
                        "shards at once, each starting its rotation at a different shard, so that no link carries "
                        "every worker's push or every shard's reply at once (over TCP on slow links, such a fan-in "
                        "collapses); default {default}: every shard at once")
    g.add_argument("--pull", choices=["auto", "get", "send"],
                   help="how a worker gets a round's parameters under bsp and its presets (localsgd, diloco): get "
                        "(each worker reads them out of the shards' windows after its grant, one-sided, as under "
                        "every paradigm) or send (each shard sends them to every worker as the round closes, "
                        "two-sided: over TCP it saves the reads' round trips); not with 16-bit pulls (--compress "
                        "bf16/fp16), --overlap-steps or --shards-at-once; auto (default {default}): send where the "
                        "job spans nodes and nothing needs reads, else get (within a node both take the same time)")
    g = t.add_argument_group("failures")
    g.add_argument("--nonfinite", help="skip (drop the gradient, recorded with reason 1) or abort the job when a "
                                       "worker pushes a gradient with NaN or Inf (default {default})")
    g.add_argument("--divergence",
                   help="stop (default): end the run, with one line saying what to try, when the workers' training "
                        "loss turns non-finite (3 steps in a row) or its recent mean exceeds 3x its start; the summary "
                        "says stopped_by diverged and the exit status is 3; ignore: train on")
    g.add_argument("--fault", action="append", metavar="KIND@RANK:STEP",
                   help="testing: inject a fault in worker RANK at STEP; KIND is nan, raise, exit, kill, killhead, killverdict, hang or usr1 (repeatable; under hpcps supervise, in the first launch only)")
    g.add_argument("--spare-workers", type=int, dest="spare_workers", metavar="K",
                   help="the last K ranks wait as spares: under Open MPI's fault tolerance (mpirun --with-ft ulfm) "
                        "a spare takes a dead worker's place, its share of the data and its clock, and the run "
                        "trains its planned amount (asp, ssp, dssp, eager, with or without --local-steps; "
                        "default {default})")
    g.add_argument("--respawn", action=argparse.BooleanOptionalAction,
                   help="under Open MPI's fault tolerance (mpirun --with-ft ulfm), a worker's death stops the run at "
                        "a checkpoint; the job spawns a process in the dead worker's place (its share of the data "
                        "and its clock) and every rank resumes on the grown job, the next part's metrics in "
                        "OUT-respawnK.h5 (asp, ssp, dssp, eager; default {default})")
    g.add_argument("--stall-warn", type=float, dest="stall_warn", metavar="SECONDS",
                   help="log which ranks a server or worker has waited on for this long, and in what state (default {default})")
    g.add_argument("--stall-abort", type=float, dest="stall_abort", metavar="SECONDS",
                   help="end the job when a worker the servers wait on has been silent this long (default {default}; "
                        "0: never)")
    g = t.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-every", type=int, dest="checkpoint_every", metavar="VERSIONS",
                   help="write a checkpoint every VERSIONS versions of shard 0 (bsp: rounds), while the run goes "
                        "on, under every paradigm (hsp: at the next round's close; HDF5, written atomically)")
    g.add_argument("--checkpoint-interval", type=float, dest="checkpoint_interval", metavar="SECONDS",
                   help="every paradigm but bsp: write a checkpoint every SECONDS seconds (with or instead of "
                        "--checkpoint-every)")
    g.add_argument("--checkpoint-dir", dest="checkpoint_dir", metavar="DIR",
                   help="where checkpoints go, as step-NNNNNN.h5 (default: the run's own, $HPCPS_RUN_DIR/checkpoints "
                        "in a batch job, else beside the metrics file: runs/NAME-checkpoints)")
    g.add_argument("--resume", metavar="CKPT", help="continue the run from checkpoint CKPT (bsp's periodic "
                   "ones: exactly; one written when a signal stopped a run: where each worker left off); auto: "
                   "the newest complete checkpoint of the checkpoint directory, or a fresh start where it has "
                   "none (for hpcps supervise and requeued jobs)")
    g = t.add_argument_group("output")
    g.add_argument("--out", metavar="FILE.h5", help="metrics file (default runs/<paradigm>-<timestamp>.h5)")
    g.add_argument("--eval-interval", type=float, dest="eval_interval", metavar="SECONDS",
                   help="evaluate the global parameters this often (default {default})")
    g.add_argument("--eval-every", type=int, dest="eval_every", metavar="VERSIONS",
                   help="evaluate every VERSIONS updates of shard 0 instead of every --eval-interval seconds")
    g.add_argument("--log-every", type=float, dest="log_every", metavar="SECONDS",
                   help="the evaluation's console line at most this often (default {default})")
    g.add_argument("--eval-batch-size", type=int, dest="eval_batch_size", metavar="N",
                   help="held-out samples per forward pass of an evaluation (default {default})")
    g.add_argument("--save", metavar="FILE.pt",
                   help="write the trained model's state_dict here at the end (default: the metrics file's "
                        "name with .pt)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction,
                   help="progress on rank 0: a bar when stderr is a terminal, else a status line every "
                        "--progress-every seconds (default {default})")
    g.add_argument("--progress-every", type=float, dest="progress_every", metavar="SECONDS",
                   help="seconds between status lines when stderr is not a terminal (default {default})")
    g.add_argument("--tensorboard", metavar="DIR",
                   help="rank 0 also writes the run live as TensorBoard scalars (loss, lr, staleness, step time and "
                        "its phases per worker, evaluations, ps.log values) in DIR/<run file's name>: watch with "
                        "tensorboard --logdir DIR; needs the tensorboard package")
    g.add_argument("--timeline", action=argparse.BooleanOptionalAction,
                   help="record where every rank's time goes, phase by phase (receive, step, publish, push, "
                        "pull, ...), in the metrics file's /timeline; hpcps report draws it and writes it as a Chrome trace "
                        "(default {default})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hpcps", description="Parameter-server training of PyTorch models over MPI.")
    parser.add_argument("--version", action="version", version=f"hpcps {hpcps.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", argument_default=argparse.SUPPRESS,
                       help="train a model (launch under mpiexec/srun)",
                       description="Train under one synchronization paradigm; launch with mpiexec -n N or srun. "
                                   "Ranks 0..S-1 are server shards, the rest workers. Every option can also "
                                   "be set in the --config TOML file; flags override it.")
    add_train_options(t)
    t.set_defaults(func=_train)

    u = sub.add_parser("tune", argument_default=argparse.SUPPRESS,
                       help="try a job's layouts on its own model, data and ranks; rank them by measured speed "
                            "(launch under mpiexec/srun)",
                       description="Launched as the job would be, with hpcps train's options: short trials of "
                                   "the layouts (--servers, --pull, --partition-mb, --shards-at-once) the options "
                                   "leave open, the options as given first; prints them ranked by batches a "
                                   "second, and the command line of the best. The options you set are kept. "
                                   "The paradigm is not tuned, unless it is --paradigm auto: then its trials "
                                   "are the paradigms', as hpcps train --paradigm auto runs them.")
    u.add_argument("--top", type=int, default=3, metavar="K", help="command lines printed (default {default})")
    add_train_options(u)
    u.set_defaults(func=_tune)

    c = sub.add_parser("check", help="is this allocation fit for hpcps? (launch under mpiexec/srun)",
                       description="Run under the job's launcher on a new allocation (srun -n 8 hpcps check, "
                                   "mpiexec -n 4 hpcps check). In about a minute it prints the MPI library, thread "
                                   "level and RMA memory model, whether a pull progresses while its target "
                                   "computes, the GPUs and CUDA-awareness, ranks per node, and each path's "
                                   "bandwidth (in --link units) and latency; then one line per problem with what "
                                   "to do, and a verdict. Exit status 1 where hpcps would not work.")
    c.add_argument("--seconds", type=float, default=0.5, metavar="S",
                   help="how long each bandwidth measurement streams (default 0.5; a fan-in three times as "
                        "long)")
    c.add_argument("--busy", type=float, default=1.0, metavar="S",
                   help="how long the pulls' target computes without MPI in the progress test (default 1.0)")
    c.set_defaults(func=_check)

    r = sub.add_parser("report", help="plots and tables comparing runs (no MPI needed)",
                       description="Compare runs from their HDF5 metrics files: PNG plots (accuracy and loss "
                                   "against wall time, iterations/s per worker, time breakdown per worker, "
                                   "staleness histogram, DSSP bounds over time) and a Markdown/CSV table.")
    r.add_argument("runs", nargs="+", metavar="RUN.h5", help="metrics files written by hpcps train")
    r.add_argument("--out", metavar="DIR", help="directory for the plots and tables")
    r.add_argument("--tensorboard", metavar="DIR",
                   help="write the runs as TensorBoard event files, each in a folder of DIR named after its run "
                        "file (side by side: tensorboard --logdir DIR); needs the tensorboard package")
    r.add_argument("--target", type=float, default=0.9, metavar="ACC",
                   help="accuracy whose first evaluation counts as time-to-target (default 0.9)")
    r.set_defaults(func=_report)

    m = sub.add_parser("simulate", help="predict throughput, waiting and staleness at any scale (no MPI needed)",
                       description="Discrete-event model of a job driving the real policy objects: per-worker "
                                   "compute times, link latency and bandwidth, server costs. Prints a table; "
                                   "--out writes simulate.csv and simulated_throughput.png.")
    m.add_argument("--paradigm", nargs="+", metavar="NAME",
                   help="paradigms to model (default bsp asp ssp dssp eager grouped, with --nodes bsp asp ssp dssp; "
                        "hsp is not modelled), or your own as path/file.py:Class or pkg.mod:Class")
    m.add_argument("--paradigm-option", action="append", default=[], dest="paradigm_option", metavar="NAME=VALUE",
                   help="an option of your own paradigm (repeatable), as hpcps train takes it")
    m.add_argument("--workers", nargs="+", type=int, default=[4, 16, 64, 256, 1024, 4096], metavar="N",
                   help="worker counts (default 4 16 64 256 1024 4096)")
    m.add_argument("--steps", type=int, default=20, help="iterations per worker (default 20)")
    m.add_argument("--params", type=int, default=9610, help="float32 parameters (default 9610: the default MLP)")
    m.add_argument("--compute-time", dest="compute_time", type=float, default=0.01, metavar="SECONDS",
                   help="mean compute time per iteration (default 0.01)")
    m.add_argument("--jitter", choices=["none", "uniform", "exponential", "lognormal"], default="none")
    m.add_argument("--jitter-cv", dest="jitter_cv", type=float, default=0.1)
    m.add_argument("--straggler", type=float, default=1.0, metavar="F", help="the last worker is F times slower")
    m.add_argument("--staleness", type=int, default=2, help="ssp bound, dssp s_lo (default 2)")
    m.add_argument("--groups", type=int, default=2, metavar="G",
                   help="grouped: group servers, over contiguous blocks of workers (default 2)")
    m.add_argument("--local-steps", dest="local_steps", type=int, metavar="H",
                   help="computations per push (the local-SGD family; default 1, 8 under localsgd and diloco): "
                        "--steps counts the batches, iterations/s too")
    m.add_argument("--overlap-steps", dest="overlap_steps", type=int, default=0, metavar="T",
                   help="of a round's computations, those before its pull, as hpcps train's --overlap-steps "
                        "(default 0)")
    m.add_argument("--latency", type=float, default=50e-6, help="seconds per transfer (default 50e-6)")
    m.add_argument("--bandwidth", type=float, default=10e9, help="bytes/s of a transfer (default 10e9)")
    m.add_argument("--link", action="append", default=[], metavar="[NODE=]RATE",
                   help="per-node links, as hpcps emulate takes them (node 0: the server, node k: worker k-1; "
                        "e.g. --link 1gbit --link 0=4gbit): transfers then share the server's link; replaces "
                        "--bandwidth (repeatable)")
    m.add_argument("--nodes", type=int, metavar="N",
                   help="a shard beside the workers on each of N nodes (the layout --servers auto picks when a job "
                        "spans nodes), the workers spread evenly over them: --workers counts them all, and --link "
                        "names the N nodes' links (node k: shard k and its workers)")
    m.add_argument("--pull", choices=["get", "send"],
                   help="with --nodes: the workers read every shard once all have granted them (get, default), or "
                        "each shard sends its part as it grants (send), as hpcps train's --pull")
    m.add_argument("--partitioned", action="store_true",
                   help="with --nodes: pulls in partitions, the forward pass running as they come (--partition-mb)")
    m.add_argument("--compute-forward", dest="compute_forward", type=float, default=0.0, metavar="SHARE",
                   help="with --nodes: the share of the compute in the forward pass (default 0), as hpcps train's")
    m.add_argument("--compute-backward", dest="compute_backward", type=float, default=0.0, metavar="SHARE",
                   help="with --nodes: the share of the compute in the backward pass, where the push leaves "
                        "(default 0), as hpcps train's")
    m.add_argument("--server-s", dest="server_s", type=float, default=20e-6,
                   help="server seconds per push handled (default 20e-6)")
    m.add_argument("--apply-rate", dest="apply_rate", type=float, default=5e9,
                   help="bytes/s the server applies updates at (default 5e9)")
    m.add_argument("--update-s", dest="update_s", type=float, default=0.0,
                   help="server seconds per gradient when an update closes: row, receipt, grant (default 0)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", metavar="DIR", help="write simulate.csv and simulated_throughput.png here")
    m.set_defaults(func=_simulate)

    jobs = sub.add_parser("jobs", help="batch job scripts (Slurm, PBS, LSF, plain mpiexec)")
    jsub = jobs.add_subparsers(dest="jobs_command", required=True, parser_class=_Parser)
    j = jsub.add_parser("render", help="print a ready batch script",
                        usage="hpcps jobs render {slurm,pbs,lsf,mpiexec} [options] -- [hpcps train options]",
                        description="Print a batch script that runs hpcps train with the options after --, "
                                    "unchanged. Example: hpcps jobs render slurm --nodes 2 --ntasks-per-node 4 "
                                    "--gpus-per-node 4 -- --paradigm dssp --steps 1000 > job.sbatch")
    j.add_argument("scheduler", choices=["slurm", "pbs", "lsf", "mpiexec"])
    j.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    j.add_argument("--ntasks-per-node", type=int, default=5, dest="ntasks_per_node",
                   help="MPI ranks per node (default 5)")
    j.add_argument("--gpus-per-node", type=int, default=0, dest="gpus_per_node", help="GPUs per node (default 0)")
    j.add_argument("--cpus-per-task", type=int, default=1, dest="cpus_per_task",
                   help="cores per rank; also OMP_NUM_THREADS (default 1)")
    j.add_argument("--time", default="01:00:00", metavar="HH:MM:SS", help="wall time (default 01:00:00)")
    j.add_argument("--partition", metavar="P", help="partition (Slurm) or queue (PBS, LSF)")
    j.add_argument("--account", metavar="A", help="account (Slurm, PBS) or project (LSF) to charge")
    j.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line run before the launch, e.g. 'module load openmpi' (repeatable)")
    j.add_argument("--mpi", metavar="PLUGIN", help="Slurm: srun --mpi plugin, e.g. pmi2 (MPICH) or pmix "
                                                  "(Open MPI); default: the site's MpiDefault")
    j.add_argument("--mpi-family", dest="mpi_family", default="auto", metavar="{auto,mpich,openmpi,intel-mpi}",
                   help="the MPI the job runs, which picks its launcher: Open MPI's mpirun (with --mpi: srun), "
                        "Intel's mpiexec.hydra, MPICH's mpiexec (srun on Slurm); auto "
                        "(default): the MPI of the mpiexec beside this Python, else on PATH")
    j.add_argument("--name", default="hpcps", help="job name, also in output file names (default hpcps)")
    j.add_argument("--script", metavar="FILE.py",
                   help="launch python FILE.py (your script calling hpcps.train) instead of hpcps train; the "
                        "arguments after -- go to it unchanged, and HPCPS_RUN_DIR names the job's run directory")
    j.add_argument("--stop-before", type=int, dest="stop_before", metavar="SECONDS",
                   help="Slurm, LSF: signal hpcps this long before the time limit, so it stops and writes a "
                        "checkpoint (default 120, less in jobs shorter than 3 minutes; 0: never). PBS sends "
                        "SIGTERM at the limit, handled alike")
    j.add_argument("--restarts", type=int, default=0, metavar="N",
                   help="launch hpcps train under hpcps supervise with --resume auto: a launch that fails (a rank "
                        "or, under Slurm with --no-kill, a node died) runs again at most N times from the newest "
                        "complete checkpoint, under Slurm on the nodes still alive (default 0: never)")
    j.set_defaults(func=_jobs_render, train_args=[])  # the hpcps train options after --: see main()

    e = sub.add_parser("emulate", help="run a job on an emulated cluster: nodes joined by rate-limited links "
                                       "(Linux, root)",
                       usage="hpcps emulate --nodes M [options] -- COMMAND [ARGS ...]",
                       description="Build a cluster in a box (one network namespace per node, each joined to a "
                                   "switch by a link shaped with tbf), run COMMAND on its ranks under mpiexec over "
                                   "TCP, and remove the box, whatever happens. Example: hpcps emulate --nodes 5 "
                                   "--link 1gbit --link 0=4gbit -- hpcps train --paradigm asp --compute-time 0.05")
    e.add_argument("--nodes", type=int, metavar="M", help="emulated nodes")
    e.add_argument("--link", action="append", default=[], metavar="[NODE=]RATE",
                   help="link rate, each direction: RATE for every node, NODE=RATE or FIRST-LAST=RATE for some "
                        "(a network straggler); units bit, kbit, mbit, gbit (default 1gbit; repeatable, later wins)")
    e.add_argument("--buffer", default="512kb", metavar="SIZE",
                   help="the switch's queue per port, in bytes (kb, mb, kib, mib): a small one makes incast drop "
                        "packets (default 512kb)")
    e.add_argument("--ranks-per-node", type=int, default=1, dest="ranks_per_node", metavar="R",
                   help="MPI ranks on each node (default 1); ranks fill the nodes in order")
    e.add_argument("--ranks", action="append", default=[], metavar="NODE=COUNT",
                   help="ranks on some nodes, e.g. 0=2 or 1-4=1 (repeatable)")
    e.add_argument("--congestion", default=CONGESTION, metavar="ALGORITHM",
                   help=f"the nodes' TCP congestion control (default {CONGESTION}, Linux's own default, so that "
                        "timings do not depend on the host's setting; reno, bbr, or host for the host's own: under bbr "
                        "a parameter server's incasts kept the switch's ports overflowing, docs/box.md)")
    e.add_argument("--cleanup", action="store_true",
                   help="remove every box left behind by an hpcps emulate that is gone, and exit")
    e.add_argument("--chaos", action="append", default=[], metavar="KIND:NODE@SECONDS",
                   help="a fault while the job runs, SECONDS after its launch: kill:NODE (every process of the "
                        "node gets SIGKILL, as when it dies) or down:NODE (its link goes down; down:NODE@S/D: "
                        "for D seconds); NODE random: one other than node 0, drawn from --chaos-seed "
                        "(repeatable)")
    e.add_argument("--chaos-seed", type=int, default=0, dest="chaos_seed", metavar="N",
                   help="the seed that draws --chaos's random nodes (default 0)")
    e.add_argument("--ulfm", action="store_true",
                   help="Open MPI: launch with its fault tolerance (--with-ft ulfm), so that a worker's death, a "
                        "node's under --chaos kill, is run through (docs/running.md)")
    e.add_argument("--link-trace", dest="link_trace", metavar="FILE",
                   help="sample every node's bytes in and out each millisecond through the job, write them to "
                        "FILE (.npz) and say how full and how often idle each link was (docs/box.md)")
    e.add_argument("--dry-run", action="store_true", dest="dry_run",
                   help="print the commands that would build the box and start the job, and exit")
    e.set_defaults(func=_emulate, command_args=[])  # the job's command after --: see main()

    v = sub.add_parser("supervise", help="launch a job again when it fails (a rank died or was killed), "
                                         "resuming from its newest checkpoint",
                       usage="hpcps supervise [--restarts N] [--delay SECONDS] -- COMMAND [ARGS ...]",
                       description="Run COMMAND, and run it again when it fails for a reason that is not the "
                                   "user's: not bad input (exit 2), not a diverged run (exit 3), not a stop "
                                   "signal. Give hpcps train --resume auto and periodic checkpoints, so each "
                                   "launch resumes where the last complete checkpoint left off. Example: hpcps "
                                   "supervise --restarts 3 -- mpiexec -n 5 hpcps train --paradigm asp "
                                   "--checkpoint-interval 30 --out runs/asp.h5 --resume auto")
    v.add_argument("--restarts", type=int, default=3, metavar="N", help="launch again at most N times (default 3)")
    v.add_argument("--delay", type=float, default=1.0, metavar="SECONDS",
                   help="wait this long before launching again (default 1)")
    v.set_defaults(func=_supervise, command_args=[])  # the job's command after --: see main()
    return parser


def _supervise(args: argparse.Namespace) -> int:
    from hpcps.jobs.supervise import Supervisor
    from hpcps.log import setup_logging

    if not args.command_args:
        raise UserError("hpcps supervise: give the job's command after --, e.g. -- mpiexec -n 5 hpcps train "
                        "--resume auto --checkpoint-every 50 --out runs/bsp.h5")
    if args.restarts < 0 or args.delay < 0:
        raise UserError("hpcps supervise: --restarts and --delay take values of 0 or more")
    setup_logging(0, "supervisor")
    return Supervisor(args.command_args, restarts=args.restarts, delay=args.delay).run()


def _start_job(args: argparse.Namespace, own: tuple[str, ...] = (), check=None):
    """What ``hpcps train`` and ``hpcps tune`` do first, on every rank: catch signals before MPI and torch
    load (a signal during start-up stops the run cleanly), log, check the world's size (and ``check()``, the
    command's own options). Returns MPI's world and the train options of ``args`` (less ``own``), or the exit
    status of a user error, said once."""
    from hpcps.runtime.signals import catch_early

    catch_early()
    from mpi4py import MPI

    from hpcps.cluster.launcher import check_world
    from hpcps.log import setup_logging

    comm = MPI.COMM_WORLD
    setup_logging(comm.rank)
    try:
        check_world(comm.size)
        if check is not None:
            check()
    except UserError as exc:
        return _user_error(exc, show=launcher_rank() == 0)
    skip = ("command", "func", "config", "command_line", *own)
    return comm, {k: v for k, v in vars(args).items() if k not in skip}


def _train(args: argparse.Namespace) -> int:
    started = _start_job(args)
    if isinstance(started, int):
        return started
    comm, flags = started
    from hpcps.runtime.agree import agree, run_or_end
    from hpcps.options.config import make_config
    from hpcps.runtime.faults import InjectedFault
    from hpcps.options.planning import resolve_each
    from hpcps.cluster.placement import node_ids

    def train():
        cfg = agree(comm, lambda: make_config(flags, config_file=getattr(args, "config", None)))
        # torch (~2 s a rank, minutes for a large job on a shared file system) only once the options and their
        # fit to the world size are known good: a mistyped option is answered at once
        nodes = node_ids(comm)
        agree(comm, lambda: resolve_each(cfg, comm.size, nodes))
        from hpcps.runtime.respawn import respawning
        from hpcps.runtime.run import run_training
        from hpcps.runtime.tune import run_chosen

        # (--paradigm auto: its trials first; --respawn: the run again on a grown job after a death)
        return run_chosen(cfg, comm, respawning(run_training))  # (a trial never respawns: tune.TRIAL)

    value, status = run_or_end(comm, train, quiet=(InjectedFault,))
    from hpcps.transport.failures import end_without_the_dead

    result = value[1] if value is not None else None
    if result is not None and result.summary.get("stopped_by") == "diverged":
        status = DIVERGED_STATUS
    end_without_the_dead(status)
    return status  # rank 0 has logged the run's one summary line


#: options of hpcps tune's own (--top) or read only by it (--trial-steps), each with a value: left out of the
#: hpcps train commands it prints
TUNE_OPTIONS = ("--trial-steps", "--top")


def _tune(args: argparse.Namespace) -> int:
    def check():
        if args.top < 1:
            raise UserError("hpcps tune: --top takes 1 or more")

    started = _start_job(args, ("top",), check)
    if isinstance(started, int):
        return started
    comm, flags = started
    from hpcps.options.config import make_config
    from hpcps.runtime.agree import agree, run_or_end
    from hpcps.options.words import without_options
    words = without_options(args.command_line[1:], one=TUNE_OPTIONS)  # hpcps train's, for the commands printed

    def tune():
        from hpcps.runtime.run import run_training
        from hpcps.runtime.tune import run_tune

        cfg = agree(comm, lambda: make_config(flags, config_file=getattr(args, "config", None)))
        return run_tune(cfg, list(flags), comm, top=args.top, train_words=words, train=run_training)

    _, status = run_or_end(comm, tune)
    return status


def _check(args: argparse.Namespace) -> int:
    # MPI first: its finalisation at exit holds every rank until all are done, so rank 0's line is out before
    # a launcher (Open MPI's) ends the job on another rank's exit status
    from mpi4py import MPI

    if args.seconds <= 0 or args.busy <= 0:  # (said once: every rank of the job parsed the same flags)
        return _user_error(UserError("hpcps check: --seconds and --busy take a positive number of seconds"),
                           show=MPI.COMM_WORLD.rank == 0)

    from hpcps.cluster.launcher import check_world
    from hpcps.runtime.agree import run_or_end
    from hpcps.check.run import run_check

    comm = MPI.COMM_WORLD
    try:
        check_world(comm.size)
    except UserError as exc:
        return _user_error(exc, show=launcher_rank() == 0)
    status, failed = run_or_end(comm, lambda: run_check(comm, seconds=args.seconds, busy_s=args.busy))
    return failed or status


def _report(args: argparse.Namespace) -> int:
    if args.out is None and args.tensorboard is None:
        raise UserError("hpcps report: say where: --out DIR (plots and tables), --tensorboard DIR (event files), "
                        "or both")
    if args.tensorboard is not None:
        from hpcps.metrics.board import export

        for folder in export(args.runs, args.tensorboard):
            print(folder)
    if args.out is not None:
        from hpcps.analysis.report import make_report

        for path in make_report(args.runs, args.out, target=args.target):
            print(path)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from hpcps.analysis.simulate import Machine, sweep, write_outputs
    from hpcps.options.config import parse_paradigm_option

    layout = {"pull": None, "partitioned": False, "compute_forward": 0.0, "compute_backward": 0.0}
    given = [name for name, default in layout.items() if getattr(args, name) != default]
    if args.nodes is None and given:
        raise UserError(f"simulate: --{given[0].replace('_', '-')} models a shard per node: give --nodes too")
    if args.nodes is not None and (args.local_steps or args.overlap_steps):
        raise UserError("simulate: --nodes models no local steps: leave out --local-steps and --overlap-steps")
    if args.nodes is not None and args.groups != 2:
        raise UserError("simulate: --groups: grouped is not modelled with --nodes (its group servers are a layout "
                        "of their own)")
    try:
        options = dict(parse_paradigm_option(spec) for spec in args.paradigm_option)
        common = dict(straggler=args.straggler, steps=args.steps, progress=sys.stderr.isatty(),
                      links=args.link or None, nbytes=4 * args.params, compute_time=args.compute_time,
                      jitter=args.jitter, jitter_cv=args.jitter_cv, staleness=args.staleness, seed=args.seed,
                      options=options, machine=Machine(args.latency, args.bandwidth, args.server_s, args.apply_rate,
                                                       args.update_s))
        if args.nodes is None:
            predictions = sweep(args.paradigm or ["bsp", "asp", "ssp", "dssp", "eager", "grouped"], args.workers,
                                groups=args.groups, local_steps=args.local_steps, overlap_steps=args.overlap_steps,
                                **common)
        else:
            from hpcps.analysis.simulate_shards import sweep_shards

            predictions = sweep_shards(args.paradigm or ["bsp", "asp", "ssp", "dssp"], args.workers, args.nodes,
                                       pull=args.pull or "get", partitioned=args.partitioned, forward=args.compute_forward,
                                       backward=args.compute_backward, **common)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print("| paradigm | workers | iterations/s | mean wait ms | mean staleness |")
    print("|---|---|---|---|---|")
    for r in predictions:
        print(f"| {r.paradigm} | {r.workers} | {r.throughput:.1f} | {r.mean_wait_s * 1e3:.2f} | "
              f"{r.mean_staleness:.2f} |")
    if args.out:
        settings = ((f"a shard on each of {args.nodes} nodes, pull {args.pull or 'get'}, " if args.nodes else "")
                    + f"{args.params:,} parameters, compute {args.compute_time * 1e3:g} ms, jitter {args.jitter}, "
                    f"straggler {args.straggler:g}x, staleness {args.staleness}, {args.steps} steps"
                    + (f", {args.local_steps} local steps" if args.local_steps else "")
                    + (f", {args.overlap_steps} overlapped" if args.overlap_steps else ""))
        for path in write_outputs(predictions, args.out, settings):
            print(path)
    return 0


class _CheckParser(_Parser):
    """Parses ``hpcps train`` options for ``jobs render``: an error is a UserError, not an exit."""

    def error(self, message: str):
        raise UserError(f"after --: {message}")


def check_train_options(train_args: list[str], nodes: int, per_node: int) -> None:
    """UserError, naming the option, if ``hpcps train`` would refuse these options on ``nodes`` nodes of
    ``per_node`` ranks each."""
    ranks = nodes * per_node
    from hpcps.options.config import make_config
    from hpcps.options.effects import no_effect
    from hpcps.options.planning import resolve_each

    checker = _CheckParser(prog="hpcps train", argument_default=argparse.SUPPRESS)
    add_train_options(checker)
    args = train_args[1:] if train_args[:1] == ["--"] else train_args
    flags = vars(checker.parse_args(args))
    config = flags.pop("config", None)
    cfg = make_config(flags, config_file=config)
    try:
        each = resolve_each(cfg, ranks, [r // per_node for r in range(ranks)])
    except UserError as exc:
        raise UserError(f"{exc} [this job: --nodes x --ntasks-per-node = {ranks} ranks]") from None
    for line in dict.fromkeys(line for c, paradigm, _ in each for line in no_effect(c, paradigm)):
        print(f"hpcps: warning: {line}", file=sys.stderr)


def detect_mpi_family() -> str | None:
    """The MPI family of the mpiexec beside this Python (else on PATH), where it is one hpcps knows."""
    from hpcps.cluster.launcher import find_mpiexec, launcher_family
    from hpcps.jobs.render import MPI_FAMILIES

    mpiexec = find_mpiexec()
    family = launcher_family(mpiexec) if mpiexec else None
    return family if family in MPI_FAMILIES else None


def _jobs_render(args: argparse.Namespace) -> int:
    import shlex

    from hpcps.jobs.render import JobSpec, render

    spec = JobSpec(**{k: v for k, v in vars(args).items()
                      if k not in ("command", "jobs_command", "func", "command_line")})
    if spec.mpi_family == "auto":
        spec.mpi_family = detect_mpi_family()
    if spec.script is None:  # a script's arguments are its own
        check_train_options(spec.train_args, spec.nodes, spec.ntasks_per_node)
    sys.stdout.write(render(spec, command=shlex.join(["hpcps", *args.command_line])))
    return 0


def _emulate(args: argparse.Namespace) -> int:
    from hpcps.box import chaos, launch, net
    from hpcps.runtime.faults import ATTEMPT_VAR
    from hpcps.box.spec import make_cluster

    if net.needs_user_namespace() and not args.dry_run:
        return launch.in_user_namespace(args.command_line)
    if args.cleanup:
        return launch.cleanup()
    if args.nodes is None:
        raise UserError("hpcps emulate: give --nodes M (or --cleanup)")
    if not args.command_args:
        raise UserError("hpcps emulate: give the job's command after --, e.g. -- hpcps train --paradigm asp")
    try:
        cluster = make_cluster(args.nodes, args.link, buffer=args.buffer, ranks_per_node=args.ranks_per_node,
                               ranks=args.ranks, prefix=f"hpcps{os.getpid()}-", congestion=args.congestion)
    except ValueError as exc:
        raise UserError(f"hpcps emulate: {exc}") from None
    try:
        faults = chaos.parse(args.chaos, len(cluster.nodes), args.chaos_seed)
    except ValueError as exc:
        raise UserError(f"hpcps emulate: {exc}") from None
    if faults and int(os.environ.get(ATTEMPT_VAR, "1") or 1) > 1:  # a supervised relaunch would meet them again
        print(f"hpcps emulate: --chaos is for the first launch only; this is launch {os.environ[ATTEMPT_VAR]}",
              file=sys.stderr)
        faults = []
    if args.dry_run:
        for fault in faults:
            print(f"# chaos at {fault.at:g} s: {fault.describe()}")
        return launch.dry_run(cluster, args.command_args, ulfm=args.ulfm, link_trace=args.link_trace)
    return launch.emulate(cluster, args.command_args, chaos=faults, ulfm=args.ulfm, link_trace=args.link_trace)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    original, passthrough = list(argv), None
    # everything after -- belongs to hpcps train (jobs render) or is the job's command (emulate)
    if (argv[:2] == ["jobs", "render"] or argv[:1] in (["emulate"], ["supervise"])) and "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    if passthrough is not None:
        setattr(args, "command_args" if argv[0] in ("emulate", "supervise") else "train_args", passthrough)
    args.command_line = original
    try:
        return args.func(args)
    except UserError as exc:  # report, jobs render; train handles its own (rank by rank)
        return _user_error(exc)
