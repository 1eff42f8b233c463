"""A box's lifetime (hpcps.box.net.built), its mechanism replaced by a record of the calls: no root needed.
The real box, its reaper killed with its owner, is tested in tests/cli/test_box.py."""

import pytest

from hpcps.box import net
from hpcps.box.spec import make_cluster


@pytest.fixture
def calls(monkeypatch):
    made: list[tuple] = []

    class Reaper:
        def __init__(self, prefix: str) -> None:
            made.append(("reaper", prefix))

        def close(self) -> None:
            made.append(("close",))

    monkeypatch.setattr(net, "Reaper", Reaper)
    monkeypatch.setattr(net, "build", lambda cluster: made.append(("build", cluster.prefix)))
    monkeypatch.setattr(net, "remove", lambda prefix: made.append(("remove", prefix)) or [])
    return made


CLUSTER = make_cluster(2, ["1gbit"], buffer="512kb", prefix="hpcps4242-")
LIFETIME = [("reaper", "hpcps4242-"), ("build", "hpcps4242-"), ("remove", "hpcps4242-"), ("close",)]


def test_the_reaper_watches_before_the_box_is_built_and_closes_after_it_is_removed(calls):
    with net.built(CLUSTER) as reaper:
        assert type(reaper).__name__ == "Reaper" and calls == LIFETIME[:2]
    assert calls == LIFETIME


def test_a_block_that_raises_still_removes_the_box_and_closes_the_reaper(calls):
    with pytest.raises(KeyboardInterrupt):
        with net.built(CLUSTER):
            raise KeyboardInterrupt
    assert calls == LIFETIME


def test_a_build_that_fails_removes_what_it_made_and_closes_the_reaper(calls, monkeypatch):
    def fail(cluster):
        calls.append(("build", cluster.prefix))
        raise net.BoxError("no veth here")

    monkeypatch.setattr(net, "build", fail)
    with pytest.raises(net.BoxError, match="no veth"):
        with net.built(CLUSTER):
            pytest.fail("the block ran on a box that was not built")
    assert calls == LIFETIME
