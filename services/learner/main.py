"""Learner wiring: config -> the group's first Trainer (group.py) -> gRPC server -> the train, fetch,
progress and checkpoint loops (loops.py) -> shutdown, on the common lifecycle."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from contextlib import asynccontextmanager

import torch

from kuberl.v1 import learner_pb2
from services.config import ExperimentConfig, load_role_config
from services.common.net.grpcutil import MiB, add_servicer, make_channel
from services.common.service.lifecycle import Lifecycle
from services.common.models.nets import resolve_device
from services.common.notify import Notifier
from services.common.net.shards import buffer_addresses
from services.common.service.runtime import base_parser, run_service, write_ready_file
from services.common.stats import Metrics
from services.learner.distributed import GradientSync, GroupSpec
from services.learner.group import StoppedBeforeGroupFormed, join
from services.learner.inbox import Inbox, Shard, discard
from services.learner.loops import (Generation, batch_request, checkpoint_loop, fetch_batches, learn, publish,
                                     report_progress, send_progress)
from services.learner.membership import FixedGroup, MembershipError, StatefulSetGroup
from services.learner.publish import WeightsHub
from services.learner.shards import ShardSet
from services.learner.servicer import LearnerServicer
from services.learner.trainer import Trainer

log = logging.getLogger(__name__)
SHUTDOWN_DEADLINE_S = 30.0


@asynccontextmanager
async def serving(cfg: ExperimentConfig, *, listen: str, metrics_listen: str | None = None, buffer: str, checkpoint_dir: str,
                  learner_id: str | None = None, group: GroupSpec | StatefulSetGroup | None = None,
                  stop: asyncio.Event | None = None, policy: str | None = None):
    """Start a learner; yields its Endpoints. Leaving the context runs the shutdown sequence.
    `group`: this learner's place in a group of learners that average gradients: a fixed GroupSpec
    (None or a world size of 1: it trains alone) or an elastic StatefulSetGroup
    (services/learner/membership.py); `stop` set while the first group forms raises StoppedBeforeGroupFormed.
    `policy`: the policy of the run it trains (config `policies`; needed where there are several): it
    streams from and reports to that policy's table in every buffer shard."""
    policy = cfg.policy(policy)
    cfg = cfg.for_policy(policy)   # (its own training settings, config policies.<name>.overrides)
    learner_id = learner_id or f"learner-{socket.gethostname()}-{os.getpid()}"
    torch.set_num_threads(cfg.learner.torch_threads)
    metrics = Metrics("learner", instance_id=learner_id)
    membership = group if isinstance(group, StatefulSetGroup) else FixedGroup(group or GroupSpec(0, 1, ""))
    if membership.rendezvous is not None:   # GPU learners average gradients over NCCL (distributed.py)
        membership.rendezvous.device = resolve_device(cfg.learner.device)

    def build(sync: GradientSync | None) -> Trainer:
        return Trainer(cfg, metrics, checkpoint_dir, sync, policy)

    current = Generation(await join(membership, build, metrics, stop))
    hub = WeightsHub()
    await publish(hub, current.trainer)  # actors start from the learner's initialisation (or checkpoint)
    max_bytes = cfg.buffer.max_message_mb * MiB
    servicer = LearnerServicer(hub, metrics)
    lc = Lifecycle("learner", metrics, deadline_s=SHUTDOWN_DEADLINE_S)
    lc.on_close(current.close)
    service = learner_pb2.DESCRIPTOR.services_by_name["Learner"]
    try:
        await lc.serve(listen, lambda s: add_servicer(s, service, servicer), [service.full_name],
                       max_message_bytes=max_bytes, metrics_listen=metrics_listen, tls=cfg.tls, auth=cfg.auth)
    except BaseException:
        current.close()
        raise

    def open_channel(address: str):
        return make_channel(address, max_bytes, receive_window_bytes=64 * 1024, tls=cfg.tls,
                            policy=cfg.tag(policy))

    def start(shard: Shard) -> tuple[asyncio.Task, asyncio.Task]:
        return (lc.task(fetch_batches(shard, request, inbox, metrics), f"fetch-{shard.address}"),
                lc.task(report_progress(shard, shards, learner_id, current, metrics, progressed),
                        f"progress-{shard.address}"))

    # Every buffer shard: this learner streams batches from each, and follows the planner's changes to
    # the list (services/learner/shards.py).
    shards = ShardSet(buffer_addresses(buffer), open_channel, start, metrics)
    lc.on_close(shards.close)
    inbox = Inbox(maxsize=cfg.buffer.batch_prefetch)
    request = batch_request(cfg, learner_id)
    progressed = Notifier()
    log.info("learner %s: %s on %s%s, version %d, buffer %s", learner_id, cfg.algorithm, cfg.env.id,
             f", policy {policy!r}", current.trainer.version, buffer)
    async with lc.running():
        shards.begin()
        stopping = asyncio.Event()
        train = lc.task(learn(membership, current, build, inbox, hub, cfg.learner.publish_interval_updates,
                              progressed, stopping, lc.server.set_serving), "train")
        checkpoints = lc.task(checkpoint_loop(current, cfg.learner.checkpoint_interval_s), "checkpoint")

        async def stop_training() -> None:
            """Stop consuming; an update in flight finishes (a group stops together at a round's end)."""
            shards.stop_fetching()
            stopping.set()
            await asyncio.wait({train}, timeout=SHUTDOWN_DEADLINE_S / 2)
            train.cancel()                 # (the checkpoint below waits for it on the lock)
            if inbox.qsize():
                log.info("discarding %d prefetched batches at shutdown", inbox.qsize())
                discard(metrics, inbox.drain())
            checkpoints.cancel()           # the last progress report and checkpoint are the steps below
            shards.stop_reporting()

        async def last_word() -> None:
            """What was discarded counts as consumed: the buffer stops counting it in flight now rather
            than when this learner's reports expire. Then the final checkpoint."""
            await asyncio.gather(*(send_progress(shard, shards, learner_id, current.trainer.version, metrics,
                                                 timeout=1.0) for shard in shards))
            if not current.saved:
                await asyncio.to_thread(current.trainer.checkpoint)

        lc.on_stop(stop_training)
        lc.on_stop(last_word)
        lc.on_stop(hub.close)                     # end weight streams, stop serving
        lc.on_stop(lc.stop_server(grace=1.0))
        await lc.ready()
        yield lc.endpoints


