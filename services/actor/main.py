"""Actor wiring: config -> envs + policy (rollout.py), or external sessions (sessions.py) -> gRPC server
-> push/weights/inference loops -> shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import uuid
import zlib
from contextlib import asynccontextmanager

from kuberl.v1 import actor_pb2, buffer_pb2_grpc, learner_pb2_grpc
from services.actor.inference import BatchedInference
from services.actor.limiter import InsertGate
from services.actor.policy import Policy
from services.actor.push import Pusher
from services.actor.rollout import Rollout, RolloutWorker
from services.actor.servicer import ActorServicer
from services.actor.sessions import SessionHub
from services.actor.subscribe import subscribe_weights, watch_insert_limit
from services.common.fragments import EncodedFragment
from services.config import ExperimentConfig, load_role_config
from services.common.fragments import new_incarnation
from services.common.grpcutil import MiB, add_servicer, make_channel, start_server
from services.common.nets import spec_of
from services.common.prometheus import serve_metrics
from services.common.runtime import Endpoints, base_parser, run_service, write_ready_file
from services.common.stats import Metrics, tick_forever

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
    actor_index = seed_index(actor_id, actor_index)
    incarnation = new_incarnation()  # this process's: a restart under the same actor_id never collides
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    metrics = Metrics("actor", instance_id=actor_id)
    loop = asyncio.get_running_loop()
    external = cfg.env.mode == "external"
    max_bytes = cfg.buffer.max_message_mb * MiB
    buffer_ch, learner_ch = make_channel(buffer, max_bytes, tls=cfg.tls), make_channel(learner, max_bytes, tls=cfg.tls)
    pusher = Pusher(buffer_ch, cfg.actor.queue_fragments, cfg.actor.push_ack_interval_s, metrics,
                    max_bytes=int(cfg.actor.queue_mb * MiB))
    # The insert side of the buffer's rate limiter: stepping (or replying to simulators) holds at the
    # buffer's insert limit, counting this actor's own fragments not yet stored (limiter.py).
    gate = InsertGate(metrics)

    def enqueue(frag: EncodedFragment) -> None:  # event loop: the sessions' fragments
        frag = frag if isinstance(frag, EncodedFragment) else EncodedFragment.of(frag)
        gate.cut(frag.seq, frag.samples)
        pusher.enqueue(frag)

    rollout = hub = inference = worker = None
    if external:  # simulators connect over EnvSession and step themselves
        spec = spec_of(cfg.env)
        policy = Policy(cfg, spec, cfg.env.seed + 1000 * actor_index, metrics)
        hub = SessionHub(cfg, spec, actor_id, metrics, on_fragment=enqueue, incarnation=incarnation)
        inference = BatchedInference(policy, hub, metrics, gate=gate)
        episodes = hub.episodes
    else:
        # Envs are created before any channel is used (fork safety for subprocess envs).
        rollout = Rollout(cfg, actor_id, actor_index, metrics, incarnation=incarnation, gate=gate)
        policy, episodes = rollout.policy, rollout.episodes
    servicer = ActorServicer(metrics, episodes, hub, inference, cfg.actor.session_timeout_s)
    srv = await start_server(listen, lambda s: add_servicer(s, actor_pb2.DESCRIPTOR.services_by_name["Actor"], servicer),
                             [actor_pb2.DESCRIPTOR.services_by_name["Actor"].full_name], max_message_bytes=max_bytes,
                             max_connection_age_s=None, tls=cfg.tls, auth=cfg.auth, metrics=metrics)  # simulator sessions are long-lived streams
    prom = serve_metrics(metrics, metrics_listen, health=srv) if metrics_listen else None
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
        worker = RolloutWorker(rollout, lambda frag: loop.call_soon_threadsafe(pusher.enqueue, frag), done)
    else:
        done(None)  # no rollout thread to watch
    stopping = asyncio.Event()
    log.info("actor %s (incarnation %016x): %s, %s, %s, buffer %s, learner %s", actor_id, incarnation, cfg.env.id,
             "external simulators" if external else f"{cfg.env.num_envs} local envs", cfg.algorithm, buffer, learner)
    try:
        async with asyncio.TaskGroup() as tg:
            push = tg.create_task(pusher.run(stopping), name="push")
            side = [tg.create_task(subscribe_weights(learner_pb2_grpc.LearnerStub(learner_ch), actor_id,
                                                     policy, metrics), name="weights"),
                    tg.create_task(watch_insert_limit(buffer_pb2_grpc.BufferStub(buffer_ch), actor_id, incarnation,
                                                      gate, metrics), name="insert-limit"),
                    tg.create_task(tick_forever(metrics), name="stats")]
            if inference is not None:
                side.append(tg.create_task(inference.run(), name="inference"))
            watch = tg.create_task(_watch(worker_done), name="rollout-watch")
            if worker is not None:
                worker.start()
            await srv.set_serving(True)
            try:
                yield Endpoints(srv.address, prom.address if prom else None)
            finally:
                # Shutdown, in order, under one hard deadline so a hung drain cannot wedge a pod:
                async with asyncio.timeout(SHUTDOWN_DEADLINE_S):
                    await srv.set_serving(False)           # 1. readiness goes NOT_SERVING
                    if worker is not None:
                        worker.stop_event.set()             # 2. stop stepping (a hold on the limiter
                        gate.clear()                        #    ends too); the partial fragment
                    await watch                             #    is flushed into the queue
                    if hub is not None:                     #    (sessions: refuse new ones, flush
                        hub.close_all()                     #    every open one's fragment)
                    await asyncio.sleep(0)                  #    (let the enqueue callbacks run)
                    stopping.set()                          # 3. drain: push what is queued, get acked
                    try:
                        async with asyncio.timeout(SHUTDOWN_DEADLINE_S / 2):
                            await asyncio.shield(push)
                    except TimeoutError:
                        push.cancel()
                        log.warning("buffer unreachable at shutdown: %d fragments not delivered (counted as dropped)",
                                    pusher.drop_pending())
                    for task in side:
                        task.cancel()
                    await srv.server.stop(grace=1.0)       # 4. stop serving stats and sessions
                    c = metrics.counters
                    log.info("actor %s stopped: %d fragments cut, %d acknowledged, %d dropped, %d rejected",
                             actor_id, c["actor/fragments_total"], c["actor/fragments_acked_total"],
                             c["actor/fragments_dropped_total"], c["actor/fragments_rejected_total"])
    finally:
        await srv.close()
        if prom is not None:
            prom.close()
        await buffer_ch.close()                             # 5. close channels, release envs
        await learner_ch.close()
        if rollout is not None:
            rollout.close()

def parse_args(argv=None) -> argparse.Namespace:
    p = base_parser("actor", 50053, "Steps environments and pushes trajectory fragments to a buffer.")
    p.add_argument("--buffer", default=os.environ.get("KUBERL_BUFFER", "127.0.0.1:50051"),
                   help="buffer address host:port (default $KUBERL_BUFFER or 127.0.0.1:50051)")
    p.add_argument("--learner", default=os.environ.get("KUBERL_LEARNER", "127.0.0.1:50052"),
                   help="learner address host:port (default $KUBERL_LEARNER or 127.0.0.1:50052)")
    p.add_argument("--actor-id", default=None, help="unique actor id (default: host-pid-random)")
    p.add_argument("--actor-index", type=int, default=None,
                   help="index used to derive env seeds (seed + 1000 * index; default: from a hash of the actor id, "
                        "so replicas of a Deployment step differently seeded envs)")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    cfg = load_role_config(args)
    async with serving(cfg, listen=args.listen, metrics_listen=args.metrics_listen or None, buffer=args.buffer,
                       learner=args.learner, actor_id=args.actor_id, actor_index=args.actor_index) as endpoints:
        write_ready_file(args.ready_file, endpoints)
        log.info("actor serving gRPC on %s, metrics on %s", endpoints.grpc, endpoints.metrics)
        await stop.wait()


def main(argv=None) -> int:
    return run_service("actor", parse_args(argv), serve)
