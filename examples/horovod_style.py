#!/usr/bin/env python3
"""A data-parallel loop written for Horovod or DDP, on the parameter servers: what each line becomes.

The loop has the parts such scripts have (Horovod's ImageNet example, torchvision's reference
scripts): momentum SGD with weight decay, the learning rate scaled by the worker count and warmed
up per batch, then cut by 10 at fixed epochs, edited in the optimizer's param groups; a
DistributedSampler per epoch; gradients accumulated over sub-batches; a validation loss averaged
over the workers; the optimizer's state saved with the model each epoch. The data are synthetic (random labels: the loss need not fall); the model is a
small CNN.

    mpiexec -n 5 python examples/horovod_style.py --epochs 3

What changed against the Horovod script (``docs/own-model.md``, "Porting a Horovod or DDP script"):
``hvd.init()`` and ``hvd.DistributedOptimizer(optim.SGD(...))`` became ``hpcps.init(...,
optimizer=...)``; ``hvd.size()``/``hvd.rank()`` became ``ps.n_workers``/``ps.worker_index``;
``optimizer`` became ``ps.optimizer`` and ``optimizer.step()`` ``ps.step()``; ``hvd.allreduce`` of a
metric became ``ps.mean``, and the validation's print also ``ps.evaluated`` (the run's evaluation in
its summary and report); the broadcasts of parameters and optimizer state went (every rank builds the
same model and the optimizer lives on the servers); ``optimizer.state_dict()`` in the epoch's
checkpoint is ``ps.optimizer.state_dict()``, the servers' state gathered.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from mpi4py import MPI

import hpcps


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(4),
                               torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10))


def warmup_then_steps(epoch: int, done: float, *, warmup: float, n_workers: int, cuts: tuple[int, ...]) -> float:
    """Goyal et al.'s rule, as Horovod's example has it: from 1/N of the scaled rate to all of it over the
    warm-up epochs (counted per batch: ``done`` is the share of the epoch done after this batch), then a
    tenth from each epoch of ``cuts`` on."""
    if epoch < warmup:
        e = epoch + done
        return 1.0 / n_workers * (e * (n_workers - 1) / warmup + 1)
    return 0.1 ** sum(epoch >= c for c in cuts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--batches-per-step", type=int, default=2, help="sub-batches accumulated per step")
    p.add_argument("--base-lr", type=float, default=0.0125, help="per worker, scaled by the worker count")
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--cuts", type=int, nargs="*", default=[2], help="epochs at which the rate drops 10x")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--paradigm", default="bsp")
    p.add_argument("--out", default=None)
    p.add_argument("--checkpoint-format", default=None, help="save model and optimizer here each epoch "
                   "(worker 0), as Horovod's example does: e.g. ckpt-{epoch}.pt")
    args = p.parse_args()

    world = MPI.COMM_WORLD
    # the worker count is known before init (the learning rate and the steps depend on it); hvd.size()
    n_workers = world.size - args.servers
    g = torch.Generator().manual_seed(1)
    train_set = torch.utils.data.TensorDataset(torch.randn(args.samples, 3, 16, 16, generator=g),
                                               torch.randint(0, 10, (args.samples,), generator=g))
    val_set = torch.utils.data.TensorDataset(torch.randn(64, 3, 16, 16, generator=g),
                                             torch.randint(0, 10, (64,), generator=g))
    step_batch = args.batch_size * args.batches_per_step
    steps_per_epoch = math.ceil(args.samples / n_workers / step_batch)
    scaled_lr = args.base_lr * n_workers * args.batches_per_step

    ps = hpcps.init(net, optimizer="sgd", lr=scaled_lr, momentum=0.9, weight_decay=5e-5, paradigm=args.paradigm,
                    servers=args.servers, steps=args.epochs * steps_per_epoch, divergence="ignore", out=args.out)
    with ps:
        if ps.is_worker:
            sampler = torch.utils.data.distributed.DistributedSampler(train_set, num_replicas=ps.n_workers,
                                                                      rank=ps.worker_index, seed=1)
            loader = torch.utils.data.DataLoader(train_set, batch_size=step_batch, sampler=sampler)
            val_loader = torch.utils.data.DataLoader(val_set, batch_size=args.batch_size, sampler=torch.utils.data.
                                                     distributed.DistributedSampler(val_set, ps.n_workers,
                                                                                    ps.worker_index, shuffle=False))
        for epoch in range(args.epochs):
            if not ps.running:
                break
            sampler.set_epoch(epoch)
            for batch_idx, (x, y) in enumerate(loader):
                if not ps.running:
                    break
                # the per-batch schedule, edited in the optimizer's param groups as in the Horovod script
                factor = warmup_then_steps(epoch, (batch_idx + 1) / len(loader), warmup=args.warmup_epochs,
                                           n_workers=ps.n_workers, cuts=tuple(args.cuts))
                for group in ps.optimizer.param_groups:
                    group["lr"] = scaled_lr * factor
                x, y = x.to(ps.device), y.to(ps.device)
                for i in range(0, len(x), args.batch_size):  # sub-batches, their gradients averaged
                    loss = F.cross_entropy(ps.model(x[i:i + args.batch_size]), y[i:i + args.batch_size])
                    (loss / math.ceil(len(x) / args.batch_size)).backward()
                ps.step(loss)
            ps.model.eval()
            with torch.no_grad():
                total = sum(float(F.cross_entropy(ps.model(x.to(ps.device)), y.to(ps.device), reduction="sum"))
                            for x, y in val_loader)
            ps.model.train()
            val_loss = ps.mean(total) * ps.n_workers / len(val_set)  # hvd.allreduce: every worker's share, summed
            ps.log(val_loss=val_loss)
            ps.evaluated(loss=val_loss)  # worker 0's: the run's evaluation
            if args.checkpoint_format and ps.worker_index == 0:  # hvd.rank() == 0
                torch.save({"model": ps.model.state_dict(), "optimizer": ps.optimizer.state_dict()},
                           args.checkpoint_format.format(epoch=epoch + 1))
            if ps.worker_index == 0:
                print(f"epoch {epoch}: validation loss {val_loss:.4f}, lr {ps.optimizer.param_groups[0]['lr']:.5f}",
                      flush=True)
    if ps.worker_index == 0:  # only workers get here: a server rank's process ended in hpcps.init
        print(f"metrics in {ps.path}", flush=True)


if __name__ == "__main__":
    main()
