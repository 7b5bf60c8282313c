"""Per-replica rates: warm-up from the first work done, learner capacity net of starved time, restarts."""

import pytest

from services.planner.rates import ReplicaRate


def test_actor_rate_counts_only_after_warm_up_from_first_progress():
    r = ReplicaRate(halflife_s=5.0, warmup_s=3.0, now=0.0)
    for t in range(0, 5):          # serving, but no env steps yet (imports, env creation)
        r.update(float(t), 0.0, None)
    assert r.first_progress is None and not r.usable(4.0, 15.0)
    r.update(5.0, 10.0, None)       # a slow first second...
    r.update(7.0, 20.0, None)
    assert not r.warm
    for t in range(8, 20):          # ...then 100 steps/s
        r.update(float(t), 20.0 + 100.0 * (t - 7), None)
    assert r.warm and r.usable(19.0, 15.0)
    assert r.rate == pytest.approx(100.0)


def test_learner_capacity_excludes_time_starved_of_batches():
    r = ReplicaRate(halflife_s=5.0, warmup_s=0.0, now=0.0)
    r.update(0.0, 0.0, 0.0)
    # Each second: 1,000 samples trained, 0.75 s spent waiting for a batch -> 4,000 samples/s capacity.
    for t in range(1, 10):
        r.update(float(t), 1000.0 * t, 0.75 * t)
    assert r.rate == pytest.approx(4000.0)
    # A second with 99% starvation says nothing about capacity and leaves the estimate alone.
    r.update(10.0, 9010.0, 0.75 * 9 + 0.99)
    assert r.rate == pytest.approx(4000.0)


def test_a_learner_starved_from_its_start_gets_a_lower_bound_so_the_planner_can_add_actors():
    """Too few actors: the learner waits for batches nearly all the time. Its capacity is at least what it
    trained over the 5% of the interval it can at most have been busy (found on a real node: one actor
    at 150 steps/s, learner starved 99.9%, and the planner never decided anything)."""
    r = ReplicaRate(halflife_s=5.0, warmup_s=0.0, now=0.0)
    r.update(0.0, 0.0, 0.0)
    r.update(5.0, 512.0, 4.99)                      # one batch in 5 s, busy 0.01 s
    assert r.rate == pytest.approx(512.0 / (0.05 * 5.0))
    r.update(10.0, 512.0, 9.99)                      # nothing trained: no information, estimate kept
    assert r.rate == pytest.approx(512.0 / (0.05 * 5.0))
    r.update(15.0, 2048.0, 14.98)                    # a higher bound raises it
    assert r.rate == pytest.approx(1536.0 / (0.05 * 5.0))
    r.update(20.0, 4048.0, 15.98)                    # busy 4 of 5 s: measured, EWMA from the bound
    assert 1536.0 / 0.25 > r.rate > 500.0


def test_restart_under_the_same_name_starts_over():
    r = ReplicaRate(halflife_s=5.0, warmup_s=1.0, now=0.0)
    for t in range(6):
        r.update(float(t), 100.0 * t, None)
    assert r.usable(5.0, 15.0)
    r.update(6.0, 3.0, None)
    assert not r.warm and r.rate is None and not r.usable(6.0, 15.0)


def test_stale_after_silence_or_never_reporting():
    r = ReplicaRate(halflife_s=5.0, warmup_s=0.0, now=0.0)
    assert not r.stale(10.0, 15.0) and r.stale(16.0, 15.0)   # never answered for 16 s
    r.update(20.0, 0.0, None)
    r.update(21.0, 50.0, None)
    r.update(22.0, 100.0, None)
    assert r.usable(30.0, 15.0) and not r.usable(40.0, 15.0) and r.stale(40.0, 15.0)


def test_measured_cores_per_replica_after_warm_up_and_reset_on_restart():
    r = ReplicaRate(halflife_s=5.0, warmup_s=2.0, now=0.0)
    r.update(0.0, 0.0, None, 3.0)           # importing torch: CPU used before any work does not count
    for t in range(1, 12):                  # 100 steps/s on a quarter of a core
        r.update(float(t), 100.0 * t, None, 3.0 + 0.25 * t)
    assert r.cores == pytest.approx(0.25) and r.rate == pytest.approx(100.0)
    r.update(12.0, 1200.0, None, 0.5)       # CPU seconds went back: a new process under the same name
    assert r.cores is None and r.rate is None and not r.warm


def test_a_paced_actor_is_measured_by_what_it_produces_when_not_held_for_weights():
    """On-policy pacing holds an actor that outruns the learner; the planner must see its capacity
    (steps over the time it was not held), or it would add actors the learner cannot feed."""
    from services.actor.policy import Pace
    from services.config import config_from_dict
    from services.common.stats import Metrics
    from services.planner.observe import COUNTERS

    metrics = Metrics("actor")
    Pace(config_from_dict({}), policy=None, metrics=metrics)  # every actor exports the wait counter
    count_key, idle_key = COUNTERS["actor"]
    assert count_key == "actor/env_steps_total"
    assert idle_key == "actor/pace_wait_seconds_total" and idle_key in metrics.counters
    r = ReplicaRate(halflife_s=5.0, warmup_s=0.0, now=0.0)
    r.update(0.0, 0.0, 0.0)
    for t in range(1, 10):  # 400 steps a second, held 0.8 s of each: 2,000 steps/s when not held
        r.update(float(t), 400.0 * t, 0.8 * t)
    assert r.rate == pytest.approx(2000.0)


def test_a_counter_rate_follows_its_counter_and_starts_over_when_it_goes_down():
    from services.planner.rates import CounterRate

    c = CounterRate(halflife_s=1.0)
    c.update(0.0, 10.0)
    assert c.rate is None and c.fresh(0.0, 5.0) is None
    c.update(1.0, 20.0)
    assert c.rate == 10.0 and c.recent == 10.0
    c.update(2.0, 20.0)                         # nothing in the last interval: recent is exactly 0
    assert c.recent == 0.0 and 0.0 < c.rate < 10.0
    assert c.fresh(2.0, 5.0) == c.rate and c.fresh(2.0, 5.0, recent=True) == 0.0
    assert c.fresh(8.0, 5.0) is None            # not updated within stale_after_s
    c.update(3.0, 5.0)                          # the process restarted: its counter went down
    assert c.rate is None and c.recent is None
