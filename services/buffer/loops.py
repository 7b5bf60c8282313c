"""The buffer's loops. The buffer drives nothing of its own accord: it serves, so its loops are one per
open stream, and two in the background (started by main.py).

- `serve_batches`, one per learner's StreamBatches stream: each iteration cuts the learner's next batch
  on the store's owner and writes it. With none to cut (warming up, paced by the rate limiter, empty) it
  waits for the next insert (`inserted`, at most a second) and tries again. It stops when the buffer
  closes, after the request's `max_batches`, once it has served BATCH_STREAM_S (a clean end: the learner
  opens the next stream), or when the learner goes away (the store takes back the batch being written).
- `stream_insert_limits`, one per actor's WatchInsertLimit stream: each iteration reads the actor's
  insert limit and writes it when it moved (or the shard list did), then waits for the next change
  (`changed`, at most LIMIT_RECHECK_S); at most one message per LIMIT_INTERVAL_S. It stops when the
  buffer closes or the actor cancels the stream.
- `checkpoint_loop`, one per table with checkpoints (DQN): waits out the interval, saves, and once its
  `stop` is set saves a last time and returns.
- `merge_stats_loop`, in a buffer of several tables: merges their figures every second until cancelled.

Push streams are read in servicer.py as their messages come (each stored and acknowledged: no loop of
the buffer's own); the store's owner thread (owner.py) runs the store's calls in the order handed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from kuberl.v1 import buffer_pb2
from kuberl.v1 import common_pb2 as pb
from services.buffer.checkpoint import BufferCheckpointer
from services.buffer.drain import ShardDrain
from services.buffer.owner import StoreOwner
from services.buffer.store import Store
from services.common.notify import Notifier
from services.common.protocol.fragments import batch_samples
from services.common.stats import Metrics

log = logging.getLogger(__name__)
# A StreamBatches stream ends itself (OK, after every batch written) once it has served this long,
# and the learner opens the next at once. The server's max connection age (services/common/net/grpcutil.py:
# 300 s, then 30 s of grace) would otherwise cancel a long-lived stream mid-write every few minutes,
# leaving the batch on the wire unsent (taken back: buffer/batches_unsent_total) and losing any it
# had written that the learner had not read yet. Well inside the grace, so a stream never outlives it.
BATCH_STREAM_S = 20.0
# WatchInsertLimit sends at most one InsertLimit per this interval per actor, and re-reads the limit
# at least this often (LIMIT_RECHECK_S) when nothing wakes it (a learner's report expiring moves it).
LIMIT_INTERVAL_S = 0.01
LIMIT_RECHECK_S = 1.0


class Table(Protocol):
    """What the stream loops use of one table's BufferServicer (services/buffer/servicer.py)."""
    store: Store
    metrics: Metrics
    run: StoreOwner         # every call on `store` goes through it
    inserted: Notifier      # a fragment was stored (or a report may have made queued ones stale)
    changed: Notifier       # what the insert limit is computed from moved
    drain: ShardDrain       # the shard list held, and the actors watching
    closing: bool


async def serve_batches(table: Table, request: buffer_pb2.BatchRequest, context) -> None:
    """Serve one learner's StreamBatches stream (a request the servicer has checked) until it ends."""
    log.debug("learner %s streaming batches of %d", request.learner_id, request.batch_size)
    sent, ends = 0, time.monotonic() + BATCH_STREAM_S
    while not table.closing and (request.max_batches == 0 or sent < request.max_batches):
        if sent and time.monotonic() >= ends:
            return   # a clean end: the learner reads what was written, then opens the next stream
        batch, why = await table.run(cut, table.store, request.batch_size, request.learner_id, urgent=True,
                                     orphan=lambda done: unsent(table.store, done[0], request.learner_id))
        if batch is None:
            if time.monotonic() >= ends:
                return
            started = time.monotonic()
            await table.inserted.wait(timeout=1.0)
            if why == "paced":
                table.metrics.inc("buffer/paced_seconds_total", time.monotonic() - started)
            continue
        batch.batch_id = sent
        table.changed.notify()  # served moved: actors held by the limiter may go on
        try:
            await context.write(batch)
        except (asyncio.CancelledError, Exception) as err:
            # The learner went away with this batch unsent: the store takes it back.
            # (Any exception: what grpcio raises for a write to a call that its peer already
            # ended, UsageError or ExecuteBatchError, has no public type; whatever the cause,
            # the batch was not delivered.)
            table.run.post(unsent, table.store, batch, request.learner_id)
            log.info("learner %s went away (%r); batch %d (%d samples) was not delivered",
                     request.learner_id, err, sent, batch_samples(batch))
            if isinstance(err, asyncio.CancelledError):
                raise
            return
        sent += 1


