"""A learner follows the planner's shard list (services/learner/shards.py): a newer list adds a batch
stream and a progress loop for a shard it names and ends them for one it no longer names; an older
list, or any list once the learner is stopping, changes nothing."""

from __future__ import annotations

import asyncio

from kuberl.v1 import buffer_pb2
from kuberl.v1 import common_pb2 as pb
from services.common.stats import Metrics
from services.learner.inbox import Shard
from services.learner.loops import send_progress
from services.learner.shards import ShardSet


class Channel:
    """Enough of a grpc.aio.Channel for a stub to be made on it (never called here)."""
    def __init__(self, address):
        self.address, self.closed = address, False

    def __getattr__(self, name):   # unary_unary, unary_stream, stream_unary, ...
        return lambda *args, **kwargs: None

    async def close(self):
        self.closed = True


def topology(generation, *addresses, active=None):
    return buffer_pb2.BufferTopology(generation=generation, addresses=addresses,
                                     active=len(addresses) if active is None else active)


async def forever():
    await asyncio.Event().wait()


def make(addresses):
    started, channels = [], []

    def open_channel(address):
        channels.append(Channel(address))
        return channels[-1]

    def start(shard: Shard):
        started.append(shard)
        return asyncio.ensure_future(forever()), asyncio.ensure_future(forever())
    return ShardSet(addresses, open_channel, start, Metrics("learner")), started, channels


async def test_a_newer_list_adds_and_removes_shards_and_an_older_one_is_ignored():
    shards, started, channels = make(["a:1"])
    shards.begin()
    assert [s.address for s in shards] == ["a:1"] and len(started) == 1
    assert shards.update(topology(5, "a:1", "b:1", "c:1"))
    assert [(s.index, s.address) for s in shards] == [(0, "a:1"), (1, "b:1"), (2, "c:1")]
    assert not shards.update(topology(4, "a:1"))               # older: nothing changes
    assert not shards.update(topology(6, "a:1", "b:1", "c:1", active=2))   # c drains: still streamed from
    assert len(shards) == 3
    fetch_c, report_c = shards.tasks["c:1"]
    assert shards.update(topology(7, "a:1", "b:1"))            # c drained and left
    await asyncio.sleep(0)
    assert fetch_c.cancelled() and report_c.cancelled()
    assert [s.address for s in shards] == ["a:1", "b:1"] and next(c for c in channels if c.address == "c:1").closed
    assert shards.metrics.gauges["learner/buffer_shards"] == 2
    assert shards.metrics.counters["learner/topology_changes_total"] == 2
    shards.stop_fetching()                                     # stopping: nothing joins any more
    assert not shards.update(topology(8, "a:1", "b:1", "d:1")) and len(shards) == 2
    await shards.close()
    assert all(c.closed for c in channels)


async def test_a_progress_ack_carries_the_list_to_the_learner():
    shards, _, _ = make(["a:1"])
    shards.begin()

    class Stub:
        async def ReportProgress(self, request, timeout=None):
            return buffer_pb2.ProgressAck(samples_inserted_total=10, topology=topology(3, "a:1", "b:1"))

    shards.shards[0].stub = Stub()
    await send_progress(shards.shards[0], shards, "l", 1, Metrics("learner"))
    assert [s.address for s in shards] == ["a:1", "b:1"] and shards.generation == 3
    await shards.close()


async def test_a_batch_read_off_a_leaving_shard_still_reaches_the_inbox():
    """The shard's batch stream is ended (the shard left the list) while its last batch waits for room
    in a full inbox: the batch was served, so it must not vanish with the task."""
    from services.learner.inbox import Inbox
    from services.learner.loops import fetch_batches

    class Stub:
        def StreamBatches(self, request):
            async def stream():
                yield pb.TrainingBatch(batch_id=7)
                await asyncio.Event().wait()
            return stream()

    inbox = Inbox(maxsize=1)
    await inbox.put("a batch from another shard")              # full
    shard = Shard(0, "a:1", Stub())
    fetch = asyncio.create_task(fetch_batches(shard, buffer_pb2.BatchRequest(), inbox, Metrics("learner")))
    for _ in range(5):
        await asyncio.sleep(0)
    fetch.cancel()
    await asyncio.gather(fetch, return_exceptions=True)
    assert await inbox.get() == "a batch from another shard"
    late = await asyncio.wait_for(inbox.get(), 5)
    assert late.batch.batch_id == 7 and late.shard is shard
