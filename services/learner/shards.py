"""The buffer shards a learner streams from, and how that set follows the planner's topology.

A learner starts with the command-line list (`--buffer`). Every shard hands on the shard list the
planner set last (ProgressAck.topology, docs/architecture.md "Buffer shards"); a newer one than this
learner holds adds a batch stream and a progress loop for each shard it names that the learner does
not stream from yet, and ends them for each shard it no longer names (the planner removes a shard only
once it is drained: nothing is left there to serve). Draining shards are still named, so a learner
goes on taking what a draining FIFO holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

import grpc

from kuberl.v1 import buffer_pb2, buffer_pb2_grpc
from services.common.stats import Metrics
from services.learner.inbox import Shard

log = logging.getLogger(__name__)


class ShardSet:
    """The shards streamed from now. `open_channel(address)` makes a channel; `start(shard)` starts its
    batch stream and its progress loop and returns the two tasks, so that a removed shard's end."""

    def __init__(self, addresses: list[str], open_channel: Callable[[str], grpc.aio.Channel],
                 start: Callable[[Shard], tuple[asyncio.Task, asyncio.Task]], metrics: Metrics):
        self.open_channel, self.start, self.metrics = open_channel, start, metrics
        self.generation = 0           # of the topology followed (0: the command-line list)
        self.shards: list[Shard] = []
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.tasks: dict[str, tuple[asyncio.Task, asyncio.Task]] = {}   # address -> (fetch, progress)
        self.frozen = False           # shutting down: no shard joins or leaves any more
        self._closing: set[asyncio.Task] = set()
        self._pending = list(addresses)   # opened by `begin`, once tasks may run
        metrics.inc("learner/topology_changes_total", 0)

    def __iter__(self) -> Iterator[Shard]:
        return iter(list(self.shards))

    def __len__(self) -> int:
        return len(self.shards)

    def begin(self) -> None:
        """Open the command-line shards (inside the lifecycle's `running()`)."""
        for i, address in enumerate(self._pending):
            self._add(i, address)
        self._pending = []
        self._gauge()

    def _add(self, index: int, address: str) -> None:
        channel = self.channels[address] = self.open_channel(address)
        shard = Shard(index, address, buffer_pb2_grpc.BufferStub(channel))
        self.shards.append(shard)
        self.tasks[address] = self.start(shard)

    def _remove(self, shard: Shard) -> None:
        self.shards.remove(shard)
        for task in self.tasks.pop(shard.address, ()):
            task.cancel()
        channel = self.channels.pop(shard.address)
        closing = asyncio.ensure_future(channel.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    def update(self, topology: buffer_pb2.BufferTopology) -> bool:
        """Follow `topology` if it is newer than the one followed; returns whether the set changed."""
        if self.frozen or topology.generation <= self.generation or not topology.addresses:
            return False
        self.generation = topology.generation
        wanted = list(topology.addresses)
        before = [s.address for s in self.shards]
        for shard in [s for s in self.shards if s.address not in wanted]:
            log.info("buffer shard %s left the topology (drained): its batch stream ends", shard.address)
            self._remove(shard)
        for i, address in enumerate(wanted):
            if address not in self.tasks:
                log.info("buffer shard %d (%s) joined the topology: streaming from it", i, address)
                self._add(i, address)
        for shard in self.shards:
            shard.index = wanted.index(shard.address)
        self.shards.sort(key=lambda s: s.index)
        self._gauge()
        changed = before != [s.address for s in self.shards]
        if changed:
            self.metrics.inc("learner/topology_changes_total")
        return changed

    def stop_fetching(self) -> None:
        """Shutdown: end every batch stream, and follow no topology any more."""
        self.frozen = True
        for fetch, _ in self.tasks.values():
            fetch.cancel()

    def stop_reporting(self) -> None:
        for _, report in self.tasks.values():
            report.cancel()

    def _gauge(self) -> None:
        self.metrics.set("learner/buffer_shards", len(self.shards))

    async def close(self) -> None:
        for shard in list(self.shards):
            self._remove(shard)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