def cut(store: Store, batch_size: int, learner_id: str) -> tuple[pb.TrainingBatch | None, str]:
    """(the next batch for `learner_id`, or None and why not); on the store's owner."""
    batch = store.next_batch(batch_size, learner_id)
    return batch, "" if batch is not None else store.wait_reason


def unsent(store: Store, batch: pb.TrainingBatch | None, learner_id: str) -> None:
    """A batch cut for a learner that went away before it was sent: nothing of it is lost
    (Store.unserve). On the store's owner."""
    if batch is not None:
        store.unserve(learner_id, batch)


async def stream_insert_limits(table: Table, request: buffer_pb2.InsertLimitRequest, context) -> None:
    """Stream the insert limit to one actor (a request the servicer has checked): at once, then on every
    change, at most one message per LIMIT_INTERVAL_S (docs/rate-limiter.md)."""
    sent, told = None, 0   # the last limit written, and the generation of the shard list it carried
    table.drain.watch_opened(request.actor_id)
    try:
        while not table.closing:
            waiter = table.changed.waiter()  # taken before reading: a change in between is not missed
            msg = await table.run(insert_limit, table.store, request.actor_id, request.incarnation, urgent=True)
            if msg != sent or table.drain.topology.generation != told:
                out = msg
                if table.drain.topology.generation != told:   # the shard list once per change, not in every limit
                    out = buffer_pb2.InsertLimit()
                    out.CopyFrom(msg)
                    out.topology.CopyFrom(table.drain.topology)
                    told = table.drain.topology.generation
                await context.write(out)
                sent = msg
                await asyncio.sleep(LIMIT_INTERVAL_S)
                continue
            try:
                async with asyncio.timeout(LIMIT_RECHECK_S):
                    await waiter.wait()
            except TimeoutError:
                pass
    finally:
        table.drain.watch_closed(request.actor_id)


def insert_limit(store: Store, actor_id: str, incarnation: int) -> buffer_pb2.InsertLimit:
    """(On the store's owner.)"""
    msg = buffer_pb2.InsertLimit(samples_inserted_total=store.inserted_samples,
                                 samples_served_total=store.served_samples,
                                 replay_ratio_target=store.limiter.ratio)
    if (limit := store.insert_limit()) is not None:
        msg.insert_limit_samples = max(0, limit)
    if (high := store.high_water(actor_id, incarnation)) is not None:
        msg.high_water_seq = high
    return msg


async def checkpoint_loop(checkpointer: BufferCheckpointer, stop: asyncio.Event) -> None:
    """Checkpoint every interval; once `stop` is set, checkpoint a last time and return. A save under
    way when `stop` is set finishes first, so the last one holds the final state."""
    while True:
        try:
            await asyncio.wait_for(stop.wait(), checkpointer.interval_s)
        except TimeoutError:
            pass
        final = stop.is_set()     # decided before saving: a save begun before the stop must be followed
        await checkpointer.save()  # by one that holds what was stored meanwhile
        if final:
            return


async def merge_stats_loop(refresh: Callable[[], Awaitable[None]], period_s: float = 1.0) -> None:
    """Keep the merged figures fresh for the metrics endpoint (a buffer of several tables' task):
    `refresh` is its TableRouter's (services/buffer/tables.py)."""
    while True:
        await refresh()
        await asyncio.sleep(period_s)
