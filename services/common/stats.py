"""Counters, gauges, windowed rates and rolling distributions of one service (the GetStats payload).

Names follow `<role>/<name>` with the unit in the name (`actor/env_steps_per_s`,
`buffer/fragments_duplicate_total`). Counters may be incremented from one worker thread while the
event loop reads snapshots; each counter has a single writer.
"""

from __future__ import annotations

import asyncio
import copy
import math
import os
import socket
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from kuberl.v1 import common_pb2 as pb


class WindowRate:
    """Per-second rate of a monotonic counter over the last `window_s` seconds.

    `update(counter, now)` records a sample and sets `value` to the counter's increase since the newest
    sample at least `window_s` old (or the oldest one kept, early on) divided by the time between them.
    Once the counter stops moving, `value` is exactly 0 from the first update at least `window_s`
    after the first sample that saw the final count (so within `window_s` + one update period of the
    last increase). Once that much history exists the rate is an average over at least `window_s`,
    smooth like an EWMA but never decaying forever after production stops."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self.value = 0.0
        self._samples: deque[tuple[float, float]] = deque()  # (time, counter), oldest first

    def update(self, counter: float, now: float) -> float:
        samples = self._samples
        if samples and now <= samples[-1][0]:
            return self.value  # time did not advance
        samples.append((now, float(counter)))
        # Keep one sample at or before the window's start (the baseline) and those after it.
        while len(samples) >= 2 and samples[1][0] <= now - self.window_s:
            samples.popleft()
        t0, c0 = samples[0]
        self.value = max(0.0, (float(counter) - c0) / (now - t0)) if now > t0 else 0.0
        return self.value


class Ewma:
    """Exponentially weighted rate of a monotonic counter, with half-life `halflife_s` seconds.

    Not used for the `_per_s` metrics any more (see WindowRate): an EWMA decays only while ticked and
    takes many half-lives to reach 0 after production stops."""

    def __init__(self, halflife_s: float = 5.0):
        self.halflife_s = halflife_s
        self.value = 0.0
        self._last: tuple[float, float] | None = None  # (time, counter)

    def update(self, counter: float, now: float) -> float:
        if self._last is None:
            self._last = (now, counter)
            return self.value
        t0, c0 = self._last
        dt = now - t0
        if dt <= 0:
            return self.value
        inst = (counter - c0) / dt
        alpha = 1.0 - math.exp(-dt * math.log(2) / self.halflife_s)
        # The first interval sets the rate directly so it does not ramp up from zero.
        self.value = inst if self.value == 0.0 else self.value + alpha * (inst - self.value)
        self._last = (now, counter)
        return self.value


class Rolling:
    """The last `size` observations of a quantity; summarised as mean/p50/p95/max."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self._values.append(float(value))

    def extend(self, values: Iterable[float]) -> None:
        self._values.extend(float(v) for v in values)

    def summary(self, prefix: str) -> dict[str, float]:
        if not self._values:
            return {}
        arr = np.fromiter(self._values, dtype=np.float64)
        p50, p95 = np.percentile(arr, [50, 95])
        return {f"{prefix}_mean": float(arr.mean()), f"{prefix}_p50": float(p50),
                f"{prefix}_p95": float(p95), f"{prefix}_max": float(arr.max())}


# Upper bounds (inclusive) of the staleness buckets, in policy versions.
LAG_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)


