"""services/common/stats.py: Histogram bucket arithmetic, its rolling summary, and how Metrics
snapshots include histograms and gauge providers."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.stats import LAG_BUCKETS, Histogram, Metrics, Rolling

BUCKETS = (0, 1, 2, 4)


def summary_of(values, prefix: str = "x") -> dict[str, float]:
    """What Rolling.summary should give for `values`, computed with numpy directly."""
    arr = np.asarray(values, dtype=np.float64)
    return {f"{prefix}_mean": float(arr.mean()), f"{prefix}_p50": float(np.percentile(arr, 50)),
            f"{prefix}_p95": float(np.percentile(arr, 95)), f"{prefix}_max": float(arr.max())}


# --- buckets ------------------------------------------------------------------------------------

def test_new_histogram_is_empty():
    h = Histogram(BUCKETS)
    assert h.count == 0 and h.sum == 0.0
    assert h.cumulative() == [("0", 0), ("1", 0), ("2", 0), ("4", 0), ("+Inf", 0)]
    assert h.recent.summary("x") == {}


def test_bucket_counts_by_hand():
    h = Histogram(BUCKETS)
    # per bucket: le 0 <- {-1, 0}; (0, 1] <- {1}; (1, 2] <- {1.5, 2}; (2, 4] <- {3, 4}; above 4 <- {5}
    h.observe([0, 1, 1.5, 2, 3, 4, 5, -1])
    assert h.counts.tolist() == [2, 1, 2, 2, 1]
    assert h.cumulative() == [("0", 2), ("1", 3), ("2", 5), ("4", 7), ("+Inf", 8)]
    assert h.count == 8
    assert h.sum == pytest.approx(15.5)


@pytest.mark.parametrize("bound", BUCKETS)
def test_value_exactly_on_a_bound_counts_in_that_bucket(bound):
    h = Histogram(BUCKETS)
    h.observe([bound])
    cum = dict(h.cumulative())
    for b in BUCKETS:
        assert cum[f"{b:g}"] == (1 if b >= bound else 0), f"le={b} after observing {bound}"
    assert cum["+Inf"] == 1


def test_value_just_above_a_bound_goes_to_the_next_bucket():
    h = Histogram(BUCKETS)
    h.observe([np.nextafter(1.0, 2.0)])
    assert h.counts.tolist() == [0, 0, 1, 0, 0]


def test_values_above_the_last_bound_land_only_in_inf():
    h = Histogram(BUCKETS)
    h.observe([4.000001, 100, 1e9])
    assert h.cumulative() == [("0", 0), ("1", 0), ("2", 0), ("4", 0), ("+Inf", 3)]
    assert h.count == 3


def test_weights_multiply_counts_and_sum():
    h = Histogram(BUCKETS)
    h.observe([1, 3, 10], weights=[3, 2, 5])
    assert h.counts.tolist() == [0, 3, 0, 2, 5]
    assert h.cumulative() == [("0", 0), ("1", 3), ("2", 3), ("4", 5), ("+Inf", 10)]
    assert h.count == 10
    assert h.sum == pytest.approx(1 * 3 + 3 * 2 + 10 * 5)
    assert list(h.recent._values) == [1, 1, 1, 3, 3] + [10] * 5


def test_zero_weight_records_nothing():
    h = Histogram(BUCKETS)
    h.observe([2, 7], weights=[0, 1])
    assert h.counts.tolist() == [0, 0, 0, 0, 1]
    assert h.count == 1 and h.sum == 7.0
    assert list(h.recent._values) == [7.0]


def test_observations_accumulate_across_calls():
    h = Histogram(BUCKETS)
    h.observe([0, 2])
    h.observe(3)  # a scalar is one value
    h.observe([2], weights=[4])
    assert h.counts.tolist() == [1, 0, 5, 1, 0]
    assert h.count == 7
    assert h.sum == pytest.approx(0 + 2 + 3 + 8)


def test_empty_observation_changes_nothing():
    h = Histogram(BUCKETS)
    h.observe([1])
    h.observe([])
    h.observe([], weights=[])
    assert h.count == 1 and h.counts.tolist() == [0, 1, 0, 0, 0]


def test_random_observations_match_a_direct_count():
    rng = np.random.default_rng(0)
    h = Histogram(LAG_BUCKETS)
    all_values, all_weights = [], []
    for _ in range(20):
        values = rng.integers(-3, 70000, size=rng.integers(0, 30))
        # lags are small most of the time; put some right on bounds
        values[: len(values) // 2] = rng.choice(LAG_BUCKETS, size=len(values) // 2)
        weights = rng.integers(0, 5, size=len(values))
        h.observe(values, weights)
        all_values.append(values)
        all_weights.append(weights)
    values, weights = np.concatenate(all_values), np.concatenate(all_weights)
    cum = h.cumulative()
    counts = [c for _, c in cum]
    assert counts == sorted(counts), "cumulative counts must be non-decreasing"
    assert cum[-1] == ("+Inf", h.count)
    assert h.count == int(weights.sum())
    assert h.sum == pytest.approx(float((values * weights).sum()))
    for (label, c), bound in zip(cum, LAG_BUCKETS):
        assert label == str(bound)
        assert c == int(weights[values <= bound].sum()), f"le={label}"


def test_default_bucket_labels_are_integers():
    labels = [label for label, _ in Histogram().cumulative()]
    assert labels == [str(b) for b in LAG_BUCKETS] + ["+Inf"]


# --- rolling window -----------------------------------------------------------------------------

def test_rolling_summary_matches_numpy():
    r = Rolling(100)
    values = np.random.default_rng(1).standard_normal(37)
    r.extend(values)
    assert r.summary("x") == pytest.approx(summary_of(values))


def test_rolling_keeps_only_the_last_window_values():
    r = Rolling(5)
    for v in range(1, 9):
        r.add(v)
    assert list(r._values) == [4, 5, 6, 7, 8]
    assert r.summary("x") == pytest.approx(summary_of([4, 5, 6, 7, 8]))


def test_histogram_recent_summarises_only_the_last_window_values():
    h = Histogram(BUCKETS, window=10)
    rng = np.random.default_rng(2)
    first = rng.uniform(100, 200, 25)   # all of these must fall out of the window
    second = rng.uniform(0, 5, 10)
    h.observe(first)
    h.observe(second)
    assert h.recent.summary("x") == pytest.approx(summary_of(second))
    assert h.recent.summary("x")["x_max"] < 100
    # the cumulative buckets still count everything
    assert h.count == 35
    assert h.cumulative()[-1] == ("+Inf", 35)


def test_histogram_window_straddles_observe_calls():
    h = Histogram(BUCKETS, window=6)
    h.observe([1, 2, 3, 4])
    h.observe([5, 6, 7])
    assert h.recent.summary("x") == pytest.approx(summary_of([2, 3, 4, 5, 6, 7]))


def test_histogram_window_with_weights_keeps_the_last_repeated_values():
    h = Histogram(BUCKETS, window=4)
    h.observe([1, 9], weights=[3, 2])  # expanded: 1 1 1 9 9 -> last four: 1 1 9 9
    assert h.recent.summary("x") == pytest.approx(summary_of([1, 1, 9, 9]))
    h.observe([5], weights=[100])
    assert h.recent.summary("x") == pytest.approx(summary_of([5, 5, 5, 5]))


def test_percentiles_by_hand():
    h = Histogram(BUCKETS)
    h.observe(range(1, 101))  # 1..100
    s = h.recent.summary("lag")
    assert s == pytest.approx({"lag_mean": 50.5, "lag_p50": 50.5, "lag_p95": 95.05, "lag_max": 100.0})


# --- Metrics ------------------------------------------------------------------------------------

def test_metrics_histogram_is_created_once():
    m = Metrics("learner")
    h = m.histogram("learner/policy_lag")
    assert m.histogram("learner/policy_lag") is h
    assert m.histograms == {"learner/policy_lag": h}
    assert h.buckets == tuple(float(b) for b in LAG_BUCKETS)


def test_metrics_histogram_with_custom_buckets():
    m = Metrics("x")
    h = m.histogram("x/d", buckets=(1, 10))
    h.observe([0.5, 5, 50])
    assert h.cumulative() == [("1", 1), ("10", 2), ("+Inf", 3)]


def test_snapshot_includes_histogram_summary():
    m = Metrics("learner")
    m.histogram("learner/policy_lag").observe([0, 1, 3], weights=[4, 2, 2])
    snap = m.snapshot()
    expected = summary_of([0, 0, 0, 0, 1, 1, 3, 3], "learner/policy_lag")
    for key, value in expected.items():
        assert snap[key] == pytest.approx(value), key
    assert snap["learner/policy_lag_mean"] == pytest.approx(1.0)
    assert snap["learner/policy_lag_max"] == 3.0


def test_snapshot_omits_summary_of_an_empty_histogram():
    m = Metrics("learner")
    m.histogram("learner/policy_lag")
    snap = m.snapshot()
    assert not [k for k in snap if k.startswith("learner/policy_lag")]


def test_gauge_providers_are_evaluated_at_each_snapshot():
    m = Metrics("buffer")
    calls = []

    def provider():
        calls.append(1)
        return {"buffer/size_samples": 10.0 * len(calls), "buffer/ratio": 0.5}

    m.add_gauges(provider)
    assert calls == []  # computed on demand only
    first = m.snapshot()
    second = m.snapshot()
    assert first["buffer/size_samples"] == 10.0 and second["buffer/size_samples"] == 20.0
    assert second["buffer/ratio"] == 0.5
    assert len(calls) == 2


def test_several_gauge_providers_and_set_gauges_all_appear():
    m = Metrics("buffer")
    m.set("buffer/static", 3)
    m.inc("buffer/things_total", 2)
    m.add_gauges(lambda: {"buffer/a": 1.0})
    m.add_gauges(lambda: {"buffer/b": 2.0})
    snap = m.snapshot()
    assert snap["buffer/a"] == 1.0 and snap["buffer/b"] == 2.0
    assert snap["buffer/static"] == 3.0
    assert snap["buffer/things_total"] == 2.0
    assert "buffer/uptime_s" in snap
