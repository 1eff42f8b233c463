"""``hpcps check``'s policy (pure): which paths are measured, what a node's link rate is, the findings and
the verdict's exit status."""

import pytest

from hpcps.box.spec import parse_rate
from hpcps.check.findings import (ALL_PAIRS_UP_TO, Link, Progress, RankFacts, Report, findings, link_units,
                                  node_rates, pair_plan, table, verdict)


def _ranks(n=4, nodes=2, **kw):
    facts = dict(library="MPICH Version: 5.0.2", implementation="mpich", thread_level="MULTIPLE")
    facts.update(kw)
    return [RankFacts(rank=r, node=f"n{r % nodes}", **facts) for r in range(n)]


def _progress(slowest=0.001, intact=True, busy=1.0):
    return Progress(target=0, reader=1, same_node=False, busy_s=busy, slowest_pull_s=slowest, median_pull_s=slowest,
                    intact=intact)


def test_every_pair_is_measured_up_to_the_limit_then_a_ring():
    assert pair_plan(1) == []
    assert pair_plan(3) == [(0, 1), (0, 2), (1, 2)]
    assert len(pair_plan(ALL_PAIRS_UP_TO)) == ALL_PAIRS_UP_TO * (ALL_PAIRS_UP_TO - 1) // 2
    ring = pair_plan(ALL_PAIRS_UP_TO + 4)
    assert len(ring) == ALL_PAIRS_UP_TO + 4 and all(b == (a + 1) % len(ring) for a, b in ring)


@pytest.mark.parametrize("bps", [957e6, 3.75e9, 12.5e3, 250e6, 100e9])
def test_rates_print_in_the_units_link_takes(bps):
    text = link_units(bps)
    assert abs(parse_rate(text) - bps) <= 0.005 * bps


def test_a_fast_node_is_measured_by_the_fan_in_and_a_slow_one_by_its_fastest_pair():
    """A server at 4 Gbit/s among workers at 1: every pair runs at the worker's rate; only the fan-in fills
    the server's link; within a node nothing is crossed."""
    links = [Link("n0", "n1", 0.95e9), Link("n0", "n2", 0.95e9), Link("n1", "n2", 0.4e9),
             Link("*", "n0", 3.7e9), Link("*", "n1", 0.8e9), Link("n0", "n0", 80e9)]
    assert node_rates(links) == {"n0": 3.7e9, "n1": 0.95e9, "n2": 0.95e9}


def test_a_healthy_allocation_has_one_ok_line_and_exits_zero():
    report = Report(ranks=_ranks(), protocol="pinned", memory_model="unified", progress=[_progress()],
                    links=[Link("n0", "n1", 1e9, 10e-6)])
    found = findings(report)
    assert [f.level for f in found] == ["ok"]
    assert verdict(found)[1] == 0
    assert "n0 <-> n1" in table(report) and "1gbit" in table(report)


@pytest.mark.parametrize("change, level, words", [
    (dict(progress=[_progress(slowest=0.9)]), "warn", "wait while the server computes"),
    (dict(memory_model="separate"), "warn", "separate RMA memory model"),
    (dict(ranks=_ranks(thread_level="SERIALIZED")), "warn", "MPI_THREAD_MULTIPLE"),
    (dict(ranks=_ranks(gpus=("H100",), cuda_aware=False)), "warn", "not CUDA-aware"),
    (dict(links=[Link("n0", "n1", 1e9), Link("n0", "n2", 1e9), Link("n1", "n2", 0.1e9)]), "warn", "n1 <-> n2"),
    (dict(progress=[_progress(intact=False)]), "fail", "other values"),
    (dict(ranks=_ranks()[:3] + [RankFacts(3, "n1", "Open MPI v5.0.11", "openmpi", "MULTIPLE")]), "fail",
     "different MPI libraries"),
])
def test_each_problem_is_one_line_with_a_fix_and_only_failures_exit_non_zero(change, level, words):
    base = dict(ranks=_ranks(), protocol="pinned", memory_model="unified", progress=[_progress()], links=[])
    found = findings(Report(**{**base, **change}))
    assert len(found) == 1 and found[0].level == level and words in found[0].what and found[0].fix
    assert verdict(found)[1] == (1 if level == "fail" else 0)
