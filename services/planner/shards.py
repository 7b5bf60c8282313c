"""The planner's buffer shards: it tells every shard the shard list, adds shards and drains them.

The shard list (`BufferTopology`: addresses in shard order, how many are active, a generation that
only grows) is the planner's. It sends it to every shard with SetTopology when it changes and again at
every measurement, so a restarted shard learns it back within a second; shards hand it on to actors
(InsertLimit.topology) and learners (ProgressAck.topology), which follow it
(services/actor/shardlink.py, services/learner/shards.py).

One change at a time, and each in steps:

- **adding** shard N: the backend starts it; once it serves, the list gains it as active: learners
  stream from it, actors place themselves again (an indexed actor on `index % (N + 1)`);
- **draining** the last shard: the list keeps it but counts it out of `active`: its actors move to the
  active shards, learners go on taking what a FIFO still holds; a replay's samples are counted as
  evicted (buffer/samples_evicted_on_drain_total). Once the shard says it is drained (no actor watches
  or pushes to it, nothing to serve), the backend stops it and the list drops it.

`decide_shards` says when: a communication-bound run (services/planner/decide.py: a shard's process
busy, actors' send queues backing up or dropping) gets one more shard, up to `planner.buffer.max`;
shards that all idle (each under BUFFER_IDLE_CORES, and together few enough for one fewer) for
`planner.scale_down_window_s` lose one, down to `planner.buffer.min`. Unset `planner.buffer`: the
count stays `topology.buffers`, though the list is still published. The local backend starts and
stops shard processes; the Kubernetes backend scales the buffer StatefulSet when
`planner.kubernetes.buffer_address` names the shards (the chart sets it with `planner.buffer`); with
any other backend nothing is published and the command-line lists stand.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from kuberl.v1 import buffer_pb2
from services.common.net.tls import TlsError
from services.common.net.tokens import AuthError
from services.common.stats import Metrics
from services.config import ExperimentConfig
from services.planner.backend import Backend, Refused
from services.planner.balance import BUFFER_BUSY_CORES
from services.planner.observe import GrpcStats

log = logging.getLogger(__name__)
BUFFER_IDLE_CORES = 0.3        # a shard's process under this has room for another's actors
SET_TOPOLOGY_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ShardDecision:
    current: int     # active shards now
    target: int      # what the decision sets (== current: no change)
    reason: str


def shard_bounds(cfg: ExperimentConfig) -> tuple[int, int]:
    """planner.buffer.min..max, or topology.buffers..topology.buffers when unset (no scaling)."""
    b = cfg.planner.buffer
    return (b.min, b.max) if b is not None else (cfg.topology.buffers, cfg.topology.buffers)


def decide_shards(current: int, bounds: tuple[int, int], *, bottleneck: str, evidence: str,
                  buffer_cores: dict[str, float], idle_for_s: float, window_s: float, busy: str = "",
                  override: int | None = None) -> ShardDecision:
    """One step towards the shard count the run needs (see the module's docstring). `buffer_cores`: each
    active shard's measured CPU cores (fresh ones only); `idle_for_s`: how long every shard has idled."""
    lo, hi = bounds
    if busy:
        return ShardDecision(current, current, busy)
    if override is not None:
        target = current + (override > current) - (override < current)
        return ShardDecision(current, target, f"manual override: buffer shards held at {override}"
                             + (f", {'adding' if target > current else 'draining'} one" if target != current else ""))
    if bottleneck == "communication":
        if current < hi:
            return ShardDecision(current, current + 1, f"communication-bound ({evidence}): adding buffer shard "
                                                       f"{current} (planner.buffer.max {hi})")
        return ShardDecision(current, current, f"communication-bound ({evidence}), but buffer shards are at "
                                               f"planner.buffer.max ({hi})")
    if current > lo and len(buffer_cores) >= current:
        total = sum(buffer_cores.values())
        if max(buffer_cores.values()) < BUFFER_IDLE_CORES and total < BUFFER_BUSY_CORES / 2 * (current - 1):
            if idle_for_s >= window_s:
                return ShardDecision(current, current - 1,
                                     f"every buffer shard idles (busiest {max(buffer_cores.values()):.2f} cores, "
                                     f"{total:.2f} in all, for {idle_for_s:.0f} s): draining shard {current - 1}")
            return ShardDecision(current, current, f"buffer shards idle for {idle_for_s:.0f} s of the "
                                                   f"{window_s:.0f} s before one is drained")
    return ShardDecision(current, current, "")


SendTopology = Callable[[int, str, buffer_pb2.SetTopologyRequest], Awaitable[buffer_pb2.TopologyAck | None]]


class ShardKeeper:
    """Holds the shard list, publishes it, and carries a change through (adding, draining). `send`:
    how SetTopology reaches shard i at an address (default over gRPC; tests hand in their own)."""

    def __init__(self, cfg: ExperimentConfig, backend: Backend, metrics: Metrics, clock=time.monotonic,
                 wall=time.time, send: SendTopology | None = None):
        self.cfg, self.backend, self.metrics, self.clock, self.wall = cfg, backend, metrics, clock, wall
        self.send = send or self._send
        self.addresses: list[str] = []
        self.active = 0
        self.generation = 0
        self.adding: tuple[str, float] | None = None     # (address started, when)
        self.removing: tuple[str, float] | None = None   # (address draining, when)
        self.acks: dict[str, buffer_pb2.TopologyAck] = {}
        self.grpc = GrpcStats(cfg, metrics)   # (its channels, with this planner's TLS and token)
        self.idle_since: float | None = None
        self.changed_at: float | None = None            # when the last add or drain completed
        for name in ("topology_errors", "buffer_shards_added", "buffer_shards_drained"):
            metrics.inc(f"planner/{name}_total", 0)

    @property
    def scales(self) -> bool:
        """Whether the backend starts and stops shards (`scales_buffers`, with buffer_list, add_buffer and
        remove_buffer)."""
        return bool(getattr(self.backend, "scales_buffers", False))

    @property
    def started(self) -> bool:
        return bool(self.addresses)

    async def start(self) -> None:
        """Take the backend's shards as the first list and publish it. Only a backend that starts and
        stops shards publishes one, and it lists them by the addresses actors and learners were given
        (a Kubernetes backend without `buffer_address` knows only pod IPs: a list of those would move
        every actor and learner off the DNS names they use)."""
        if not self.scales:
            return
        self.addresses = await self.backend.buffer_list()
        self.active = len(self.addresses)
        await self._resume()
        self._bump()
        await self.publish()

    async def _resume(self) -> None:
        """A planner restarted mid-drain takes the drain back up: it reads the list the shards hold (a
        SetTopology of generation 0 changes nothing) and, where the newest one drains shards the backend
        still runs, keeps them draining instead of making them active again. Its generation starts past
        the newest one held."""
        ask = buffer_pb2.BufferTopology(generation=0, addresses=self.addresses, active=self.active)
        acks = await asyncio.gather(*(self.send(i, a, buffer_pb2.SetTopologyRequest(topology=ask, shard=i))
                                      for i, a in enumerate(self.addresses)))
        held = max((a.topology for a in acks if a is not None and a.topology.generation),
                   key=lambda t: t.generation, default=None)
        if held is None:
            return
        self.generation = max(self.generation, held.generation)
        # The shards the held list has active, in its order, then the rest the backend runs (a shard
        # added after it was published, or one being drained): those past `active` go on draining.
        active = [a for a in held.addresses[:held.active] if a in self.addresses]
        if not active or len(active) == len(self.addresses):
            return
        rest = [a for a in self.addresses if a not in active]
        draining = [a for a in rest if a in held.addresses[held.active:]]
        self.addresses = active + [a for a in rest if a not in draining] + draining
        self.active = len(self.addresses) - len(draining)
        if draining:
            self.removing = (self.addresses[self.active], self.clock())
            log.info("resuming the drain of buffer shard %d (%s) from generation %d", self.active,
                     self.removing[0], held.generation)

    def _bump(self) -> None:
        self.generation = max(self.generation + 1, int(self.wall() * 1000))
        if callable(follow := getattr(self.backend, "follow_topology", None)):
            follow(self.addresses[:self.active])
        self.metrics.set("planner/buffer_shards", self.active)
        self.metrics.set("planner/buffer_topology_generation", self.generation)

    def topology(self) -> buffer_pb2.BufferTopology:
        return buffer_pb2.BufferTopology(generation=self.generation, addresses=self.addresses, active=self.active)

    def busy(self) -> str:
        """A change in flight, in words ("" when none)."""
        now = self.clock()
        if self.adding is not None:
            return f"adding buffer shard {self.active} ({self.adding[0]}): not serving yet after {now - self.adding[1]:.0f} s"
        if self.removing is not None:
            ack = self.acks.get(self.removing[0])
            left = (f": {ack.actors_live} actors still on it, {ack.size_samples} samples held" if ack is not None
                    else ": it has not answered")
            return f"draining buffer shard {self.active} ({self.removing[0]}) for {now - self.removing[1]:.0f} s{left}"
        return ""

    def watch_idle(self, buffer_cores: dict[str, float]) -> float:
        """How long every shard has idled (0 while one is busy or a shard's CPU is unknown)."""
        now = self.clock()
        idle = (len(buffer_cores) >= self.active
                and max(buffer_cores.values(), default=1.0) < BUFFER_IDLE_CORES)
        if not idle or self.busy():
            self.idle_since = None
            return 0.0
        if self.idle_since is None:
            self.idle_since = now
        return now - self.idle_since

    async def scale_to(self, n: int) -> None:
        """Start one step towards `n` active shards (an add or a drain); the later steps happen in `sync`."""
        if n > self.active:
            if not self.scales:
                raise Refused(f"the {self.backend.name} backend does not start buffer shards")
            address = await self.backend.add_buffer()
            self.adding = (address, self.clock())
            self.metrics.inc("planner/buffer_shards_added_total")
            log.info("adding buffer shard %d at %s", self.active, address)
        elif n < self.active:
            if not self.scales:
                raise Refused(f"the {self.backend.name} backend does not stop buffer shards")
            self.active -= 1
            self.removing = (self.addresses[self.active], self.clock())
            self._bump()
            log.info("draining buffer shard %d (%s)", self.active, self.removing[0])
            await self.publish()

    async def sync(self) -> None:
        """At every measurement: carry a change on, then publish the list to every shard."""
        if not self.started:
            await self.start()
            return
        if self.adding is not None:
            address = self.adding[0]
            ready = {b.address for b in await self.backend.buffers() if b.ready}
            if address in ready:
                self.addresses.insert(self.active, address)
                self.active += 1
                self.adding = None
                self.changed_at = self.clock()
                self._bump()
                log.info("buffer shard %d serves at %s: in the shard list (generation %d)", self.active - 1,
                         address, self.generation)
        if self.removing is not None and (ack := self.acks.get(self.removing[0])) is not None and ack.drained:
            address = self.removing[0]
            await self.backend.remove_buffer(address)
            self.addresses.remove(address)
            self.removing = None
            self.changed_at = self.clock()
            self.acks.pop(address, None)
            await self.grpc.forget(set(self.addresses))
            self._bump()
            self.metrics.inc("planner/buffer_shards_drained_total")
            log.info("buffer shard %s drained and stopped: %d shards (generation %d)", address, self.active,
                     self.generation)
            if len(self.addresses) > self.active:   # a resumed list that drains more than one: the next
                self.removing = (self.addresses[self.active], self.clock())
                log.info("draining buffer shard %d (%s) next", self.active, self.removing[0])
        await self.publish()

    async def publish(self) -> None:
        """SetTopology to every shard at once; a shard that does not answer is counted and tried next time."""
        topology = self.topology()

        async def send(i: int, address: str) -> None:
            ack = await self.send(i, address, buffer_pb2.SetTopologyRequest(topology=topology, shard=i))
            if ack is None:
                self.metrics.inc("planner/topology_errors_total")
            else:
                self.acks[address] = ack

        await asyncio.gather(*(send(i, a) for i, a in enumerate(self.addresses)))

    async def _send(self, i: int, address: str, request: buffer_pb2.SetTopologyRequest) -> buffer_pb2.TopologyAck | None:
        try:
            return await self.grpc.stub("buffer", address).SetTopology(
                request, timeout=SET_TOPOLOGY_TIMEOUT_S, metadata=self.grpc.metadata())
        except grpc.RpcError as err:
            log.debug("SetTopology to shard %d (%s) failed: %s", i, address, err.code().name)
        except (AuthError, TlsError) as err:
            log.warning("SetTopology to shard %d (%s) not sent: %s", i, address, err)
        return None

    async def close(self) -> None:
        await self.grpc.close()
