"""The loop's optimizer edits (hpcps.training.hyper) and a shard optimizer taking them (pure: no MPI)."""

import torch

from hpcps.training.hyper import EditTracker, servers_template, template
from hpcps.training.optim import ShardOptimizer, builtin_optimizer
from hpcps.training.paramgroups import Group, shard_group_indices, shard_groups


def test_only_a_change_is_an_edit_and_every_groups_values_travel():
    opt = torch.optim.SGD([{"params": [torch.zeros(2)]}, {"params": [torch.zeros(3)], "lr": 0.5}], lr=0.1,
                          momentum=0.9)
    told = []
    tracker = EditTracker(template(opt.param_groups), told.append, "SGD")
    assert tracker.edits(opt.param_groups) is None
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)  # writes initial_lr: no edit
    assert tracker.edits(opt.param_groups) is None
    opt.step()
    scheduler.step()
    edits = tracker.edits(opt.param_groups)
    assert [e["lr"] for e in edits] == [opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]]
    assert edits[0]["momentum"] == 0.9 and "params" not in edits[0] and "initial_lr" not in edits[0]
    assert tracker.edits(opt.param_groups) is None  # sent once
    opt.param_groups[1]["momentum"] = 0.0
    assert tracker.edits(opt.param_groups)[1]["momentum"] == 0.0
    assert told == []


def test_a_key_the_servers_optimizer_lacks_is_named_once():
    opt = torch.optim.Adam([torch.zeros(2)], lr=0.1)
    told = []
    tracker = EditTracker(template(opt.param_groups), told.append, "Adam")
    opt.param_groups[0]["momentum"] = 0.5
    tracker.edits(opt.param_groups)
    tracker.edits(opt.param_groups)
    assert len(told) == 1 and "param_groups[0]['momentum']" in told[0] and "Adam has no such" in told[0]


def test_the_servers_template_has_each_groups_own_options():
    groups = [Group({"weight_decay": 0.1}, (("w", 0, 6),)), Group({"weight_decay": 0.0, "lr": 0.2}, (("b", 6, 8),))]
    values, name = servers_template(builtin_optimizer("sgd", lr=0.05, momentum=0.9), groups, 8)
    assert name == "SGD"
    assert [(v["lr"], v["momentum"], v["weight_decay"]) for v in values] == [(0.05, 0.9, 0.1), (0.2, 0.9, 0.0)]


def test_a_shard_holding_the_second_group_only_takes_that_groups_values():
    groups = [Group({}, (("w", 0, 6),)), Group({"lr": 0.2}, (("b", 6, 8),))]
    pieces = [(6, 8)]
    assert shard_group_indices(groups, pieces) == [1]
    opt = ShardOptimizer(torch.zeros(2), builtin_optimizer("sgd", lr=0.05, momentum=0.9), lambda v: 1.0,
                         groups=shard_groups(groups, pieces), indices=shard_group_indices(groups, pieces))
    opt.set_hyper([{"lr": 1.0, "momentum": 0.5}, {"lr": 0.3, "momentum": 0.0}])
    assert opt.base_lrs == [0.3] and opt.optimizer.param_groups[0]["momentum"] == 0.0
    assert opt.recorded_lr == 1.0  # the run's first group's rate, as the run file records it
    g = torch.ones(2)
    opt.step([g], [1.0], version=0, factor=1.0)
    assert torch.allclose(opt.chunks[0].detach(), torch.full((2,), -0.3))
