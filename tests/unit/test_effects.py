"""Which options take effect: each paradigm and feature declares the options it reads; an option the user set
that nothing in the run reads is one warning line naming it, a combination that cannot work one error line."""

from __future__ import annotations

import pytest

from hpcps.options import effects
from hpcps.options.effects import FEATURES
from hpcps.options.planning import plan
from hpcps.options.config import TrainConfig, make_config
from hpcps.errors import UserError
from hpcps.policies import Policy, paradigms, policy_class, register_class
from hpcps.policies.sync import ASP


def no_effect(cfg: TrainConfig) -> list[str]:
    """The lines :func:`hpcps.options.effects.no_effect` says of ``cfg``, its paradigm resolved as a run does."""
    return effects.no_effect(cfg, policy_class(cfg.paradigm))


def refuse(cfg: TrainConfig) -> None:
    effects.refuse(cfg, policy_class(cfg.paradigm))


def lines(**flags) -> list[str]:
    return no_effect(make_config(flags))


def test_staleness_under_asp_is_one_warning_naming_it_and_who_reads_it():
    assert lines(paradigm="asp", staleness=3) == [
        "--staleness has no effect under --paradigm asp: it is read by ssp, dssp and eager"]


@pytest.mark.parametrize("paradigm", ["ssp", "dssp", "eager"])
def test_the_paradigms_that_bound_staleness_read_it(paradigm):
    assert lines(paradigm=paradigm, staleness=3) == []


def test_each_paradigm_option_is_named_under_a_paradigm_that_does_not_read_it():
    said = lines(paradigm="bsp", staleness=1, staleness_max=3, hsp_max_stale=2, lr_staleness="inverse")
    assert [line.split()[0] for line in said] == ["--hsp-max-stale", "--lr-staleness", "--staleness",
                                                  "--staleness-max"]
    assert lines(paradigm="dssp", staleness=1, staleness_max=3, lr_staleness="sqrt") == []
    assert lines(paradigm="hsp", hsp_max_stale=2, lr_staleness="inverse") == []  # its extras can be stale


def test_lr_staleness_under_grouped_is_named_the_central_shards_never_see_a_workers_staleness():
    assert lines(paradigm="grouped", groups=2, lr_staleness="inverse") == [
        "--lr-staleness has no effect under --paradigm grouped: it is read by ssp, asp, dssp, eager and hsp"]


def test_an_option_left_at_its_default_is_never_named_and_one_set_to_it_is():
    assert lines(paradigm="asp") == []
    assert lines(paradigm="asp", hsp_max_stale=1) != []  # set, if only to the default: the user asked for it


@pytest.mark.parametrize("flags, option", [
    (dict(lr_step_every=10), "--lr-step-every"), (dict(lr_schedule="cosine", lr_gamma=0.5), "--lr-gamma"),
    (dict(betas="0.9,0.99"), "--betas"), (dict(eps=1e-6), "--eps"), (dict(jitter_cv=0.2), "--jitter-cv"),
    (dict(group_by="rank"), "--group-by"), (dict(progress=False, progress_every=2.0), "--progress-every"),
    (dict(eval_every=5, eval_interval=0.5), "--eval-interval"),
    (dict(dataset="own-loop", steps=10, eval_every=5), "--eval-every"),
])
def test_a_features_option_without_the_feature_is_named(flags, option):
    said = lines(**flags)
    assert len(said) == 1 and said[0].startswith(f"{option} has no effect in this run: it is read by ")


def test_with_the_feature_on_its_options_are_quiet():
    assert lines(lr_schedule="step", lr_step_every=10, lr_gamma=0.5, optimizer="adam", betas="0.9,0.99",
                 compute_time=0.01, jitter="uniform", jitter_cv=0.2, eval_every=5) == []


class OwnBound(Policy):
    """A plug-in whose constructor takes the staleness flags: it reads them."""
    name = "own-bound"

    def __init__(self, n_workers, *, staleness=0, staleness_max=None):
        super().__init__(n_workers, staleness=staleness, staleness_max=staleness_max)

    def on_push(self, worker, clock, version, now):
        raise NotImplementedError


class QuietAsp(ASP):
    """A plug-in built on asp, with no constructor of its own: it reads what asp reads."""
    name = "quiet-asp"


def test_a_plugin_reads_what_its_constructor_takes_and_what_its_base_reads():
    assert {"staleness", "staleness_max"} <= OwnBound.reads_options()
    assert lines(paradigm=register_class(OwnBound), staleness=3, staleness_max=5) == []
    said = lines(paradigm=register_class(QuietAsp), staleness=3)
    assert len(said) == 1 and said[0].startswith("--staleness has no effect under --paradigm ")


def test_every_declared_option_is_an_option_of_the_config():
    fields = set(TrainConfig.model_fields)
    for cls in paradigms().values():
        assert cls.reads_options() <= fields, cls.name
    for reader in FEATURES:
        assert reader.options <= fields, reader.name