def parse_args(argv=None) -> argparse.Namespace:
    p = base_parser("learner", 50052, "Trains on batches streamed from a buffer and publishes weights.")
    p.add_argument("--buffer", default=os.environ.get("KUBERL_BUFFER", "127.0.0.1:50051"),
                   help="buffer address host:port, or one per buffer shard separated by commas: this learner "
                        "streams batches from every shard (default $KUBERL_BUFFER or 127.0.0.1:50051)")
    p.add_argument("--checkpoint-dir", default=os.environ.get("KUBERL_CHECKPOINT_DIR", "checkpoints"),
                   help="where checkpoints are written and restored from (default ./checkpoints)")
    p.add_argument("--learner-id", default=None, help="name of this learner (default: learner-host-pid)")
    p.add_argument("--policy", default=os.environ.get("KUBERL_POLICY") or None,
                   help="the policy it trains, where the config names several (config `policies`; "
                        "default $KUBERL_POLICY)")
    p.add_argument("--world-size", type=int, default=int(os.environ.get("KUBERL_LEARNER_WORLD_SIZE", "1")),
                   help="learners training together, averaging gradients (default $KUBERL_LEARNER_WORLD_SIZE or 1)")
    p.add_argument("--rank", type=int, default=int(os.environ.get("KUBERL_LEARNER_RANK", "0")),
                   help="this learner's rank in 0..world-size-1; rank 0 hosts the rendezvous and writes "
                        "checkpoints (default $KUBERL_LEARNER_RANK or 0)")
    p.add_argument("--group", default=os.environ.get("KUBERL_LEARNER_GROUP", ""),
                   help="host:port where rank 0 hosts the group's rendezvous (default $KUBERL_LEARNER_GROUP)")
    p.add_argument("--membership", choices=("fixed", "statefulset"),
                   default=os.environ.get("KUBERL_LEARNER_MEMBERSHIP", "fixed"),
                   help="fixed: --rank/--world-size as given; statefulset: the learners are a StatefulSet's pods, "
                        "the rank is this pod's ordinal (from --learner-id), the group's size the StatefulSet's "
                        "replicas, and the group is formed again when they change (services/learner/membership.py; "
                        "default $KUBERL_LEARNER_MEMBERSHIP or fixed)")
    p.add_argument("--kubernetes-api", default=os.environ.get("KUBERL_KUBERNETES_API") or None,
                   help="with --membership=statefulset: the API server's URL (default: in-cluster; e.g. "
                        "http://127.0.0.1:8001 through `kubectl proxy`)")
    args = p.parse_args(argv)
    try:
        buffer_addresses(args.buffer)
        if args.membership == "statefulset":
            if args.rank != 0 or args.world_size != 1:
                raise ValueError("--membership=statefulset takes the rank and the world size from the StatefulSet: "
                                 "do not give --rank or --world-size")
            args.group_spec = StatefulSetGroup(args.learner_id or socket.gethostname(), args.group,
                                               api=args.kubernetes_api)
        else:
            args.group_spec = GroupSpec(args.rank, args.world_size, args.group)
    except (ValueError, MembershipError) as err:
        p.error(str(err))
    return args


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    cfg = load_role_config(args)
    try:
        async with serving(cfg, listen=args.listen, metrics_listen=args.metrics_listen or None, buffer=args.buffer,
                           checkpoint_dir=args.checkpoint_dir, learner_id=args.learner_id,
                           group=args.group_spec, stop=stop, policy=args.policy) as endpoints:
            write_ready_file(args.ready_file, endpoints)
            log.info("learner serving gRPC on %s, metrics on %s", endpoints.grpc, endpoints.metrics)
            await stop.wait()
    except StoppedBeforeGroupFormed as err:
        log.info("%s", err)


def main(argv=None) -> int:
    return run_service("learner", parse_args(argv), serve)
