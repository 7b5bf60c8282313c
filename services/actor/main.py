"""Actor wiring: config -> envs + policy (rollout.py), or external sessions (sessions.py) -> gRPC server
-> the rollout thread and the push/weights/inference loops (loops.py) -> shutdown."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
import socket
import sys
import uuid
import zlib
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from kuberl.v1 import actor_pb2, learner_pb2_grpc
from services.actor.encoder import FragmentEncoder
from services.actor.inference import BatchedInference
from services.actor.limiter import InsertGate
from services.actor.loops import RolloutWorker
from services.actor.policy import Policy
from services.actor.rollout import Rollout
from services.actor.servicer import ActorServicer
from services.actor.episodes import EpisodeLog
from services.actor.sessions import SessionHub, register_session_metrics
from services.actor.shardlink import ShardLink, least_loaded_shard
from services.actor.subscribe import subscribe_weights
from services.common.protocol.fragments import EncodedFragment, new_incarnation
from services.common.net.grpcutil import MiB, add_servicer, make_channel
from services.common.service.lifecycle import Lifecycle
from services.common.envs import policy_specs
from services.common.net.shards import buffer_addresses, shard_of
from services.common.service.runtime import base_parser, run_service, write_ready_file
from services.common.stats import Metrics
from services.common.net.policy import learner_addresses
from services.config import ConfigError, ExperimentConfig, load_role_config

# The stepping thread is pure Python and would hold the GIL for the default 5 ms at a time,
# starving the event loop that pushes fragments and receives weights; hand it over sooner.
SWITCH_INTERVAL_S = 0.0001

log = logging.getLogger(__name__)
SHUTDOWN_DEADLINE_S = 20.0


async def _watch(worker_done: asyncio.Future[None]) -> None:
    """Re-raise, inside the TaskGroup, whatever ended the rollout thread (a crash ends the process)."""
    await worker_done


def seed_index(actor_id: str, actor_index: int | None) -> int:
    """The index env seeds derive from: as given, else (replicas of a Deployment get no ordinal) a
    stable hash of the unique actor id, so no two replicas step identically seeded envs."""
    return actor_index if actor_index is not None else zlib.crc32(actor_id.encode()) % 100_000


@dataclass
class PolicyParts:
    """The actor's parts for each policy of the run, each dict by the policy's name. Its tag is what its
    gauges' scope, its calls' kuberl-policy metadata, its fragments and its sessions' hellos carry: its name
    where the run trains several (config `policies`: each with its learner and buffer tables), else "" (the
    run's only one)."""
    tags: dict[str, str]
    learners: dict[str, grpc.aio.Channel]   # (weights come over it; in --learner's order)
    gates: dict[str, InsertGate]
    links: dict[str, ShardLink]

    def enqueuer(self, loop: asyncio.AbstractEventLoop) -> Callable[[EncodedFragment], None]:
        """What the rollout's or the sessions' encoder thread hands each fragment to (counted when cut): it
        queues it, on the event loop, on its policy's link."""
        link_of = {self.tags[name]: link for name, link in self.links.items()}   # (a fragment carries its policy's tag)

        def enqueue(frag: EncodedFragment) -> None:
            loop.call_soon_threadsafe(link_of[frag.policy].enqueue, frag)
        return enqueue


def policy_parts(cfg: ExperimentConfig, learner: str, *, actor_id: str, incarnation: int, metrics: Metrics,
                 shards: list[str], shard: int, given_index: int | None, max_bytes: int) -> PolicyParts:
    """Each policy's learner channel, insert gate and shard link (ConfigError for a bad --learner)."""
    names = cfg.policy_names
    try:
        learners = learner_addresses(learner, names)
    except ValueError as err:
        raise ConfigError("--learner", str(err).removeprefix("--learner: ")) from None
    tags = cfg.tags
    learner_chs = {name: make_channel(address, max_bytes, tls=cfg.tls) for name, address in learners.items()}
    # The insert side of the buffer's rate limiter: stepping (or replying to simulators) holds at the
    # buffer's insert limit, counting this actor's own fragments not yet stored (limiter.py); one per
    # policy's table, its gauges (and its link's) scoped to the policy where there are several.
    gates = {name: InsertGate(metrics.scoped(tags[name])) for name in names}
    links = {name: ShardLink(cfg, actor_id, incarnation, gate, metrics.scoped(tags[name]), shards, shard, given_index,
                             max_bytes, policy=tags[name]) for name, gate in gates.items()}
    return PolicyParts(tags, learner_chs, gates, links)


def _enqueue_as(enqueue: Callable[[EncodedFragment], None], tag: str, frag: EncodedFragment) -> None:
    """(The fragment of one of several policies' hubs.)"""
    enqueue(dataclasses.replace(frag, policy=tag))


@dataclass
class Sources:
    """Where the actor's fragments come from: external simulators' sessions (`seats`: each policy's
    SessionHub and its BatchedInference, by tag: a hello names its policy's), or local envs (`rollout`);
    the policies that act, by name, and the episode log, either way."""
    policies: dict[str, Policy]
    episodes: EpisodeLog
    seats: dict[str, BatchedInference]
    rollout: Rollout | None


def open_sources(cfg: ExperimentConfig, parts: PolicyParts, enqueue: Callable[[EncodedFragment], None], *,
                 actor_id: str, actor_index: int, incarnation: int, metrics: Metrics) -> Sources:
    """Sessions where `env.mode` is external (simulators connect over EnvSession and step themselves),
    else the local envs' Rollout (stepped on the thread `rollout_thread` makes)."""
    if cfg.env.mode != "external":
        # Envs are created before any channel is used (fork safety for subprocess envs).
        rollout = Rollout(cfg, actor_id, actor_index, metrics, incarnation=incarnation, gates=parts.gates)
        return Sources(rollout.policies, rollout.episodes, {}, rollout)
    episodes = EpisodeLog(metrics)
    specs = policy_specs(cfg)
    # Fragments are cut on the event loop and encoded off it, in seq order, on the encoder's thread.
    encoder = FragmentEncoder(metrics=metrics)
    policies, seats = {}, {}
    for k, (name, gate) in enumerate(parts.gates.items()):   # a hub per policy, with its spaces
        tag, scoped = parts.tags[name], metrics.scoped(parts.tags[name])
        policy = policies[name] = Policy(cfg, specs[name], cfg.env.seed + 1000 * actor_index + k, metrics, name=tag)
        hub = SessionHub(cfg, policy.spec, actor_id, scoped, incarnation=incarnation, on_cut=gate.cut,
                         on_fragment=enqueue if not tag else functools.partial(_enqueue_as, enqueue, tag),
                         encoder=encoder, state_size=policy.state_size, policy=tag, episodes=episodes)
        seats[tag] = BatchedInference(policy, hub, scoped, gate=gate)
    return Sources(policies, episodes, seats, None)


def rollout_thread(loop: asyncio.AbstractEventLoop, rollout: Rollout | None, enqueue: Callable[[EncodedFragment], None]
                   ) -> tuple[RolloutWorker | None, asyncio.Future[None]]:
    """The rollout thread (loops.py; not started), and the future that settles, on the event loop, with
    how it ended; with no rollout (sessions), no thread, and the future settled at once."""
    worker_done: asyncio.Future[None] = loop.create_future()

    def done(exc: BaseException | None) -> None:
        def settle() -> None:
            if not worker_done.done():
                worker_done.set_exception(exc) if exc else worker_done.set_result(None)
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is already closed: the process is exiting anyway
            pass

    if rollout is None:
        done(None)  # no rollout thread to watch
        return None, worker_done
    # Fragments come serialized from the rollout thread; the event loop only writes bytes.
    return RolloutWorker(rollout, enqueue, done), worker_done


@dataclass
class Shutdown:
    """The actor's own shutdown steps, given to its Lifecycle in this order: `stop_stepping`, `drain`,
    then (after the server stops) `stopped`."""
    actor_id: str
    metrics: Metrics
    parts: PolicyParts
    seats: dict[str, BatchedInference]
    worker: RolloutWorker | None
    watch: asyncio.Task[None]
    pushes: list[asyncio.Task[None]]
    stopping: asyncio.Event

    async def stop_stepping(self) -> None:
        """Stop stepping (a hold on the limiter ends too) and flush the partial fragment into the
        queue; sessions: refuse new ones, flush every open one's fragment."""
        if self.worker is not None:
            self.worker.stop_event.set()
            for each in self.parts.gates.values():
                each.clear()
        await self.watch
        for seat in self.seats.values():
            seat.hub.close_all()
        await asyncio.sleep(0)   # (let the enqueue callbacks run)

    async def drain(self) -> None:
        """Push what is queued and get it acked; what the buffer cannot take in time is counted dropped.
        The sessions' fragments still being encoded are waited for first: the encoder hands each to the
        loop before the flush returns, so all of them are queued by the time this goes on."""
        for seat in self.seats.values():
            await asyncio.to_thread(seat.hub.flush)
        self.stopping.set()
        try:
            async with asyncio.timeout(SHUTDOWN_DEADLINE_S / 2):
                # (every link's push is waited for, whichever ends first or fails: a failure is raised after)
                for ended in await asyncio.shield(asyncio.gather(*self.pushes, return_exceptions=True)):
                    if isinstance(ended, BaseException):
                        raise ended
        except TimeoutError:
            for push in self.pushes:
                push.cancel()
            log.warning("buffer unreachable at shutdown: %d fragments not delivered (counted as dropped)",
                        sum(each.drop_pending() for each in self.parts.links.values()))

    def stopped(self) -> None:
        c = self.metrics.counters
        log.info("actor %s stopped: %d fragments cut, %d acknowledged, %d dropped, %d rejected",
                 self.actor_id, c["actor/fragments_total"], c["actor/fragments_acked_total"],
                 c["actor/fragments_dropped_total"], c["actor/fragments_rejected_total"])


def start_tasks(lc: Lifecycle, parts: PolicyParts, sources: Sources, worker: RolloutWorker | None,
                worker_done: asyncio.Future[None], *, actor_id: str, metrics: Metrics) -> Shutdown:
    """Start the actor's loops (loops.py) inside `lc.running()`: each policy's push, weights and (sessions)
    inference tasks, the rollout thread and the task that watches it; the steps that stop them."""
    stopping = asyncio.Event()
    pushes = [lc.task(each.run(stopping), f"push {parts.tags[name]}".rstrip(), keep=True)   # (with the insert-limit stream)
              for name, each in parts.links.items()]
    for name, ch in parts.learners.items():
        lc.task(subscribe_weights(learner_pb2_grpc.LearnerStub(ch), actor_id, sources.policies[name], metrics),
                f"weights {parts.tags[name]}".rstrip())
    for tag, seat in sources.seats.items():
        lc.task(seat.run(), f"inference {tag}".rstrip())
    watch = lc.task(_watch(worker_done), "rollout-watch", keep=True)
    if worker is not None:
        worker.start()
    return Shutdown(actor_id, metrics, parts, sources.seats, worker, watch, pushes, stopping)


@asynccontextmanager
async def serving(cfg: ExperimentConfig, *, listen: str, metrics_listen: str | None = None, buffer: str, learner: str,
                  actor_id: str | None = None, actor_index: int | None = None):
    """Start an actor; yields its Endpoints. Leaving the context runs the shutdown sequence."""
    actor_id = actor_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    given_index, actor_index = actor_index, seed_index(actor_id, actor_index)
    incarnation = new_incarnation()  # this process's: a restart under the same actor_id never collides
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    metrics = Metrics("actor", instance_id=actor_id)
    loop = asyncio.get_running_loop()
    external = cfg.env.mode == "external"
    max_bytes = cfg.buffer.max_message_mb * MiB
    # Buffer shards: this actor pushes to one at a time (dedupe and high-water marks are per shard), and
    # moves when the planner changes the shards (shardlink.py).
    shards = buffer_addresses(buffer)
    shard = (shard_of(actor_id, len(shards), given_index) if given_index is not None or len(shards) == 1
             else await least_loaded_shard(shards, actor_id, cfg))
    register_session_metrics(metrics)   # 0 sessions where no simulator connects
    parts = policy_parts(cfg, learner, actor_id=actor_id, incarnation=incarnation, metrics=metrics, shards=shards,
                         shard=shard, given_index=given_index, max_bytes=max_bytes)
    enqueue = parts.enqueuer(loop)
    sources = open_sources(cfg, parts, enqueue, actor_id=actor_id, actor_index=actor_index, incarnation=incarnation,
                           metrics=metrics)
    servicer = ActorServicer(metrics, sources.episodes, sources.seats, cfg.actor.session_timeout_s)
    lc = Lifecycle("actor", metrics, deadline_s=SHUTDOWN_DEADLINE_S)
    rollout = sources.rollout
    lc.on_close(rollout.close if rollout is not None else lambda: None)   # release envs
    for ch in parts.learners.values():
        lc.on_close(ch.close)
    for each in parts.links.values():
        lc.on_close(each.close)
    service = actor_pb2.DESCRIPTOR.services_by_name["Actor"]
    await lc.serve(listen, lambda s: add_servicer(s, service, servicer), [service.full_name], max_message_bytes=max_bytes,
                   metrics_listen=metrics_listen, max_connection_age_s=None,   # simulator sessions are long-lived
                   tls=cfg.tls, auth=cfg.auth)
    worker, worker_done = rollout_thread(loop, rollout, enqueue)
    log.info("actor %s (incarnation %016x): %s, %s, %s, buffer %s (shard %d of %d), learner %s", actor_id, incarnation,
             cfg.env.id, "external simulators" if external else f"{cfg.env.num_envs} local envs", cfg.algorithm,
             shards[shard], shard, len(shards), learner)
    async with lc.running():
        shutdown = start_tasks(lc, parts, sources, worker, worker_done, actor_id=actor_id, metrics=metrics)
        lc.on_stop(shutdown.stop_stepping)
        lc.on_stop(shutdown.drain)
        lc.on_stop(lc.stop_server(grace=1.0))   # stop serving stats and sessions (the other tasks end after)
        lc.on_stop(shutdown.stopped)
        await lc.ready()
        yield lc.endpoints


def parse_args(argv=None) -> argparse.Namespace:
    p = base_parser("actor", 50053, "Steps environments and pushes trajectory fragments to a buffer.")
    p.add_argument("--buffer", default=os.environ.get("KUBERL_BUFFER", "127.0.0.1:50051"),
                   help="buffer address host:port, or one per buffer shard separated by commas: this actor pushes "
                        "to one of them, picked by its --actor-index, else a hash of its id "
                        "(default $KUBERL_BUFFER or 127.0.0.1:50051)")
    p.add_argument("--learner", default=os.environ.get("KUBERL_LEARNER", "127.0.0.1:50052"),
                   help="learner address host:port; where the run trains several policies (config `policies`), "
                        "policy=host:port for each, separated by commas (default $KUBERL_LEARNER or 127.0.0.1:50052)")
    p.add_argument("--actor-id", default=None, help="unique actor id (default: host-pid-random)")
    p.add_argument("--actor-index", type=int, default=None,
                   help="index used to derive env seeds (seed + 1000 * index; default: from a hash of the actor id, "
                        "so replicas of a Deployment step differently seeded envs)")
    args = p.parse_args(argv)
    try:
        buffer_addresses(args.buffer)
    except ValueError as err:
        p.error(str(err))
    return args


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    cfg = load_role_config(args)
    async with serving(cfg, listen=args.listen, metrics_listen=args.metrics_listen or None, buffer=args.buffer,
                       learner=args.learner, actor_id=args.actor_id, actor_index=args.actor_index) as endpoints:
        write_ready_file(args.ready_file, endpoints)
        log.info("actor serving gRPC on %s, metrics on %s", endpoints.grpc, endpoints.metrics)
        await stop.wait()


def main(argv=None) -> int:
    return run_service("actor", parse_args(argv), serve)
