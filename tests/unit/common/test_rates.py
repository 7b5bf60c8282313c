"""`<name>_per_s` rates (services/common/stats.py WindowRate): a counter's increase over the last 5 s,
exactly 0 a few seconds after the counter stops. Explicit times throughout, never the clock."""

from __future__ import annotations

import pytest

from services.common.stats import Metrics, WindowRate


def test_the_first_sample_gives_no_rate_and_the_second_the_rate_directly():
    r = WindowRate(5.0)
    assert r.update(0, now=100.0) == 0.0
    assert r.update(50, now=101.0) == pytest.approx(50.0)


def test_a_steady_counter_reads_its_rate():
    r = WindowRate(5.0)
    for t in range(30):
        r.update(200 * t, now=float(t))
    assert r.value == pytest.approx(200.0)


def test_the_rate_is_exactly_zero_within_window_plus_one_tick_of_the_counter_stopping():
    r = WindowRate(5.0)
    for t in range(20):
        r.update(100 * t, now=float(t))  # last increase seen at t=19
    values = {t: r.update(1900, now=float(t)) for t in range(20, 30)}
    assert values[20] > 0 and values[23] > 0
    assert all(values[t] == 0.0 for t in range(24, 30))  # t=24: baseline is the t=19 sample
    assert values[21] < values[20]  # it falls steadily on the way


def test_the_window_averages_bursts():
    r = WindowRate(5.0)
    counter = 0
    for t in range(40):
        counter += 1000 if t % 5 == 0 else 0  # 1000 every 5 s: 200/s on average
        r.update(counter, now=float(t))
    assert r.value == pytest.approx(200.0, rel=0.25)


def test_a_gap_longer_than_the_window_gives_the_average_over_the_gap():
    r = WindowRate(5.0)
    r.update(0, now=0.0)
    r.update(100, now=1.0)
    assert r.update(1100, now=21.0) == pytest.approx(50.0)


def test_time_that_does_not_advance_keeps_the_value_and_a_counter_never_gives_a_negative_rate():
    r = WindowRate(5.0)
    r.update(0, now=0.0)
    assert r.update(10, now=1.0) == pytest.approx(10.0)
    assert r.update(99, now=1.0) == pytest.approx(10.0)
    assert r.update(0, now=2.0) == 0.0


def test_samples_kept_stay_bounded():
    r = WindowRate(5.0)
    for i in range(10_000):
        r.update(i, now=i * 0.1)
    assert len(r._samples) <= 52


def test_metrics_rates_follow_ticks_and_fall_to_zero():
    m = Metrics("actor")
    m.track_rate("actor/env_steps_per_s", "actor/env_steps_total")
    assert m.snapshot()["actor/env_steps_per_s"] == 0.0
    for t in range(10):
        m.tick(now=float(t))
        m.inc("actor/env_steps_total", 64)
    m.tick(now=10.0)
    assert m.snapshot()["actor/env_steps_per_s"] == pytest.approx(64.0)
    for t in range(11, 17):
        m.tick(now=float(t))
    assert m.snapshot()["actor/env_steps_per_s"] == 0.0


def test_get_stats_response_carries_the_process_start_time():
    m = Metrics("buffer")
    resp = m.response()
    assert resp.process_start_unix_s == m.started > 0
    assert resp.episodes_remaining == 0 and resp.episodes_skipped == 0 and resp.oldest_episode_index == 0
