"""A buffer shard's drain on its own (services/buffer/drain.py), without gRPC or a servicer: which shard
lists it takes, when it is draining, and what it waits for before it says it is drained. (Through the
servicer's SetTopology: tests/unit/buffer/test_topology.py.)"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from kuberl.v1 import buffer_pb2
from services.buffer.drain import DRAIN_QUIET_S, ShardDrain
from tests.unit.buffer.test_store import dqn_msg, dqn_store, ppo_msg, ppo_store

A, B, C = "127.0.0.1:5001", "127.0.0.1:5002", "127.0.0.1:5003"
ROOT = Path(__file__).resolve().parents[3]


def topology(generation: int, active: int, addresses=(A, B, C)) -> buffer_pb2.BufferTopology:
    return buffer_pb2.BufferTopology(generation=generation, addresses=list(addresses), active=active)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drain_of(store=None):
    store = store if store is not None else dqn_store()
    clock = Clock()
    return ShardDrain(store, store.metrics, clock), clock, store


def test_only_a_newer_list_is_taken_and_a_shard_past_the_active_ones_drains_until_it_is_active_again():
    d, _, store = drain_of()
    assert not d.draining and d.topology.generation == 0 and d.shard is None   # no list: active
    assert d.take(topology(3, 3), 2) and not d.draining and d.shard == 2
    assert not d.take(topology(3, 2), 2)                        # the same generation again: ignored
    assert d.take(topology(4, 2), 2) and d.draining              # past the 2 active ones
    assert not d.take(topology(2, 3), 2) and d.draining          # an older list: ignored
    snapshot = store.metrics.snapshot()
    assert snapshot["buffer/draining"] == 1 and snapshot["buffer/topology_generation"] == 4
    assert d.take(topology(5, 3), 2) and not d.draining          # added back: the drain ends
    assert store.metrics.snapshot()["buffer/draining"] == 0


def test_a_draining_shard_waits_for_quiet_after_its_last_actor_and_push_stream():
    d, clock, _ = drain_of()
    d.watch_opened("a")
    d.watch_opened("a")                                          # (two streams of one actor: one live actor)
    d.watch_opened("b")
    assert d.actors_live == 2
    d.take(topology(1, 1), 1)
    clock.now += 10 * DRAIN_QUIET_S
    assert not d.drained()                                       # actors still watch it
    d.watch_closed("a")
    d.watch_closed("b")
    assert d.actors_live == 1 and not d.drained()
    d.watch_closed("a")
    assert d.actors_live == 0
    d.push_opened()
    assert not d.drained()                                       # a push stream is open
    clock.now += 10 * DRAIN_QUIET_S
    d.push_closed()                                              # its last fragments came just now
    clock.now += DRAIN_QUIET_S / 2
    assert not d.drained()
    clock.now += DRAIN_QUIET_S / 2
    assert d.drained()                                           # (an empty replay: nothing to serve)


def test_the_quiet_starts_when_the_shard_starts_draining():
    d, clock, _ = drain_of()
    clock.now += 10 * DRAIN_QUIET_S                              # quiet for long, but not draining
    d.take(topology(1, 1), 1)
    assert not d.drained()                                       # an actor moving away may still push
    clock.now += DRAIN_QUIET_S
    assert d.drained()
    d.take(topology(2, 1), 1)                                    # still draining: the quiet is not reset
    assert d.drained()


def test_a_drained_replay_counts_what_it_held_as_evicted():
    d, clock, store = drain_of(dqn_store())
    for seq in range(3):
        store.insert(dqn_msg(seq))
    held = store.size
    d.take(topology(1, 1), 1)
    clock.now += DRAIN_QUIET_S
    assert held > 0 and d.drained() and store.size == 0
    assert store.metrics.counters["buffer/samples_evicted_on_drain_total"] == held


def test_a_draining_fifo_is_drained_once_served_out_and_reported_consumed():
    d, clock, store = drain_of(ppo_store())
    for seq in range(2):
        store.insert(ppo_msg(seq))
    d.take(topology(1, 1), 1)
    clock.now += DRAIN_QUIET_S
    assert not d.drained()                                       # 16 steps to serve
    store.report_progress("l", 0, 0)
    assert store.next_batch(8, "l") is not None and store.next_batch(8, "l") is not None
    assert store.size == 0 and not d.drained()                   # served, not yet reported consumed
    store.report_progress("l", 1, 2)
    assert d.drained() and store.metrics.counters["buffer/samples_evicted_on_drain_total"] == 0


def test_being_drained_is_logged_once_per_generation(caplog):
    d, _, _ = drain_of()
    d.take(topology(1, 1), 1)
    with caplog.at_level(logging.INFO, logger="services.buffer.drain"):
        d.said_drained()
        d.said_drained()
        d.take(topology(2, 1), 1)
        d.said_drained()
    assert [r.getMessage() for r in caplog.records if "nothing left to serve" in r.getMessage()] == [
        "drained: no actor watches or pushes, nothing left to serve (generation 1)",
        "drained: no actor watches or pushes, nothing left to serve (generation 2)"]


def test_the_drain_imports_no_grpc():
    code = ("import sys, services.buffer.drain; "
            "sys.exit(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.')) or None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
