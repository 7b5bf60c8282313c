"""Per-replica rates the planner decides on (docs/architecture.md section 4).

TR_A, what an actor can produce when it is not held: `actor/env_steps_total` over wall time minus
`actor/pace_wait_seconds_total` (the rate limiter and on-policy pacing hold an actor that outruns the
learner; counted as production time, those waits would make the planner add actors the learner cannot
feed), and TR_L, what a learner can consume when it never waits for data: `learner/samples_total`
over wall time minus `learner/starved_seconds_total` (so publishing weights and sharing the CPU count
against it, waiting for batches does not). Both are EWMAs per replica, counted only after the replica
has reported for `warmup_s`; the role's rate is the mean over its warmed-up, fresh replicas.
"""

from __future__ import annotations

import math


STARVED_SHARE = 0.05   # a learner busy less than this share of an interval is measured by a lower bound


class ReplicaRate:
    """EWMA rate of one replica from its monotonic counters (and, for learners, its starved seconds)."""

    def __init__(self, halflife_s: float, warmup_s: float, now: float):
        self.halflife_s, self.warmup_s = halflife_s, warmup_s
        self.first_progress: float | None = None
        self.last_ok: float | None = None
        self.created = now
        self.warm = False
        self.rate: float | None = None
        self.policy_lag: float | None = None  # learners: recent mean policy lag of consumed samples
        self.cores: float | None = None       # EWMA CPU cores the replica's process uses (its measured cost)
        self._last: tuple[float, float, float | None, float | None] | None = None

    def update(self, now: float, count: float, starved: float | None, cpu_s: float | None = None) -> None:
        self.last_ok = now
        last, self._last = self._last, (now, count, starved, cpu_s)
        if last is None:
            return
        t0, c0, b0, cpu0 = last
        if count < c0 or (cpu_s is not None and cpu0 is not None and cpu_s < cpu0):
            # the process restarted under the same name: start over
            self.rate, self.warm, self.first_progress, self.cores = None, False, None, None
            return
        if count > c0 and self.first_progress is None:
            self.first_progress = now  # warm-up runs from the first work done, not from start-up
        if self.first_progress is None:
            return
        if not self.warm:
            if now - self.first_progress < self.warmup_s:
                return
            self.warm, self.rate = True, None   # what was measured while warming up does not count
        dt = now - t0
        if dt <= 0:
            return
        alpha = 1.0 - math.exp(-dt * math.log(2) / self.halflife_s)
        if cpu_s is not None and cpu0 is not None:
            cores = (cpu_s - cpu0) / dt
            self.cores = cores if self.cores is None else self.cores + alpha * (cores - self.cores)
        # Starved seconds are counted as they pass (services/learner/inbox.py: starved_get), so an interval's share
        # is within [0, dt] up to one tick; clamp, so a late count never reads as more than all of it.
        denom = dt if starved is None else dt - min(max(starved - (b0 or 0.0), 0.0), dt)
        if denom <= STARVED_SHARE * dt:
            # A learner starved nearly all this interval says little about its capacity, except that it
            # is at least what it trained over the most it can have been busy. That bound only ever
            # raises the estimate: without it, a learner starved from its start (too few actors, the
            # case that most needs a scale-up) would never get a rate and the planner never act.
            bound = (count - c0) / (STARVED_SHARE * dt)
            if bound > 0 and (self.rate is None or bound > self.rate):
                self.rate = bound
            return
        inst = (count - c0) / denom
        self.rate = inst if self.rate is None else self.rate + alpha * (inst - self.rate)

    def usable(self, now: float, stale_after_s: float) -> bool:
        return self.warm and self.rate is not None and self.last_ok is not None and now - self.last_ok <= stale_after_s

    def stale(self, now: float, stale_after_s: float) -> bool:
        seen = self.last_ok if self.last_ok is not None else self.created
        return now - seen > stale_after_s


class CounterRate:
    """EWMA per-second rate of one monotonic counter (an actor's dropped samples, a buffer's CPU
    seconds); a counter that goes down (a restart) starts over."""

    def __init__(self, halflife_s: float):
        self.halflife_s = halflife_s
        self.rate: float | None = None
        self.recent: float | None = None   # the rate over the last interval alone (0 means none at all)
        self.seen: float | None = None
        self._last: tuple[float, float] | None = None

    def update(self, now: float, count: float) -> None:
        last, self._last, self.seen = self._last, (now, count), now
        if last is None:
            return
        t0, c0 = last
        if count < c0:
            self.rate = self.recent = None
            return
        dt = now - t0
        if dt <= 0:
            return
        inst = self.recent = (count - c0) / dt
        alpha = 1.0 - math.exp(-dt * math.log(2) / self.halflife_s)
        self.rate = inst if self.rate is None else self.rate + alpha * (inst - self.rate)

    def fresh(self, now: float, stale_after_s: float, recent: bool = False) -> float | None:
        """The EWMA rate (`recent`: the last interval's), or None when unknown or not updated within
        `stale_after_s`."""
        if self.seen is None or now - self.seen > stale_after_s:
            return None
        return self.recent if recent else self.rate
