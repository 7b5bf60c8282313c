"""The actor's send queue (services/actor/push.py): bounded in fragments and in bytes, it drops the
oldest unsent fragment at either bound and counts every drop; nothing else leaves it unsent."""

from __future__ import annotations

from services.actor.push import Pusher
from services.common.protocol.fragments import EncodedFragment
from services.common.stats import Metrics


class NoChannel:
    def stream_unary(self, *args, **kwargs):
        return None


def frag(seq: int, size: int) -> EncodedFragment:
    return EncodedFragment(seq=seq, samples=16, payload=b"x" * size)


def test_the_byte_bound_drops_the_oldest_and_counts_it():
    metrics = Metrics("actor")
    p = Pusher(NoChannel(), capacity=100, ack_interval_s=1.0, metrics=metrics, max_bytes=1000)
    for seq in range(3):
        p.enqueue(frag(seq, 400))          # the third would make 1,200 bytes: the oldest goes
    assert [m.seq for m in p.queue] == [1, 2] and p.queued_bytes == 800
    assert metrics.counters["actor/fragments_dropped_total"] == 1


def test_the_fragment_bound_drops_the_oldest_and_counts_it():
    metrics = Metrics("actor")
    p = Pusher(NoChannel(), capacity=2, ack_interval_s=1.0, metrics=metrics, max_bytes=1 << 20)
    for seq in range(5):
        p.enqueue(frag(seq, 10))
    assert [m.seq for m in p.queue] == [3, 4] and p.queued_bytes == 20 and p.pending == 2
    assert metrics.counters["actor/fragments_dropped_total"] == 3


def test_a_fragment_larger_than_the_byte_bound_is_still_queued_alone():
    metrics = Metrics("actor")
    p = Pusher(NoChannel(), capacity=10, ack_interval_s=1.0, metrics=metrics, max_bytes=100)
    p.enqueue(frag(0, 50))
    p.enqueue(frag(1, 500))                # bigger than the bound: it replaces what is queued, never itself
    assert [m.seq for m in p.queue] == [1] and metrics.counters["actor/fragments_dropped_total"] == 1


def test_the_fill_gauge_is_the_nearer_of_the_two_bounds():
    """The planner reads `actor/push_queue_fill` as the share of this actor's own bounds in use."""
    metrics = Metrics("actor")
    p = Pusher(NoChannel(), capacity=10, ack_interval_s=1.0, metrics=metrics, max_bytes=1000)
    assert metrics.gauges["actor/push_queue_fill"] == 0.0
    p.enqueue(frag(0, 100))
    p.enqueue(frag(1, 100))
    assert metrics.gauges["actor/push_queue_fill"] == 0.2          # 2 of 10 fragments, 200 of 1,000 bytes
    p.enqueue(frag(2, 500))
    assert metrics.gauges["actor/push_queue_fill"] == 0.7          # bytes are nearer: 700 of 1,000
    for seq in range(3, 10):
        p.enqueue(frag(seq, 1))
    assert len(p.queue) == 10 and metrics.gauges["actor/push_queue_fill"] == 1.0   # fragments now: 10 of 10


def test_each_policys_queue_reports_its_own_gauges_and_the_counters_add_up():
    """Of several policies in one actor (config `policies`), each link's send queue gauges go under
    `actor/policies/<policy>/`, so one never overwrites the other; drops still add up in one counter."""
    metrics = Metrics("actor")
    lead = Pusher(NoChannel(), capacity=2, ack_interval_s=1.0, metrics=metrics.scoped("lead"), max_bytes=1 << 20)
    team = Pusher(NoChannel(), capacity=4, ack_interval_s=1.0, metrics=metrics.scoped("team"), max_bytes=1 << 20)
    for seq in range(3):
        lead.enqueue(frag(seq, 10))     # the third drops one
    team.enqueue(frag(0, 10))
    g = metrics.gauges
    assert (g["actor/policies/lead/push_queue_fill"], g["actor/policies/team/push_queue_fill"]) == (1.0, 0.25)
    assert (g["actor/policies/lead/push_queue_fragments"], g["actor/policies/team/push_queue_fragments"]) == (2, 1)
    assert "actor/push_queue_fill" not in g
    assert metrics.counters["actor/fragments_dropped_total"] == 1
    assert metrics.scoped("") is metrics
