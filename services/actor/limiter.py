"""The actor's side of the buffer's rate limiter: hold stepping (or replies to simulators) at the limit.

No gRPC and no asyncio here; `watch_insert_limit` (subscribe.py) feeds it from the buffer's
WatchInsertLimit stream. The buffer says how many samples may have been inserted before actors hold
(services/buffer/limiter.py, docs/rate-limiter.md); this actor adds what it cut that the buffer has
not stored yet (its fragments above the stream's high-water seq), so it never counts its own
fragments in flight as room. It holds before cutting a fragment while
inserted + own unstored >= limit, and goes on as soon as a later limit leaves room.

With no limit known (before the stream's first message, after it broke, or from a buffer that has
no limiter), nothing is held: the push queue's bounds still apply, and what they drop is counted.
`cut` is called by the one thread that cuts fragments (the rollout thread, or the event loop for
sessions); `update`/`clear` by the event loop; `room` and `wait` by the thread that holds.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from services.common.stats import Metrics


class InsertGate:
    def __init__(self, metrics: Metrics):
        """`metrics`: scoped to the policy whose buffer table this gate follows, of a run of several
        (its gauges are then `actor/policies/<policy>/limiter_*`)."""
        self.metrics = metrics
        self._cond = threading.Condition()
        self._limit: int | None = None
        self._inserted = 0
        self._high = -1                               # newest own seq the buffer stored
        self._unstored: deque[tuple[int, int]] = deque()  # (seq, samples) cut and not yet stored
        self._unstored_samples = 0
        self.ratio_target = 0.0
        self.served = 0
        for name in ("actor/limiter_wait_seconds_total", "actor/limiter_waits_total", "actor/limit_stream_errors_total"):
            metrics.inc(name, 0)
        metrics.add_gauges(self.gauges)

    def cut(self, seq: int, samples: int) -> None:
        """A fragment of `samples` was cut under `seq`: it counts against the limit until stored."""
        with self._cond:
            if seq > self._high:
                self._unstored.append((seq, samples))
                self._unstored_samples += samples

    def update(self, limit: int | None, inserted: int, high_water_seq: int | None, served: int = 0,
               ratio_target: float = 0.0) -> None:
        """The buffer's newest InsertLimit (event loop)."""
        with self._cond:
            self._limit, self._inserted, self.served, self.ratio_target = limit, inserted, served, ratio_target
            if high_water_seq is not None:
                self._high = high_water_seq
                while self._unstored and self._unstored[0][0] <= high_water_seq:
                    self._unstored_samples -= self._unstored.popleft()[1]
            self._cond.notify_all()

    def clear(self) -> None:
        """The stream is gone: no limit is known, so nothing is held."""
        with self._cond:
            self._limit = None
            self._cond.notify_all()

    def _room(self) -> bool:
        return self._limit is None or self._inserted + self._unstored_samples < self._limit

    def room(self) -> bool:
        """Whether a fragment may be started now."""
        with self._cond:
            return self._room()

    def wait(self, stop: threading.Event | None = None, poll_s: float = 0.1) -> float:
        """Block the calling thread until there is room (or `stop` is set); the seconds held, counted
        as they pass in `actor/limiter_wait_seconds_total` (the planner reads it at any time)."""
        with self._cond:
            if self._room():
                return 0.0
        self.metrics.inc("actor/limiter_waits_total")
        start = last = time.monotonic()
        while True:
            with self._cond:
                if self._room() or (stop is not None and stop.is_set()):
                    break
                self._cond.wait(timeout=poll_s)
            last = self.held_since(last)
        self.held_since(last)
        return time.monotonic() - start

    def held_since(self, last: float) -> float:
        """Count the time held since `last` (monotonic); returns now. For callers that hold in their
        own way (the event loop polls `room`)."""
        now = time.monotonic()
        seconds = now - last
        self.metrics.inc("actor/limiter_wait_seconds_total", seconds)
        self.metrics.inc("actor/pace_wait_seconds_total", seconds)  # what the planner subtracts
        return now

    def gauges(self) -> dict[str, float]:
        with self._cond:
            out = {self.metrics.scope_name("actor/limiter_unstored_samples"): float(self._unstored_samples)}
            if self._limit is not None:
                out[self.metrics.scope_name("actor/limiter_room_samples")] = float(self._limit - self._inserted - self._unstored_samples)
            return out
