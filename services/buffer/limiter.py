"""The buffer's two-sided rate limiter: what learners may take and what actors may add (docs/rate-limiter.md).

Free of gRPC and asyncio, and of the Store's storage: it reads counts only. Reverb's
`SampleToInsertRatio` is the model; what differs is where each side waits. A learner side that may
not sample is simply not served yet (the Store's `next_batch` returns None, "paced"); an insert side
that may not insert is never refused either: actors learn `insert_limit` (Buffer.WatchInsertLimit)
and hold their stepping, or their replies to simulators, before cutting more.

Replay tables (DQN, SAC), target ratio R samples served per sample inserted, warm-up W
(`learning_starts`), batch B:
- sample side: a batch may be served while served + B <= R x (inserted - W). The warm-up is not
  production: right after it, a learner gets B / R new samples' worth of updates, not R x W.
- insert side: actors may insert while inserted < W + (served + S) / R, where the slack S is what
  keeps both sides busy: every live learner's prefetch queue full (learners x (batch_prefetch + 1)
  batches) plus the largest fragment seen, so an actor can cut its next fragment while the learner
  trains on its last. Whenever the learner is held, served + B > R x (inserted - W), so
  inserted < W + (served + B) / R <= the insert limit: an actor is never held at the same time,
  and the two sides can never wait on each other.
- The ratio held, served / (inserted - W), approaches R from below as S / (inserted - W) shrinks.
  R = 0: neither side is limited.

FIFO tables (PPO), each sample served once: a batch is served once B steps wait (the Store); actors
may insert while the steps waiting, counting batches served that the learners have not yet reported
trained on (prefetched, or in transit), are fewer than one batch plus the largest fragment seen,
plus, for each learner beyond the first, the most it may hold in flight (batch_prefetch + 1 batches:
the Store serves a learner no further ahead). So what is stepped is what is trained: one learner
runs about one batch ahead of the actors (a policy lag of one or two updates); whenever a learner
has no batch, the others' batches in flight leave room, so a group is never left waiting. Nothing is
evicted unless the fleet's fragments in flight alone overflow the FIFO (counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RateLimiter:
    ratio: float        # R: replay's target samples served per sample inserted (0: unpaced); FIFO: unused
    warmup: int         # W: samples inserted before the first batch (replay's learning_starts); FIFO: 0
    batch_size: int     # B: samples per batch a learner asks for
    prefetch: int       # batches a learner holds queued beside the one it trains on (buffer.batch_prefetch)
    fifo: bool = False

    def can_sample(self, inserted: int, served: int, batch_size: int | None = None) -> bool:
        """Replay: whether one more batch keeps served within R x (inserted - W). FIFO: always (the
        Store serves what it holds)."""
        if self.fifo or not self.ratio:
            return True
        b = self.batch_size if batch_size is None else batch_size
        return served + b <= self.ratio * max(0, inserted - self.warmup)

    def slack(self, learners: int, fragment: int) -> int:
        """S, in samples inserted beyond the balance point: see the module docstring."""
        learners = max(1, learners)
        if self.fifo:
            # One batch, and beyond it every other learner's whole allowance in flight (prefetch + 1
            # batches, which the Store caps it at): a learner with no batch is never left waiting for
            # actors that are held for what the others hold (a learner group trains only once every
            # member has a batch).
            return ((learners - 1) * (self.prefetch + 1) + 1) * self.batch_size + fragment
        return math.ceil(learners * (self.prefetch + 1) * self.batch_size / self.ratio) + fragment

    def insert_limit(self, inserted: int, held: int, served: int, learners: int, fragment: int) -> int | None:
        """The count of samples inserted that actors may start a fragment below, or None for no limit.

        `held`: samples waiting to be trained on (FIFO steps, and those in flight to learners; unused
        for replay); `learners`: learners
        live now (at least one is assumed); `fragment`: the largest fragment's samples seen so far."""
        if self.fifo:
            return inserted - held + self.slack(learners, fragment)
        if not self.ratio:
            return None
        return self.warmup + math.ceil(served / self.ratio) + self.slack(learners, fragment)
