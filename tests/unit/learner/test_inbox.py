"""No batch taken off the buffer's stream is lost between the learner's train loops
(services/learner/inbox.py): the buffer counts every batch it served in flight until the learner
reports it consumed, so one lost batch per group re-formation stalled a learner and its actors."""

import asyncio
import time

from services.common.notify import Notifier
from services.common.stats import Metrics
from services.learner.inbox import Inbox, starved_get
from services.learner.loops import group_train_loop
from services.learner.publish import WeightsHub


async def test_batches_handed_back_come_out_first_and_in_order():
    inbox = Inbox(4)
    await inbox.put("queued")
    inbox.hand_back("first")
    inbox.hand_back("second")
    assert inbox.qsize() == 3
    assert [await inbox.get() for _ in range(2)] == ["first", "second"]
    assert await inbox.get() == "queued"
    inbox.hand_back("again")
    await inbox.put("later")
    assert inbox.drain() == ["again", "later"] and inbox.qsize() == 0


async def test_cancelling_a_getter_that_already_took_its_batch_hands_the_batch_back():
    inbox = Inbox(4)
    getter = inbox.get()
    await inbox.put("batch")
    while not getter.done():        # the queue's get runs and takes it
        await asyncio.sleep(0)
    assert inbox.qsize() == 0
    inbox.cancel(getter)
    assert inbox.drain() == ["batch"]

    pending = inbox.get()
    await asyncio.sleep(0)
    inbox.cancel(pending)           # still waiting: cancelled, and it takes nothing later
    await asyncio.gather(pending, return_exceptions=True)
    await inbox.put("next")
    assert pending.cancelled() and inbox.drain() == ["next"]


async def test_starved_get_cancelled_never_loses_a_batch():
    """Cancelled around the moment its batch arrives: the batch is either returned or handed back."""
    metrics = Metrics("learner")
    for spins in range(6):          # cancel 0..5 loop iterations after the put: every interleaving
        inbox = Inbox(4)
        task = asyncio.create_task(starved_get(inbox, metrics))
        await asyncio.sleep(0)
        await inbox.put(spins)
        for _ in range(spins):
            await asyncio.sleep(0)
        task.cancel()
        outcome = await asyncio.gather(task, return_exceptions=True)
        delivered = [] if isinstance(outcome[0], BaseException) else outcome
        assert delivered + inbox.drain() == [spins], spins


class _PeerLeavesWhileABatchArrives:
    """A group's GradientSync whose first round sees a batch arrive while it is being agreed on (the
    learner joined it holding none) and a peer stopping: the group ends at that round."""

    world_size = 2

    def __init__(self, loop: asyncio.AbstractEventLoop, inbox: Inbox):
        self.loop, self.inbox, self.rounds = loop, inbox, []

    def agree(self, stopping: bool, ready: bool) -> tuple[bool, bool]:
        self.rounds.append(ready)
        asyncio.run_coroutine_threadsafe(self.inbox.put("batch"), self.loop).result(timeout=10)
        deadline = time.monotonic() + 30
        while self.inbox.qsize():   # the learner's pending get takes it while this round is agreed on
            assert time.monotonic() < deadline, "the pending get never took the batch"
            time.sleep(0.005)
        return True, False


class _Trainer:
    def __init__(self, sync):
        self.sync, self.version, self.metrics, self.trained = sync, 0, Metrics("learner"), []

    def train(self, batch):
        self.trained.append(batch)


async def test_a_group_ending_as_a_batch_arrives_hands_it_to_the_next_group():
    inbox = Inbox(2)
    trainer = _Trainer(_PeerLeavesWhileABatchArrives(asyncio.get_running_loop(), inbox))
    await group_train_loop(trainer, inbox, WeightsHub(), 1, Notifier(), asyncio.Event(), elastic=True)
    assert trainer.sync.rounds == [False] and trainer.trained == []
    assert trainer.metrics.counters.get("learner/batches_discarded_total", 0) == 0
    assert inbox.drain() == ["batch"], "the batch that arrived during the last round was lost"
