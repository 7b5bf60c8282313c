"""The learner counts time starved of batches as it passes, so a read mid-wait sees the wait so far."""

import asyncio

from services.common.stats import Metrics
from services.learner.inbox import STARVED_TICK_S, Inbox, starved_get

KEY = "learner/starved_seconds_total"


async def test_a_long_wait_is_counted_while_it_lasts_and_the_item_is_returned():
    metrics = Metrics("learner")
    inbox = Inbox(0)
    getter = asyncio.create_task(starved_get(inbox, metrics))
    # Wait (on the event loop, not the wall clock) until several ticks have been counted mid-wait.
    while metrics.counters.get(KEY, 0.0) < 3 * STARVED_TICK_S:
        assert not getter.done()
        await asyncio.sleep(STARVED_TICK_S / 2)
    mid_wait = metrics.counters[KEY]
    await inbox.put("batch")
    assert await getter == "batch"
    assert metrics.counters[KEY] >= mid_wait
    assert inbox.qsize() == 0


async def test_an_item_already_there_is_taken_at_once():
    metrics = Metrics("learner")
    inbox = Inbox(0)
    await inbox.put(1)
    await inbox.put(2)
    assert await starved_get(inbox, metrics) == 1
    assert await starved_get(inbox, metrics) == 2
    assert KEY in metrics.counters and inbox.qsize() == 0


async def test_cancelled_mid_wait_leaves_nothing_behind():
    metrics = Metrics("learner")
    inbox = Inbox(0)
    getter = asyncio.create_task(starved_get(inbox, metrics))
    await asyncio.sleep(STARVED_TICK_S * 1.5)
    getter.cancel()
    await asyncio.gather(getter, return_exceptions=True)
    await inbox.put("later")
    assert inbox.drain() == ["later"]   # the inner get was cancelled too: it took nothing
