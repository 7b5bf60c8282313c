"""A buffer shard's place in the planner's shard list, and its drain: the state that SetTopology,
PushTrajectories and WatchInsertLimit move. Free of gRPC: services/buffer/servicer.py translates those
calls into calls here, and tests/unit/buffer/test_drain.py drives the transitions on their own.

A shard is **active** while it holds no shard list (generation 0) or its index in the newest list is
below that list's `active`. It is **draining** once the planner sets a newer list in which it is past
them: actors hear the list and move away, learners go on streaming what it holds. It is **drained**,
as its next SetTopology finds it, once no actor watches it or pushes to it (none has for DRAIN_QUIET_S),
it holds nothing to serve, and every batch it served a live learner has been reported consumed; the
planner then removes it (services/planner/shards.py). A newer list in which it is active again ends
the drain. Older lists are ignored, so the planner may send the same one again and again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from kuberl.v1 import buffer_pb2

if TYPE_CHECKING:   # (annotations only: what these modules import pulls in gRPC)
    from services.buffer.store import Store
    from services.common.stats import Metrics

log = logging.getLogger(__name__)
# A draining shard is drained only after this long with no fragment received, no push stream open and
# no actor watching: an actor that moved away may still be pushing its last fragments here (it moves
# its insert-limit stream at once, its pusher only once what it queued for this shard is acknowledged).
DRAIN_QUIET_S = 2.0


class ShardDrain:
    """The shard list the planner set (generation 0: none), this shard's index in it, the actors that
    watch it and the push streams open to it, and whether it is draining or drained. `clock`: monotonic
    seconds (default time.monotonic, as read when it is made)."""

    def __init__(self, store: Store, metrics: Metrics, clock: Callable[[], float] | None = None):
        self.store, self.metrics = store, metrics
        self.clock = clock or time.monotonic
        # Actors with an insert-limit stream open (each opens one as it starts and keeps it): the
        # live actors, which an actor without an index counts to pick the least loaded shard.
        self.watching: Counter[str] = Counter()
        metrics.add_gauges(lambda: {"buffer/actors_live": float(self.actors_live)})
        self.topology = buffer_pb2.BufferTopology()
        self.shard: int | None = None
        self.pushing = 0                          # push streams open
        self.last_received = self.clock()
        self.drained_at_generation = 0   # (the generation a drained shard last said so under, logged once)
        metrics.inc("buffer/samples_evicted_on_drain_total", 0)
        metrics.add_gauges(lambda: {"buffer/topology_generation": float(self.topology.generation),
                                    "buffer/draining": float(self.draining)})

    @property
    def draining(self) -> bool:
        """The planner set a topology in which this shard is past the active ones."""
        return self.shard is not None and self.shard >= self.topology.active

    @property
    def actors_live(self) -> int:
        return len(self.watching)

    # -- what the streams report ----------------------------------------------------------------
    def watch_opened(self, actor_id: str) -> None:
        self.watching[actor_id] += 1

    def watch_closed(self, actor_id: str) -> None:
        self.watching[actor_id] -= 1
        if self.watching[actor_id] <= 0:
            del self.watching[actor_id]

    def push_opened(self) -> None:
        self.pushing += 1

    def push_closed(self) -> None:
        """A push stream ended: the quiet a drain waits for starts again from now."""
        self.pushing -= 1
        self.last_received = self.clock()

    # -- what the planner sets and asks ---------------------------------------------------------
    def take(self, topology: buffer_pb2.BufferTopology, shard: int) -> bool:
        """Take `topology` (this shard being `shard` in it) if it is newer than the list held; returns
        whether it was taken. A shard that starts draining waits DRAIN_QUIET_S from now."""
        if topology.generation <= self.topology.generation:
            return False
        was = self.draining
        self.topology.CopyFrom(topology)
        self.shard = shard
        log.info("topology %d: shard %d of %d (%d active)%s", topology.generation, shard, len(topology.addresses),
                 topology.active, ": draining" if self.draining else "")
        if self.draining and not was:
            self.last_received = self.clock()
        return True

    def drained(self) -> bool:
        """(On the store's owner.) Whether a draining shard is done: no actor watches it or pushes to it (none has for
        DRAIN_QUIET_S), it holds nothing to serve, and every batch it served a live learner has been
        reported consumed (one still in a stream's buffers would be lost with the stream). A FIFO drains
        by serving what it holds; a replay's samples are not served out (each would be sampled many
        times more), so they are counted as evicted, buffer/samples_evicted_on_drain_total, and the
        replay is emptied."""
        if self.watching or self.pushing or self.clock() - self.last_received < DRAIN_QUIET_S:
            return False
        if self.store.in_flight_total():
            return False
        if self.store.replay is not None and self.store.size:
            evicted = self.store.evict_all()
            self.metrics.inc("buffer/samples_evicted_on_drain_total", evicted)
            log.info("drained: %d replay samples counted as evicted (buffer/samples_evicted_on_drain_total)", evicted)
        return self.store.size == 0

    def said_drained(self) -> None:
        """This shard answered that it is drained: logged once per generation of the list."""
        if self.drained_at_generation != self.topology.generation:
            self.drained_at_generation = self.topology.generation
            log.info("drained: no actor watches or pushes, nothing left to serve (generation %d)",
                     self.topology.generation)
