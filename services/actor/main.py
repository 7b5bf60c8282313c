"""Actor wiring: config -> envs + policy (rollout.py), or external sessions (sessions.py) -> gRPC server
-> push/weights/inference loops -> shutdown."""

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
from contextlib import asynccontextmanager


from kuberl.v1 import actor_pb2, learner_pb2_grpc
from services.actor.encoder import FragmentEncoder
from services.actor.inference import BatchedInference
from services.actor.limiter import InsertGate
from services.actor.policy import Policy
from services.actor.rollout import Rollout, RolloutWorker
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


async def _watch(worker_done: asyncio.Future) -> None:
    """Re-raise, inside the TaskGroup, whatever ended the rollout thread (a crash ends the process)."""
    await worker_done


def seed_index(actor_id: str, actor_index: int | None) -> int:
    """The index env seeds derive from: as given, else (replicas of a Deployment get no ordinal) a
    stable hash of the unique actor id, so no two replicas step identically seeded envs."""
    return actor_index if actor_index is not None else zlib.crc32(actor_id.encode()) % 100_000


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
    names = cfg.policy_names
    try:
        learners = learner_addresses(learner, names)
    except ValueError as err:
        raise ConfigError("--learner", str(err).removeprefix("--learner: ")) from None
    # Each policy's parts by its name. Its tag is what its gauges' scope, its calls' kuberl-policy metadata,
    # its fragments and its sessions' hellos carry: its name where the run trains several (config
    # `policies`: each with its learner and buffer tables), else "" (the run's only one).
    tags = {name: name if len(names) > 1 else "" for name in names}
    learner_chs = {name: make_channel(address, max_bytes, tls=cfg.tls) for name, address in learners.items()}
    # The insert side of the buffer's rate limiter: stepping (or replying to simulators) holds at the
    # buffer's insert limit, counting this actor's own fragments not yet stored (limiter.py); one per
    # policy's table, its gauges (and its link's) scoped to the policy where there are several.
    gates = {name: InsertGate(metrics.scoped(tags[name])) for name in names}
    links = {name: ShardLink(cfg, actor_id, incarnation, gate, metrics.scoped(tags[name]), shards, shard, given_index,
                             max_bytes, policy=tags[name]) for name, gate in gates.items()}
    link_of = {tags[name]: link for name, link in links.items()}   # (a fragment carries its policy's tag)

    def enqueue(frag: EncodedFragment) -> None:  # the rollout's or the sessions' encoder thread (counted when cut)
        loop.call_soon_threadsafe(link_of[frag.policy].enqueue, frag)

    def enqueue_as(tag: str, frag: EncodedFragment) -> None:   # (the fragment of one of several policies' hubs)
        enqueue(dataclasses.replace(frag, policy=tag))

    rollout = worker = None
    seats: dict[str, BatchedInference] = {}   # (by tag: a hello names its policy's)
    if external:  # simulators connect over EnvSession and step themselves
        episodes = EpisodeLog(metrics)
        specs = policy_specs(cfg)
        # Fragments are cut on the event loop and encoded off it, in seq order, on the encoder's thread.
        encoder = FragmentEncoder(metrics=metrics)
        policies = {}
        for k, (name, gate) in enumerate(gates.items()):   # a hub per policy, with its spaces
            tag, scoped = tags[name], metrics.scoped(tags[name])
            policy = policies[name] = Policy(cfg, specs[name], cfg.env.seed + 1000 * actor_index + k, metrics, name=tag)
            hub = SessionHub(cfg, policy.spec, actor_id, scoped, incarnation=incarnation, on_cut=gate.cut,
                             on_fragment=enqueue if not tag else functools.partial(enqueue_as, tag),
                             encoder=encoder, state_size=policy.state_size, policy=tag, episodes=episodes)
            seats[tag] = BatchedInference(policy, hub, scoped, gate=gate)
    else:
        # Envs are created before any channel is used (fork safety for subprocess envs).
        rollout = Rollout(cfg, actor_id, actor_index, metrics, incarnation=incarnation, gate=gates)
        episodes, policies = rollout.episodes, rollout.policies
    servicer = ActorServicer(metrics, episodes, seats, cfg.actor.session_timeout_s)
    lc = Lifecycle("actor", metrics, deadline_s=SHUTDOWN_DEADLINE_S)
    lc.on_close(rollout.close if rollout is not None else lambda: None)   # release envs
    for ch in learner_chs.values():
        lc.on_close(ch.close)
    for each in links.values():
        lc.on_close(each.close)
    service = actor_pb2.DESCRIPTOR.services_by_name["Actor"]
    await lc.serve(listen, lambda s: add_servicer(s, service, servicer), [service.full_name], max_message_bytes=max_bytes,
                   metrics_listen=metrics_listen, max_connection_age_s=None,   # simulator sessions are long-lived
                   tls=cfg.tls, auth=cfg.auth)
    worker_done: asyncio.Future = loop.create_future()

    def done(exc):
        def settle():
            if not worker_done.done():
                worker_done.set_exception(exc) if exc else worker_done.set_result(None)
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is already closed: the process is exiting anyway
            pass

    if rollout is not None:
        # Fragments come serialized from the rollout thread; the event loop only writes bytes.
        worker = RolloutWorker(rollout, enqueue, done)
    else:
        done(None)  # no rollout thread to watch
    stopping = asyncio.Event()
    log.info("actor %s (incarnation %016x): %s, %s, %s, buffer %s (shard %d of %d), learner %s", actor_id, incarnation,
             cfg.env.id, "external simulators" if external else f"{cfg.env.num_envs} local envs", cfg.algorithm,
             shards[shard], shard, len(shards), learner)
    async with lc.running():
        pushes = [lc.task(each.run(stopping), f"push {tags[name]}".rstrip(), keep=True)   # (with the insert-limit stream)
                  for name, each in links.items()]
        for name, ch in learner_chs.items():
            lc.task(subscribe_weights(learner_pb2_grpc.LearnerStub(ch), actor_id, policies[name], metrics),
                    f"weights {tags[name]}".rstrip())
        for tag, seat in seats.items():
            lc.task(seat.run(), f"inference {tag}".rstrip())
        watch = lc.task(_watch(worker_done), "rollout-watch", keep=True)
        if worker is not None:
            worker.start()

        async def stop_stepping() -> None:
            """Stop stepping (a hold on the limiter ends too) and flush the partial fragment into the
            queue; sessions: refuse new ones, flush every open one's fragment."""
            if worker is not None:
                worker.stop_event.set()
                for each in gates.values():
                    each.clear()
            await watch
            for seat in seats.values():
                seat.hub.close_all()
            await asyncio.sleep(0)   # (let the enqueue callbacks run)

        async def drain() -> None:
            """Push what is queued and get it acked; what the buffer cannot take in time is counted dropped.
            The sessions' fragments still being encoded are waited for first: the encoder hands each to the
            loop before the flush returns, so all of them are queued by the time this goes on."""
            for seat in seats.values():
                await asyncio.to_thread(seat.hub.flush)
            stopping.set()
            try:
                async with asyncio.timeout(SHUTDOWN_DEADLINE_S / 2):
                    # (every link's push is waited for, whichever ends first or fails: a failure is raised after)
                    for ended in await asyncio.shield(asyncio.gather(*pushes, return_exceptions=True)):
                        if isinstance(ended, BaseException):
                            raise ended
            except TimeoutError:
                for push in pushes:
                    push.cancel()
                log.warning("buffer unreachable at shutdown: %d fragments not delivered (counted as dropped)",
                            sum(each.drop_pending() for each in links.values()))

        def stopped() -> None:
            c = metrics.counters
            log.info("actor %s stopped: %d fragments cut, %d acknowledged, %d dropped, %d rejected",
                     actor_id, c["actor/fragments_total"], c["actor/fragments_acked_total"],
                     c["actor/fragments_dropped_total"], c["actor/fragments_rejected_total"])

        lc.on_stop(stop_stepping)
        lc.on_stop(drain)
        lc.on_stop(lc.stop_server(grace=1.0))   # stop serving stats and sessions (the other tasks end after)
        lc.on_stop(stopped)
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
