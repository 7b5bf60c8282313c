"""Where an actor goes when the planner changes the shards (services/actor/shardlink.py): an indexed
actor to `index % active`; one without an index stays unless its shard drains or holds more than its
share, and then about the excess moves, to the least loaded shard."""

from __future__ import annotations

import asyncio

import pytest

from kuberl.v1 import buffer_pb2
from services.actor import shardlink
from services.actor.limiter import InsertGate
from services.actor.shardlink import ShardLink, excess_share
from services.common.stats import Metrics
from services.config import config_from_dict
from tests.helpers import TINY_DQN

ADDRESSES = ["127.0.0.1:5001", "127.0.0.1:5002", "127.0.0.1:5003"]


def topology(generation, active, addresses=ADDRESSES):
    return buffer_pb2.BufferTopology(generation=generation, addresses=addresses, active=active)


def link(shard: int, index: int | None, actor_id="actor-x") -> ShardLink:
    metrics = Metrics("actor")
    return ShardLink(config_from_dict(TINY_DQN), actor_id, 1, InsertGate(metrics), metrics, ADDRESSES, shard,
                     index, 1 << 20)


def test_excess_share_is_the_part_above_an_even_spread():
    assert excess_share({0: 4, 1: 0}, 0, 2) == pytest.approx(0.5)    # 4 on one of 2 shards: 2 should move
    assert excess_share({0: 2, 1: 2}, 0, 2) == 0.0
    assert excess_share({0: 3, 1: 1, 2: 0}, 0, 3) == pytest.approx(1 / 3)   # share ceil(4/3) = 2
    assert excess_share({}, 0, 2) == 0.0


async def test_an_indexed_actor_goes_to_its_index_modulo_the_active_shards():
    for index, active, want in [(0, 2, 0), (1, 2, 1), (3, 3, 0), (4, 3, 1), (1, 1, 0)]:
        lk = link(index % 2, index)
        assert await lk.target(topology(1, active)) == (ADDRESSES[want], True), (index, active)
        await lk.close()


async def test_an_actor_without_an_index_leaves_a_draining_shard_for_the_least_loaded(monkeypatch):
    async def live(addresses, cfg):
        return {0: 3.0, 1: 1.0}
    monkeypatch.setattr(shardlink, "live_actors", live)
    lk = link(2, None)                                   # on shard 2, which drains
    assert await lk.target(topology(1, 2)) == (ADDRESSES[1], False)   # (then it looks again)
    await lk.close()


async def test_about_the_excess_of_a_crowded_shard_moves(monkeypatch):
    """8 actors on shard 0 of 2: each moves with probability 1/2, so about 4 do (a fixed seed per actor)."""
    async def live(addresses, cfg):
        return {0: 8.0, 1: 0.0}
    monkeypatch.setattr(shardlink, "live_actors", live)
    moved = 0
    for i in range(400):
        lk = link(0, None, actor_id=f"actor-{i}")
        moved += (await lk.target(topology(1, 2)))[0] == ADDRESSES[1]
        await lk.close()
    assert 160 <= moved <= 240, moved   # binomial(400, 1/2): mean 200, sd 10


async def test_actors_without_an_index_hearing_one_list_end_up_spread(monkeypatch):
    """Six actors on shard 0 hear that there are two shards now. Each looks after its own random delay
    and sees the live counts as the others' moves left them (a shared model of the shards here), and
    looks again until its shard holds no more than its share: they end three and three."""
    monkeypatch.setattr(shardlink, "PLACEMENT_SPREAD_S", 0.05)
    live = {0: 6.0, 1: 0.0}

    async def counts(addresses, cfg):
        return dict(live)
    monkeypatch.setattr(shardlink, "live_actors", counts)
    links = [link(0, None, actor_id=f"pod-{i}") for i in range(6)]
    for lk in links:
        def moved(address, shard, shards, lk=lk):
            live[ADDRESSES.index(lk.current.address)] -= 1
            live[shard] += 1
            lk.current.address = address
        monkeypatch.setattr(lk, "_move", moved)
        lk.on_topology(topology(5, 2))
    await asyncio.gather(*(lk._placing for lk in links))
    assert live == {0: 3.0, 1: 3.0}, live
    assert links[0].metrics.gauges["actor/topology_generation"] == 5
    for lk in links:
        await lk.close()


async def test_a_newer_topology_moves_the_pusher_and_the_old_one_delivers_what_it_holds(monkeypatch):
    lk = link(0, 1)
    started = []
    monkeypatch.setattr(lk, "_watch", lambda: started.append(lk.current.address))
    lk.current.pusher.queue.append(object())            # a fragment queued for shard 0 (never sent here)
    old = lk.current
    lk.on_topology(topology(7, 2))
    await lk._placing
    assert lk.current.address == ADDRESSES[1] and started == [ADDRESSES[1]]
    assert old in lk.retiring and old.stop.is_set()      # it goes on until what it holds is acknowledged
    assert lk.metrics.gauges["actor/buffer_shard"] == 1 and lk.metrics.counters["actor/shard_moves_total"] == 1
    lk.on_topology(topology(6, 1))                        # older: ignored
    assert lk._placing.done() and lk.generation == 7
    assert lk.pending == 1
    for item in (old, lk.current):
        if item.task is not None:
            item.task.cancel()
    await asyncio.gather(*(t for t in (old.task, lk.current.task) if t is not None), return_exceptions=True)
    await lk.close()


async def test_run_waits_for_the_pushers_at_shutdown_without_spinning(monkeypatch):
    """Once stopping is set, `run` waits for the pushers to deliver what they hold: it must sleep on
    them, not go round its loop (a loop that spun starved the actor's pushers of the CPU they need)."""
    lk = link(0, 0)
    monkeypatch.setattr(lk, "_watch", lambda: None)
    released = asyncio.Event()

    async def pushing(stop):   # the pusher: done once stopped and (later) everything is acknowledged
        await stop.wait()
        await released.wait()
    monkeypatch.setattr(lk.current.pusher, "run", pushing)
    rounds = 0
    reap = lk._reap

    def counting():
        nonlocal rounds
        rounds += 1
        reap()
    monkeypatch.setattr(lk, "_reap", counting)
    stopping = asyncio.Event()
    running = asyncio.create_task(lk.run(stopping))
    await asyncio.sleep(0.05)
    stopping.set()
    for _ in range(200):         # 200 turns of the event loop while the pusher still holds fragments
        await asyncio.sleep(0)
    assert not running.done() and rounds <= 4, rounds
    released.set()
    await asyncio.wait_for(running, 5)
    await lk.close()
