"""The buffer shard an actor pushes to, and its move to another when the planner changes the shards.

An actor pushes to one shard at a time, so that shard's dedupe windows, high-water marks and
compact-replay chains see its fragments in order (services/common/net/shards.py). Every shard hands on
the shard list the planner set last (InsertLimit.topology); when a newer one arrives the actor places
itself again:

- with an index (`--actor-index`: a local run's actor-i), on shard `index % active`, like at start;
- without one (a Deployment's pods): it stays unless its shard is draining, or holds more than its
  share of the live actors (more than ceil(live / active)); then it moves to the least loaded active
  shard, with probability (its shard's count - the share) / its shard's count in the second case, so
  that about the excess moves, not every actor of a crowded shard at once. It looks after a random
  delay (up to PLACEMENT_SPREAD_S, so that actors hearing the same list act one after another and see
  each other's moves in the live counts), and again, up to PLACEMENT_ROUNDS times, until its shard
  holds no more than its share.

A move loses nothing and sends nothing twice: fragments cut from then on go to the new shard's pusher,
while the old shard's pusher goes on until everything queued for it is acknowledged (or, at shutdown,
counted as dropped), then closes. The new shard sees this incarnation from its next seq, as a
restarted empty shard would. The insert-limit stream moves at once, so the old shard stops counting
the actor as live.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import zlib
from dataclasses import dataclass, field

import grpc

from kuberl.v1 import buffer_pb2, buffer_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.actor.limiter import InsertGate
from services.actor.push import Pusher
from services.actor.subscribe import watch_insert_limit
from services.common.net.grpcutil import MiB, make_channel
from services.common.net.shards import least_loaded
from services.common.protocol.fragments import EncodedFragment
from services.common.stats import Metrics
from services.config import ExperimentConfig

log = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = 3.0   # a shard that does not say its load by then is left to the hash
PLACEMENT_SPREAD_S = 3.0    # an actor without an index places itself after a random delay up to this
PLACEMENT_ROUNDS = 5        # ... and looks again, as often as this, until its shard holds no more than its share


async def live_actors(addresses: list[str], cfg: ExperimentConfig) -> dict[int, float]:
    """Each shard's `buffer/actors_live`, asked at once with a short timeout; shards that do not answer
    are left out."""
    async def live(i: int, address: str) -> tuple[int, float] | None:
        ch = make_channel(address, 4 * MiB, tls=cfg.tls)
        try:
            resp = await buffer_pb2_grpc.BufferStub(ch).GetStats(pb.GetStatsRequest(), timeout=PLACEMENT_TIMEOUT_S)
            return (i, resp.metrics["buffer/actors_live"]) if "buffer/actors_live" in resp.metrics else None
        except grpc.RpcError as err:
            log.debug("shard %d (%s) did not say its load: %s", i, address, err.code().name)
            return None
        finally:
            await ch.close()

    return dict(a for a in await asyncio.gather(*(live(i, a) for i, a in enumerate(addresses))) if a is not None)


async def least_loaded_shard(addresses: list[str], actor_id: str, cfg: ExperimentConfig) -> int:
    """The shard an actor without an index starts on: the one with the fewest live actors now, ties
    and silence going by the hash of its id (services/common/net/shards.py, `least_loaded`)."""
    counts = await live_actors(addresses, cfg)
    shard = least_loaded(counts, len(addresses), actor_id)
    log.info("shard %d of %d: live actors per shard %s (the fewest; by hash where none answered)", shard,
             len(addresses), {i: int(counts[i]) for i in sorted(counts)} or "unknown")
    return shard


def excess_share(counts: dict[int, float], mine: int, active: int) -> float:
    """The probability that an actor on shard `mine` (counted in `counts`, live actors per active shard)
    moves: the part of its shard's count above ceil(total / active), over that count."""
    here = counts.get(mine, 0.0)
    share = math.ceil(sum(counts.values()) / active) if active else 0
    return max(0.0, here - share) / here if here > 0 else 0.0


@dataclass(eq=False)
class _Link:
    """One shard's channel and the pusher that delivers to it."""
    address: str
    channel: grpc.aio.Channel
    pusher: Pusher
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


