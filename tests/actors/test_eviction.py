"""The eviction actor's policy: above the high watermark, demote clean idle
caches, least recently used first, until under the low one."""

from __future__ import annotations

import pytest

from semantic.actors.eviction import EvictionActor
from semantic.actors.messages import Demote, HotAgent, HotSet, Stop

MiB = 1 << 20


def report(used, *agents):
    return HotSet(100 * MiB, used * MiB, tuple(HotAgent(a, b * MiB, c) for a, b, c in agents))


def test_victims_are_clean_lru_caches_down_to_the_low_watermark():
    actor = EvictionActor(high=0.9, low=0.6)
    assert actor.victims(report(85, ("a", 20, True))) == ()  # under the high watermark: nothing
    hot = report(95, ("a", 20, True), ("b", 10, False), ("c", 10, True), ("d", 20, True), ("e", 35, True))
    assert actor.victims(hot) == ("a", "c", "d")  # b is dirty: skipped; 95 - 50 <= 60
    assert actor.victims(report(95, ("a", 20, False), ("b", 30, False))) == ()  # all dirty: wait
    actor.mailbox.close()
    actor._inbox.close()


def test_watermarks_are_checked():
    with pytest.raises(ValueError, match="watermarks"):
        EvictionActor(high=0.5, low=0.8)


@pytest.mark.anyio
async def test_only_the_latest_report_is_acted_on():
    demotes = []
    gpu = type("Gpu", (), {"submit": lambda self, c: demotes.append(c)})()
    actor = EvictionActor(high=0.9, low=0.6, gpu=gpu)
    actor.mailbox.send_nowait(report(99, ("old", 50, True)))
    actor.mailbox.send_nowait(report(95, ("a", 40, True)))
    actor.mailbox.send_nowait(Stop())
    await actor.run()
    assert demotes == []  # a Stop right behind the reports: nothing more to do
    actor = EvictionActor(high=0.9, low=0.6, gpu=gpu)
    actor.mailbox.send_nowait(report(99, ("old", 50, True)))
    actor.mailbox.send_nowait(report(95, ("a", 40, True)))
    actor.mailbox.close()
    await actor.run()
    assert demotes == [Demote(("a",))]