class Histogram:
    """A distribution: cumulative counts per bucket since start (exported as a Prometheus histogram)
    and a rolling window of recent values (summarised as mean/p50/p95/max)."""

    def __init__(self, buckets: Iterable[float] = LAG_BUCKETS, window: int = 4096):
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = np.zeros(len(self.buckets) + 1, dtype=np.int64)  # last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0
        self.recent = Rolling(window)

    def observe(self, values: npt.ArrayLike, weights: npt.ArrayLike | None = None) -> None:
        """Record each value (`weights[i]` times, if given)."""
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        w = np.ones(len(values), np.int64) if weights is None else np.asarray(weights, np.int64).reshape(-1)
        np.add.at(self.counts, np.searchsorted(self.buckets, values, side="left"), w)
        self.sum += float((values * w).sum())
        self.count += int(w.sum())
        keep = self.recent.size
        self.recent.extend(np.repeat(values, w)[-keep:])

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, count of values <= it) pairs, ending with "+Inf" (Prometheus `le` buckets)."""
        cum = np.cumsum(self.counts)
        return [(f"{b:g}", int(c)) for b, c in zip(self.buckets, cum[:-1])] + [("+Inf", int(cum[-1]))]


class Metrics:
    """A service's metrics: `inc` counters, `set` gauges, rates derived from counters by `tick`."""

    def __init__(self, role: str, rate_window_s: float = 5.0, instance_id: str | None = None):
        self.role = role
        self.instance_id = instance_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
        self.started = time.time()
        self.counters: dict[str, float] = defaultdict(float)
        self.gauges: dict[str, float] = {}
        self.rollings: dict[str, Rolling] = {}
        self.histograms: dict[str, Histogram] = {}
        self._rates: dict[str, tuple[str, WindowRate]] = {}
        self._rate_window_s = rate_window_s
        self._gauge_providers: list[Callable[[], Mapping[str, float]]] = []
        self._labelled_providers: list[Callable[[], Iterable[tuple[str, Mapping[str, str], float]]]] = []
        self._inc_lock = threading.Lock()
        self._scope = ""

    def scoped(self, scope: str) -> Metrics:
        """A view of these metrics (the same counters, gauges and rates) whose gauges and rolling
        figures go under `<role>/policies/<scope>/`: what each of several policies' parts of a process
        reports apart (its insert gate, push queue, shard). Counters stay shared: they add up over the
        process. An empty `scope` is these metrics themselves."""
        if not scope:
            return self
        view = copy.copy(self)   # shares every dict and the lock
        view._scope = f"{self.role}/policies/{scope}/"
        return view

    def scope_name(self, name: str) -> str:
        """`name` (`<role>/...`) as this view reports a gauge: under its scope, if it has one."""
        return self._scope + name.removeprefix(f"{self.role}/") if self._scope else name

    def inc(self, name: str, n: float = 1) -> None:
        with self._inc_lock:   # (threads count too: a buffer's store owner, an actor's rollout thread)
            self.counters[name] += n

    def set(self, name: str, value: float) -> None:
        self.gauges[self.scope_name(name)] = float(value)

    def rolling(self, name: str, size: int = 4096) -> Rolling:
        name = self.scope_name(name)
        if name not in self.rollings:
            self.rollings[name] = Rolling(size)
        return self.rollings[name]

    def add_gauges(self, provider: Callable[[], Mapping[str, float]]) -> None:
        """Include `provider()` (a dict of gauges, computed on demand) in every snapshot."""
        self._gauge_providers.append(provider)

    def add_labelled(self, provider: Callable[[], Iterable[tuple[str, Mapping[str, str], float]]]) -> None:
        """Include `provider()`'s (name, labels, value) series in the Prometheus exposition (not in
        GetStats, whose map has no labels): figures per something a role holds a changing set of,
        such as an actor's EnvSession sessions. Called from the exporter's thread."""
        self._labelled_providers.append(provider)

    def labelled(self) -> list[tuple[str, Mapping[str, str], float]]:
        return [series for provider in self._labelled_providers for series in provider()]

    def histogram(self, name: str, buckets: Iterable[float] = LAG_BUCKETS) -> Histogram:
        if name not in self.histograms:
            self.histograms[name] = Histogram(buckets)
        return self.histograms[name]

    def track_rate(self, rate_name: str, counter_name: str) -> None:
        """Report `rate_name` as the per-second rate of counter `counter_name` over the last
        `rate_window_s` seconds (see WindowRate), as of the last `tick`. Tracking it again keeps its window."""
        if self._rates.get(rate_name, ("",))[0] == counter_name:
            return
        self._rates[rate_name] = (counter_name, WindowRate(self._rate_window_s))
        self.counters[counter_name] += 0

    def tick(self, now: float | None = None) -> None:
        """Fold the counters' progress into the rates; call about once a second."""
        now = time.monotonic() if now is None else now
        for counter_name, rate in self._rates.values():
            rate.update(self.counters[counter_name], now)

    def snapshot(self) -> dict[str, float]:
        out = {k: float(v) for k, v in list(self.counters.items())}
        out.update(self.gauges)
        for provider in self._gauge_providers:
            out.update(provider())
        for rate_name, (_, rate) in self._rates.items():
            out[rate_name] = rate.value
        for name, rolling in list(self.rollings.items()):
            out.update(rolling.summary(name))
        for name, hist in list(self.histograms.items()):
            out.update(hist.recent.summary(name))
        out[f"{self.role}/uptime_s"] = time.time() - self.started
        # CPU seconds of this process, all threads (the planner's measured cost of a replica, in cores).
        out[f"{self.role}/cpu_seconds_total"] = time.process_time()
        return out

    def response(self, episodes: Iterable[pb.Episode] = (), **fields: Any) -> pb.GetStatsResponse:
        """The GetStats answer: this snapshot, a heartbeat, uptime and the process's start time (plus
        any other GetStatsResponse `fields`, e.g. an actor's episode paging)."""
        metrics = self.snapshot()
        now = time.time()
        return pb.GetStatsResponse(role=self.role, instance_id=self.instance_id, heartbeat_unix_s=now,
                                   uptime_s=now - self.started, metrics=metrics, episodes=episodes,
                                   process_start_unix_s=self.started, **fields)


async def tick_forever(metrics: Metrics, period_s: float = 1.0) -> None:
    """Fold counters into rates every `period_s` until cancelled (a service's "stats" task)."""
    while True:
        metrics.tick()
        await asyncio.sleep(period_s)
