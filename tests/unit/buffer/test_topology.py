"""A buffer shard's side of a change of shards (services/buffer/servicer.py, SetTopology, over the shard's
drain, services/buffer/drain.py: tests/unit/buffer/test_drain.py tests it on its own): it takes a
newer list only, refuses a malformed one naming the field, hands the list on to actors and learners,
and says it is drained only when no actor watches or pushes and nothing is left to serve (a replay's
samples counted as evicted)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kuberl.v1 import buffer_pb2
from services.buffer import drain as drain_module
from services.buffer.servicer import BufferServicer, topology_problem
from tests.unit.buffer.test_store import dqn_msg, dqn_store, ppo_msg, ppo_store

A, B = "127.0.0.1:5001", "127.0.0.1:5002"


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


def request(addresses, active, generation, shard):
    return buffer_pb2.SetTopologyRequest(shard=shard, topology=buffer_pb2.BufferTopology(
        generation=generation, addresses=addresses, active=active))


@pytest.mark.parametrize("addresses,active,shard,problem", [
    ([], 0, 0, "topology.addresses: empty"),
    ([A, A], 1, 0, "an address is listed twice"),
    (["nohost"], 1, 0, "must be host:port"),
    ([A, B], 0, 0, "topology.active: 0 is outside 1..2"),
    ([A, B], 3, 0, "topology.active: 3 is outside 1..2"),
    ([A, B], 2, 2, "shard: 2 is outside 0..1"),
])
def test_a_malformed_topology_is_refused_naming_the_field(addresses, active, shard, problem):
    t = buffer_pb2.BufferTopology(generation=1, addresses=addresses, active=active)
    assert problem in topology_problem(t, shard)

    async def call():
        ctx = Context()
        with pytest.raises(Aborted):
            await BufferServicer(dqn_store(), dqn_store().metrics).SetTopology(request(addresses, active, 1, shard), ctx)
        return ctx
    ctx = asyncio.run(call())
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and problem in ctx.details


def test_only_a_newer_topology_is_taken_and_handed_on():
    async def run():
        store = dqn_store()
        s = BufferServicer(store, store.metrics)
        assert not (await s.SetTopology(request([A, B], 2, 0, 1), Context())).HasField("topology")  # none held
        ack = await s.SetTopology(request([A, B], 2, 10, 1), Context())
        assert ack.generation == 10 and not ack.draining and not ack.drained
        older = await s.SetTopology(request([A], 1, 9, 0), Context())     # older: ignored
        assert list(s.drain.topology.addresses) == [A, B] and s.drain.shard == 1
        assert older.topology == s.drain.topology   # (what a restarted planner reads back with generation 0)
        assert (await s.ReportProgress(buffer_pb2.LearnerProgress(learner_id="l"), Context())).topology == s.drain.topology
        assert store.metrics.snapshot()["buffer/topology_generation"] == 10
    asyncio.run(run())


def test_the_insert_limit_stream_carries_the_list_once_per_change():
    """An actor hears the shard list in its stream's first message and again only when it changes: not
    in each of up to a hundred limits a second."""
    async def run():
        store = dqn_store()
        s = BufferServicer(store, store.metrics)
        written: list[buffer_pb2.InsertLimit] = []
        wrote = asyncio.Event()

        class Stream(Context):
            async def write(self, msg):
                written.append(msg)
                wrote.set()

        async def messages(n: int) -> None:   # the stream has written its n-th message
            while len(written) < n:
                wrote.clear()
                await asyncio.wait_for(wrote.wait(), 5)
        watch = asyncio.create_task(s.WatchInsertLimit(buffer_pb2.InsertLimitRequest(actor_id="a", incarnation=1),
                                                       Stream()))
        await messages(1)
        assert not written[0].HasField("topology")   # none set: the actor keeps its own
        await s.SetTopology(request([A, B], 2, 10, 0), Context())
        await messages(2)
        store.insert(dqn_msg(0))
        s.changed.notify()
        await messages(3)
        await s.SetTopology(request([A, B], 1, 11, 0), Context())
        await messages(4)
        s.close()
        await asyncio.wait_for(watch, 5)
        assert [m.topology.generation for m in written] == [0, 10, 0, 11], written
        assert written[2].samples_inserted_total > 0   # (a limit that moved, without the list)
    asyncio.run(run())


def test_a_draining_replay_waits_for_its_actors_then_counts_what_it_holds_as_evicted(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(drain_module.time, "monotonic", lambda: clock[0])

    async def run():
        store = dqn_store()
        for seq in range(3):
            store.insert(dqn_msg(seq))
        held = store.size
        s = BufferServicer(store, store.metrics)
        s.drain.watch_opened("actor-0")                       # an actor still watches this shard
        ack = await s.SetTopology(request([A, B], 1, 5, 1), Context())
        assert ack.draining and not ack.drained and ack.actors_live == 1
        s.drain.watch_closed("actor-0")                       # it moved away
        clock[0] += drain_module.DRAIN_QUIET_S / 2            # ... but may still be pushing here
        assert not (await s.SetTopology(request([A, B], 1, 5, 1), Context())).drained
        s.drain.pushing = 1                                   # a push stream is open
        clock[0] += drain_module.DRAIN_QUIET_S
        assert not (await s.SetTopology(request([A, B], 1, 5, 1), Context())).drained
        s.drain.pushing = 0
        ack = await s.SetTopology(request([A, B], 1, 5, 1), Context())
        assert ack.drained and ack.size_samples == 0 and store.size == 0
        assert store.metrics.counters["buffer/samples_evicted_on_drain_total"] == held > 0
        store.insert(dqn_msg(3))                              # (an emptied replay still stores)
        assert store.size > 0
    asyncio.run(run())


def test_a_draining_fifo_is_drained_only_once_served_out(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(drain_module.time, "monotonic", lambda: clock[0])

    async def run():
        store = ppo_store()
        for seq in range(2):
            store.insert(ppo_msg(seq))
        s = BufferServicer(store, store.metrics)
        await s.SetTopology(request([A, B], 1, 5, 1), Context())
        clock[0] += 2 * drain_module.DRAIN_QUIET_S
        assert not (await s.SetTopology(request([A, B], 1, 5, 1), Context())).drained   # 16 steps to serve
        store.report_progress("l", 0, 0)                           # a live learner
        assert store.next_batch(8, "l") is not None and store.next_batch(8, "l") is not None
        # Served out, but the learner has not said it consumed both batches (they may still be in the
        # stream's buffers, and would be lost with it): not drained yet.
        assert store.size == 0 and not (await s.SetTopology(request([A, B], 1, 5, 1), Context())).drained
        store.report_progress("l", 1, 2)
        ack = await s.SetTopology(request([A, B], 1, 5, 1), Context())
        assert ack.drained and store.metrics.counters["buffer/samples_evicted_on_drain_total"] == 0
        # Active again (the planner added a shard back): no longer draining.
        assert not (await s.SetTopology(request([A, B], 2, 6, 1), Context())).draining
    asyncio.run(run())