@pytest.mark.parametrize("flags, says", [
    (dict(paradigm="eager", partition_mb=1.0), "--partition-mb: --paradigm eager pulls behind its computation"),
    (dict(paradigm="bsp", groups=2), "--groups 2: paradigm 'bsp' does not use group servers"),
    (dict(paradigm="grouped"), "--paradigm grouped needs --groups G"),
    (dict(paradigm="bsp", checkpoint_interval=5.0), "--checkpoint-interval: --paradigm bsp checkpoints at a round"),
    (dict(dataset="own-loop", steps=5, paradigm="grouped", groups="auto"), "groups by speed time hpcps's own loop"),
    (dict(paradigm="eager", local_steps=4), "--local-steps: --paradigm eager does not take local steps"),
    (dict(paradigm="hsp", local_steps=4), "--local-steps: --paradigm hsp does not take local steps"),
    (dict(paradigm="grouped", groups=2, local_steps=4), "--local-steps: --paradigm grouped does not take local"),
    (dict(paradigm="diloco", local_steps=4, overlap_steps=4), "--overlap-steps 4: a worker takes the new parameters"),
    (dict(paradigm="bsp", spare_workers=1), "--spare-workers: --paradigm bsp does not take a spare"),
    (dict(paradigm="diloco", spare_workers=1), "--spare-workers: --paradigm diloco does not take a spare"),
    (dict(paradigm="hsp", spare_workers=1), "--spare-workers: --paradigm hsp does not take a spare"),
    (dict(paradigm="grouped", groups=2, spare_workers=1), "--spare-workers: --paradigm grouped does not take"),
    (dict(dataset="own-loop", steps=5, paradigm="asp", spare_workers=1), "--spare-workers: a spare takes a dead"),
    (dict(paradigm="asp", local_steps=4, local_steps_by_speed=True, spare_workers=1),
     "--spare-workers with --local-steps-by-speed"),
    (dict(paradigm="bsp", respawn=True), "--respawn: --paradigm bsp does not resume a dead worker's place"),
    (dict(paradigm="hsp", respawn=True), "--respawn: --paradigm hsp does not resume a dead worker's place"),
    (dict(paradigm="asp", respawn=True, spare_workers=1), "--respawn with --spare-workers"),
    (dict(dataset="own-loop", steps=5, paradigm="asp", respawn=True), "--respawn: the job resumes hpcps's own"),
    (dict(paradigm="asp", local_steps=4, local_steps_by_speed=True, respawn=True),
     "--respawn with --local-steps-by-speed"),
    (dict(paradigm="ssp", pull="send"), "--pull send: --paradigm ssp does not release every worker at a round's"),
    (dict(paradigm="hsp", pull="send"), "--pull send: --paradigm hsp does not release every worker"),
    (dict(paradigm="grouped", groups=2, pull="send"), "--pull send: --paradigm grouped does not release"),
    (dict(paradigm="bsp", pull="send", compress="bf16"), "--pull send with --compress bf16: the shards send fp32"),
    (dict(paradigm="bsp", pull="send", shards_at_once=1), "--pull send with --shards-at-once 1"),
    (dict(paradigm="diloco", local_steps=4, overlap_steps=2, pull="send"), "--pull send with --overlap-steps"),
])
def test_a_combination_that_cannot_work_is_one_error_line_before_any_layout(flags, says):
    cfg = make_config(flags)
    for check in (lambda: refuse(cfg), lambda: plan(cfg, 5)):
        with pytest.raises(UserError) as err:
            check()
        assert str(err.value).startswith(says) and "\n" not in str(err.value)


@pytest.mark.parametrize("flags", [dict(paradigm="bsp"), dict(paradigm="localsgd"), dict(paradigm="diloco", local_steps=4),
                                   dict(paradigm="bsp", compress="topk:0.1"), dict(paradigm="bsp", partition_mb=0.5)])
def test_the_shards_send_rounds_under_bsp_and_its_presets(flags):
    refuse(make_config({**flags, "pull": "send"}))  # (nothing to refuse)


def test_the_inner_optimizers_options_without_local_steps_are_named_and_quiet_with_them():
    assert lines(paradigm="bsp", inner_lr=0.3, inner_optimizer="adam") == [
        "--inner-lr has no effect in this run: it is read by local steps (--local-steps; --paradigm localsgd, diloco)",
        "--inner-optimizer has no effect in this run: it is read by local steps (--local-steps; --paradigm "
        "localsgd, diloco)"]
    assert lines(paradigm="ssp", local_steps=4, inner_lr=0.3) == []
    assert lines(paradigm="diloco", inner_optimizer="adamw") == []
    assert lines(paradigm="bsp") == []  # the inner rate's default is not the user's setting
    assert lines(paradigm="bsp", overlap_steps=2) == [
        "--overlap-steps has no effect in this run: it is read by local steps (--local-steps; --paradigm "
        "localsgd, diloco)"]
    assert lines(paradigm="diloco", overlap_steps=2) == []


def test_stale_momentum_is_read_wherever_a_param_group_may_have_a_momentum():
    """Regression: ``--stale-momentum none`` was called 'no effect' unless ``--optimizer sgd --momentum > 0``,
    though the rule acts on any group with momentum: a param group's own, or one the loop sets through
    ps.optimizer.param_groups. Only adam/adamw (no momentum) and --momentum-period are known not to read it."""
    from hpcps.options.effects import OWN_LOOP

    def lines(**flags):
        return [line for line in no_effect(make_config({"stale_momentum": "none", **flags}))
                if line.startswith("--stale-momentum")]

    assert lines(paradigm="asp") == []  # sgd without --momentum: a group may still have one
    assert lines(paradigm="asp", dataset=OWN_LOOP) == []
    assert len(lines(paradigm="asp", optimizer="adam")) == 1
    assert len(lines(paradigm="asp", momentum=0.9, nesterov=True, momentum_period=4)) == 1


def test_pull_send_is_refused_for_a_bsp_subclass_whose_workers_do_not_wait_for_their_grant():
    """Regression: a plug-in BSP subclass with an eager (or non-blocking) worker side passed the refusal, and its
    workers never posted the receives of a sent round: the shard's sends waited for ever in ParamSender.drain."""
    from hpcps.policies.sync import BSP

    class EagerRounds(BSP):
        eager_pull = True

    class LooseRounds(BSP):
        worker_blocks = False

    assert BSP.releases_rounds()
    assert not EagerRounds.releases_rounds() and not LooseRounds.releases_rounds()
    assert not ASP.releases_rounds()