class ShardLink:
    def __init__(self, cfg: ExperimentConfig, actor_id: str, incarnation: int, gate: InsertGate, metrics: Metrics,
                 addresses: list[str], shard: int, actor_index: int | None, max_bytes: int, policy: str = ""):
        """`policy`: of several in the run, the one whose table in each shard this link pushes to and
        watches the insert limit of (services/common/net/policy.py)."""
        self.cfg, self.actor_id, self.incarnation, self.gate, self.metrics = cfg, actor_id, incarnation, gate, metrics
        self.policy = policy
        self.actor_index, self.max_bytes = actor_index, max_bytes
        self.generation = 0                          # of the topology followed (0: the command line's)
        self.current = self._link(addresses[shard])
        self.retiring: list[_Link] = []
        self.watch: asyncio.Task | None = None
        self._placing: asyncio.Task | None = None
        self._topology: buffer_pb2.BufferTopology | None = None   # newest, not placed for yet
        self._wake = asyncio.Event()
        self._rng = random.Random(zlib.crc32(actor_id.encode()))
        metrics.set("actor/buffer_shard", shard)
        metrics.inc("actor/shard_moves_total", 0)

    # -- what the actor calls --------------------------------------------------------------------
    def enqueue(self, frag: EncodedFragment) -> None:
        """Queue a fragment for the current shard (event loop)."""
        self.current.pusher.enqueue(frag)

    @property
    def pending(self) -> int:
        return sum(link.pusher.pending for link in self._links())

    def drop_pending(self) -> int:
        return sum(link.pusher.drop_pending() for link in self._links())

    async def run(self, stopping: asyncio.Event) -> None:
        """Push until `stopping` is set and every pusher (the current shard's and any still delivering to
        a shard moved away from) has everything acknowledged; follow the topology meanwhile."""
        self._start(self.current)
        self._watch()
        helpers: set[asyncio.Future] = set()
        try:
            while True:
                if stopping.is_set():
                    self.current.stop.set()
                self._reap()
                if self.current.task.done():
                    self.current.task.result()   # (a pusher that failed ends the actor, as it always did)
                    if not self.retiring:
                        return
                self._wake.clear()
                helpers = {asyncio.ensure_future(self._wake.wait())}
                if not stopping.is_set():   # (once set, waiting on it would return at once, every time)
                    helpers.add(asyncio.ensure_future(stopping.wait()))
                await asyncio.wait({*helpers, *(link.task for link in self._links() if not link.task.done())},
                                   return_when=asyncio.FIRST_COMPLETED)
                for h in helpers:
                    h.cancel()
        finally:
            for h in helpers:
                h.cancel()
            for task in (self.watch, self._placing, *(link.task for link in self._links())):
                if task is not None:
                    task.cancel()

    async def close(self) -> None:
        await asyncio.gather(*(link.channel.close() for link in self._links()), return_exceptions=True)

    # -- links -----------------------------------------------------------------------------------
    def _links(self) -> list[_Link]:
        return [self.current, *self.retiring]

    def _link(self, address: str) -> _Link:
        channel = make_channel(address, self.max_bytes, tls=self.cfg.tls, policy=self.policy or None)
        a = self.cfg.actor
        return _Link(address, channel, Pusher(channel, a.queue_fragments, a.push_ack_interval_s, self.metrics,
                                              max_bytes=int(a.queue_mb * MiB)))

    def _start(self, link: _Link) -> None:
        link.task = asyncio.create_task(link.pusher.run(link.stop), name=f"push {link.address}")

    def _reap(self) -> None:
        """Close the links moved away from whose pushers are done (raising what ended one)."""
        for link in [lk for lk in self.retiring if lk.task.done()]:
            self.retiring.remove(link)
            link.task.result()
            log.info("everything queued for buffer shard %s is acknowledged: its stream is closed", link.address)
            closing = asyncio.ensure_future(link.channel.close())
            closing.add_done_callback(lambda f: f.exception())

    def _watch(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
        stub = buffer_pb2_grpc.BufferStub(self.current.channel)
        self.watch = asyncio.create_task(watch_insert_limit(stub, self.actor_id, self.incarnation, self.gate,
                                                            self.metrics, on_topology=self.on_topology),
                                         name=f"insert-limit {self.current.address} {self.policy}".rstrip())
        self.watch.add_done_callback(self._watch_ended)

    def _watch_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("insert-limit stream task failed: %r", task.exception())

    # -- placement -------------------------------------------------------------------------------
    def on_topology(self, topology: buffer_pb2.BufferTopology) -> None:
        """A shard handed on the planner's shard list (event loop): place this actor again if it is newer."""
        if topology.generation <= self.generation or not 0 < topology.active <= len(topology.addresses):
            return
        self.generation = topology.generation
        self.metrics.set("actor/topology_generation", topology.generation)
        self._topology = topology
        if self._placing is None or self._placing.done():
            self._placing = asyncio.create_task(self._place(), name="shard placement")

    async def _place(self) -> None:
        while (topology := self._topology) is not None:
            self._topology = None
            for _ in range(1 if self.actor_index is not None else PLACEMENT_ROUNDS):
                if self.actor_index is None:
                    await asyncio.sleep(self._rng.uniform(0.0, PLACEMENT_SPREAD_S))
                if self._topology is not None:   # a newer list came meanwhile: place for that one
                    break
                target, settled = await self.target(topology)
                if self._topology is None and target != self.current.address:
                    self._move(target, list(topology.addresses).index(target), len(topology.addresses))
                if settled:
                    break

    async def target(self, topology: buffer_pb2.BufferTopology) -> tuple[str, bool]:
        """The shard this actor belongs on under `topology` (see the module's docstring), and whether
        that is settled (False: look again, the spread is not known to be even yet)."""
        active = list(topology.addresses[:topology.active])
        if self.actor_index is not None:
            return active[self.actor_index % len(active)], True
        here = self.current.address
        mine = active.index(here) if here in active else None
        if mine is not None and len(active) == 1:
            return here, True
        counts = await live_actors(active, self.cfg)
        excess = excess_share(counts, mine, len(active)) if mine is not None else 1.0
        if mine is not None and (excess == 0.0 or self._rng.random() >= excess):
            return here, excess == 0.0
        others = {i: n for i, n in counts.items() if i != mine}
        if not others and mine is not None:
            return here, True
        return active[least_loaded(others, len(active), self.actor_id)], False

    def _move(self, address: str, shard: int, shards: int) -> None:
        old, self.current = self.current, self._link(address)
        self._start(self.current)
        old.stop.set()               # it delivers what it holds, then ends (`_reap` closes it)
        self.retiring.append(old)
        self._watch()
        self.metrics.set("actor/buffer_shard", shard)
        self.metrics.inc("actor/shard_moves_total")
        log.info("moved to buffer shard %d of %d (%s): %d fragments still going to %s", shard, shards, address,
                 old.pusher.pending, old.address)
        self._wake.set()
