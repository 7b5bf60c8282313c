"""The learner's batches between the buffer's stream and the train loop.

`fetch_batches` fills an Inbox; the train loops take from it. A batch taken off the stream is
either trained on, handed back untrained (a learner group that ended with one in hand, a train loop
cancelled just as its batch arrived: the next get returns it first), or discarded at shutdown and
counted. None is dropped on the floor: the buffer counts every batch it served as in flight to this
learner until the learner reports it consumed (LearnerProgress.batches_consumed_total), serves a
learner only `buffer.batch_prefetch` batches ahead of that, and on a FIFO table holds actors for what
is in flight. One lost batch per group re-formation was enough to stall a learner and its actors for
good after a few re-formations.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from services.common.protocol.fragments import batch_samples
from services.common.stats import Metrics

STARVED_TICK_S = 0.25


@dataclass(eq=False)
class Shard:
    """One buffer shard as this learner sees it (services/common/net/shards.py): its stub, and what this
    learner consumed from it, which it reports to that shard alone: each shard paces the learner by
    its own served and consumed counts. `produced`: the shard's samples inserted after its warm-up, as
    its last ProgressAck said."""
    index: int
    address: str
    stub: Any
    batches_consumed: int = 0
    samples_consumed: int = 0
    produced: int = 0


@dataclass(frozen=True, eq=False)
class Fetched:
    """A batch and the shard that served it: what the Inbox holds."""
    batch: Any
    shard: Shard

    def consumed(self) -> None:
        """Count the batch consumed (trained on, or discarded) towards its shard."""
        self.shard.batches_consumed += 1
        self.shard.samples_consumed += batch_samples(self.batch)


def samples_per_insert(shards: Iterable[Shard]) -> float | None:
    """Samples this learner consumed over samples produced, over every shard; None before any production."""
    shards = list(shards)
    produced = sum(s.produced for s in shards)
    return sum(s.samples_consumed for s in shards) / produced if produced > 0 else None


class Inbox:
    """Prefetched batches (an asyncio.Queue bounded at `maxsize`) and batches handed back untrained,
    which come out first, oldest first."""

    def __init__(self, maxsize: int):
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self._returned: deque = deque()

    async def put(self, batch) -> None:
        await self._queue.put(batch)

    def get(self) -> asyncio.Future:
        """A future of the next batch. Settle it with `result()` once done, or with `cancel(future)`."""
        if self._returned:
            ready = asyncio.get_running_loop().create_future()
            ready.set_result(self._returned.popleft())
            return ready
        return asyncio.ensure_future(self._queue.get())

    def cancel(self, getter: asyncio.Future) -> None:
        """Give up on `getter`: a batch it already took is handed back, else it is cancelled (an
        asyncio.Queue.get cancelled before it resumes takes nothing)."""
        if getter.done():
            if not getter.cancelled() and getter.exception() is None:
                self.hand_back(getter.result())
        else:
            getter.cancel()

    def hand_back(self, batch) -> None:
        """A batch taken but not trained on: the next get returns it (before anything handed back later)."""
        self._returned.append(batch)

    def qsize(self) -> int:
        return len(self._returned) + self._queue.qsize()

    def drain(self) -> list:
        """Everything held, handed-back batches first; the inbox is empty after."""
        batches = list(self._returned)
        self._returned.clear()
        while not self._queue.empty():
            batches.append(self._queue.get_nowait())
        return batches


def discard(metrics: Metrics, items: list[Fetched]) -> None:
    """Batches taken off the stream that will never be trained on (prefetched at shutdown): counted as
    discarded, and as consumed, which is what the buffer reads (LearnerProgress.batches_consumed_total):
    a batch neither trained on nor counted would stay in flight to this learner for good."""
    metrics.inc("learner/batches_discarded_total", len(items))
    metrics.inc("learner/batches_consumed_total", len(items))
    metrics.inc("learner/samples_consumed_total", sum(batch_samples(f.batch) for f in items))
    for f in items:
        f.consumed()


async def starved_get(inbox: Inbox, metrics: Metrics):
    """The next batch, adding the time waited to `learner/starved_seconds_total` as the wait goes (every
    STARVED_TICK_S), not only when it ends. The planner's TR_L is samples / (wall time - this) over
    each interval between its reads; a long wait counted only at its end would credit one interval
    with starvation from earlier ones (and show the intervals before it as busy). Cancelled, it hands
    back a batch that had already arrived."""
    getter = inbox.get()
    last = time.perf_counter()
    try:
        while not getter.done():
            await asyncio.wait({getter}, timeout=STARVED_TICK_S)
            now = time.perf_counter()
            metrics.inc("learner/starved_seconds_total", now - last)
            last = now
    except BaseException:
        inbox.cancel(getter)
        raise
    return getter.result()
