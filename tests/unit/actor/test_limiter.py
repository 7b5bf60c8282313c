"""The actor's side of the rate limiter (services/actor/limiter.py): room counts the actor's own
fragments until the buffer says they are stored; no limit known holds nothing; a hold ends on room."""

from __future__ import annotations

import threading

from services.actor.limiter import InsertGate
from services.common.stats import Metrics


def test_own_unstored_fragments_count_until_the_high_water_seq_passes_them():
    gate = InsertGate(Metrics("actor"))
    assert gate.room()  # no limit known
    gate.update(limit=100, inserted=60, high_water_seq=None)
    assert gate.room()
    gate.cut(0, 24)  # 60 + 24 = 84 < 100
    assert gate.room()
    gate.cut(1, 24)  # 108: held
    assert not gate.room()
    assert gate.gauges()["actor/limiter_unstored_samples"] == 48
    gate.update(limit=100, inserted=84, high_water_seq=0)  # seq 0 stored: 84 + 24 = 108, still held
    assert not gate.room()
    gate.update(limit=120, inserted=108, high_water_seq=1)  # both stored: 108 < 120
    assert gate.room() and gate.gauges()["actor/limiter_room_samples"] == 12
    gate.cut(1, 24)  # a seq already stored (a re-cut after a restart of the count) is not counted
    assert gate.gauges()["actor/limiter_unstored_samples"] == 0


def test_no_limit_known_holds_nothing():
    gate = InsertGate(Metrics("actor"))
    gate.update(limit=10, inserted=50, high_water_seq=None)
    assert not gate.room()
    gate.clear()  # the stream broke
    assert gate.room()
    gate.update(limit=None, inserted=50, high_water_seq=None)  # an unpaced replay
    assert gate.room()


def test_a_hold_ends_when_a_later_limit_leaves_room_and_is_counted():
    metrics = Metrics("actor")
    gate = InsertGate(metrics)
    gate.update(limit=10, inserted=10, high_water_seq=None)
    result = []
    t = threading.Thread(target=lambda: result.append(gate.wait(poll_s=0.01)))
    t.start()
    while metrics.counters["actor/limiter_waits_total"] == 0:  # the thread entered the hold
        t.join(timeout=0.01)
    gate.update(limit=20, inserted=10, high_water_seq=None)
    t.join(timeout=30)
    assert not t.is_alive() and result[0] > 0
    assert metrics.counters["actor/limiter_waits_total"] == 1
    held = metrics.counters["actor/limiter_wait_seconds_total"]
    assert 0 < held <= result[0]
    # the planner's counter of time not producing includes it
    assert metrics.counters["actor/pace_wait_seconds_total"] == held
    assert gate.wait() == 0.0 and metrics.counters["actor/limiter_waits_total"] == 1  # room: no wait


def test_stop_ends_a_hold():
    gate = InsertGate(Metrics("actor"))
    gate.update(limit=0, inserted=0, high_water_seq=None)
    stop = threading.Event()
    stop.set()
    gate.wait(stop, poll_s=0.01)
    assert not gate.room()
