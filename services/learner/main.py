"""Learner wiring: config -> Trainer -> gRPC server -> fetch/train/publish/checkpoint loops -> shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import torch

from kuberl.v1 import buffer_pb2, buffer_pb2_grpc, learner_pb2
from services import algorithms
from services.config import ExperimentConfig, load_role_config
from services.common.grpcutil import Backoff, MiB, add_servicer, describe, make_channel, raise_if_cancelling
from services.common.lifecycle import Lifecycle
from services.common.notify import Notifier
from services.common.runtime import base_parser, run_service, write_ready_file
from services.common.stats import Metrics
from services.learner.distributed import FormationAbandoned, GradientSync, GroupBroken, GroupSpec, Rendezvous
from services.learner.inbox import Inbox, discard, starved_get
from services.learner.membership import FixedGroup, MembershipError, StatefulSetGroup
from services.learner.publish import WeightsHub
from services.learner.servicer import LearnerServicer
from services.learner.trainer import Trainer

log = logging.getLogger(__name__)
SHUTDOWN_DEADLINE_S = 30.0
GROUP_ROUND_WAIT_S = 0.5       # a learner of a group without a batch joins the round after this long
GROUP_PEER_STOP_GRACE_S = 10.0


def batch_request(cfg: ExperimentConfig, learner_id: str) -> buffer_pb2.BatchRequest:
    algorithm = algorithms.get(cfg.algorithm)
    return buffer_pb2.BatchRequest(learner_id=learner_id, algorithm=algorithm.code, batch_size=algorithm.batch_size(cfg))


async def fetch_batches(stub: buffer_pb2_grpc.BufferStub, request: buffer_pb2.BatchRequest,
                        inbox: Inbox, metrics: Metrics) -> None:
    """Keep a StreamBatches stream open, re-opening it when it ends; the inbox bounds prefetch."""
    backoff = Backoff()
    while True:
        try:
            async for batch in stub.StreamBatches(request):
                await inbox.put(batch)
                metrics.inc("learner/batches_received_total")
                backoff.reset()
        except grpc.aio.AioRpcError as err:
            raise_if_cancelling(err)
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise RuntimeError(f"the buffer refused this learner's batch request: {err.details()}") from err
            metrics.inc("learner/batch_stream_errors_total")
            log.log(logging.INFO if err.code() == grpc.StatusCode.UNAVAILABLE else logging.WARNING,
                    "batch stream from buffer ended (%s); reconnecting", describe(err))
        await backoff.sleep()


async def publish(hub: WeightsHub, trainer: Trainer) -> None:
    """Publish the trainer's current weights, unless it refuses them (NaN or infinity: `Trainer.weights`;
    then the newest version published stands)."""
    if (chunks := await asyncio.to_thread(trainer.weights)) is not None:
        hub.publish(chunks)


async def train_loop(trainer: Trainer, inbox: Inbox, hub: WeightsHub, every: int,
                     progressed: Notifier) -> None:
    """Train on each batch as it arrives; publish when `every` updates have passed since the last."""
    published = trainer.version
    trainer.metrics.inc("learner/starved_seconds_total", 0)
    while True:
        batch = await starved_get(inbox, trainer.metrics)
        await asyncio.to_thread(trainer.train, batch)
        if trainer.version - published >= every:
            await publish(hub, trainer)
            published = trainer.version
            progressed.notify()


async def group_train_loop(trainer: Trainer, inbox: Inbox, hub: WeightsHub, every: int,
                           progressed: Notifier, stopping: asyncio.Event, *, elastic: bool = False) -> None:
    """Train in rounds with the other learners of the group (services/learner/distributed.py): each
    round agrees whether to stop and whether everyone holds a batch; only then does anyone train, so
    the gradient all-reduces line up. All stop at the same round once any learner is stopping.
    `elastic` (services/learner/membership.py): a peer's stop ends this group, and the caller forms the
    next one; otherwise this learner waits for its own stop (its supervisor stops the whole group).
    A batch in hand when the group ends, taken or just arriving, goes back to the inbox for the next."""
    sync = trainer.sync
    published = trainer.version
    trainer.metrics.inc("learner/starved_seconds_total", 0)
    trainer.metrics.inc("learner/group_rounds_waiting_total", 0)
    held, getter = None, None
    try:
        while True:
            started = time.perf_counter()
            if held is None:
                getter = getter or inbox.get()
                done, _ = await asyncio.wait({getter}, timeout=GROUP_ROUND_WAIT_S)
                if done:
                    held, getter = getter.result(), None
            stop, all_ready = await asyncio.to_thread(sync.agree, stopping.is_set(), held is not None)
            if stop:
                break
            if not all_ready:  # somebody has no batch yet: nobody trains; what is held waits for the next round
                trainer.metrics.inc("learner/group_rounds_waiting_total")
                trainer.metrics.inc("learner/starved_seconds_total", time.perf_counter() - started)
                continue
            trainer.metrics.inc("learner/starved_seconds_total", time.perf_counter() - started)
            batch, held = held, None
            await asyncio.to_thread(trainer.train, batch)
            if trainer.version - published >= every:
                await publish(hub, trainer)
                published = trainer.version
                progressed.notify()
    finally:
        if held is not None:
            inbox.hand_back(held)
        if getter is not None:
            inbox.cancel(getter)   # a batch it took while the round was agreed on goes back too
    if not stopping.is_set() and elastic:
        log.info("the group is ending (a peer left or saw a new group size)")
    elif not stopping.is_set():
        # A peer is stopping, so the group is over; this learner's own stop should follow (its
        # supervisor stops the whole group). If it does not, exit so the group can be formed again.
        log.info("the group is stopping (a peer asked to); waiting up to %.0f s for this learner's stop",
                 GROUP_PEER_STOP_GRACE_S)
        try:
            await asyncio.wait_for(stopping.wait(), GROUP_PEER_STOP_GRACE_S)
        except TimeoutError:
            raise GroupBroken("the group stopped without this learner being stopped: exiting so that it can "
                              "be formed again") from None


async def send_progress(stub: buffer_pb2_grpc.BufferStub, learner_id: str, version: int, metrics: Metrics,
                        timeout: float = 5.0) -> None:
    """One LearnerProgress to the buffer: the version and what this learner has consumed so far."""
    request = buffer_pb2.LearnerProgress(
        learner_id=learner_id, policy_version=version,
        samples_consumed_total=int(metrics.counters["learner/samples_consumed_total"]),
        batches_consumed_total=int(metrics.counters["learner/batches_consumed_total"]))
    try:
        ack = await stub.ReportProgress(request, timeout=timeout)
        produced = ack.samples_inserted_total - ack.warmup_samples   # the warm-up is not production
        if produced > 0:
            metrics.set("learner/samples_per_insert", request.samples_consumed_total / produced)
    except grpc.aio.AioRpcError as err:
        raise_if_cancelling(err)
        metrics.inc("learner/progress_report_errors_total")
        log.debug("progress report to buffer failed: %s", describe(err))


async def report_progress(stub: buffer_pb2_grpc.BufferStub, learner_id: str, current: Generation,
                          metrics: Metrics, progressed: Notifier) -> None:
    """Tell the buffer the current version after each publication, and at least once a second."""
    while True:
        await send_progress(stub, learner_id, current.trainer.version, metrics)
        await progressed.wait(timeout=1.0)


async def checkpoint_loop(current: Generation, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        if not current.saved:
            await asyncio.to_thread(current.trainer.checkpoint)


class StoppedBeforeGroupFormed(Exception):
    """Asked to stop while waiting for the rest of its group: nothing was trained, nothing to save."""


async def form_group(rendezvous: Rendezvous, world_size: int, stop: asyncio.Event | None,
                     changed: Awaitable[int] | None = None) -> GradientSync:
    """Form a group of `world_size` at `rendezvous` (blocking in a thread until every rank has come)
    unless `stop` is set first (StoppedBeforeGroupFormed) or `changed` (the membership's next size)
    completes first (FormationAbandoned); either way the thread gives up at its next read of the store."""
    # A daemon thread of its own, not the default executor: the event loop's shutdown joins the
    # executor's threads, and this one may stay blocked in gloo's connections for up to
    # gloo_connect_s (services/learner/distributed.py).
    loop = asyncio.get_running_loop()
    forming, abandon = loop.create_future(), threading.Event()

    def settle(set_outcome, value) -> None:
        if not forming.done():
            set_outcome(value)

    def join() -> None:
        try:
            outcome = (forming.set_result, rendezvous.form(world_size, abandon))
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (forming.set_exception, err)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop has closed: the process is ending
            pass

    threading.Thread(target=join, name="join-learner-group", daemon=True).start()
    watch = asyncio.ensure_future(changed) if changed is not None else None

    async def formed() -> GradientSync:
        if watch is not None:
            await asyncio.wait({forming, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not forming.done():   # a new size: give this formation up; its thread answers shortly
                log.info("the group's size is now %d while a group of %d forms: giving it up", watch.result(),
                         world_size)
                abandon.set()
        return await forming

    try:
        # Stopped first: the joining thread gives up, or stays blocked in gloo until its timeout; the
        # process ends without waiting for it (services exit through runtime.exit_process).
        return await _unless_stopped(formed(), stop, f"stopped while waiting for the group of {world_size} "
                                                     f"learners to form")
    finally:
        abandon.set()   # (a formed group is unaffected; a forming one stops at its next read of the store)
        if watch is not None:
            watch.cancel()


@dataclass
class Generation:
    """The group as it is now: its Trainer (holding its GradientSync, None alone). An elastic membership
    replaces it each time the group is formed again; `saved`: the Trainer has written its last checkpoint
    and is done (between two groups, or stopped while the next one formed)."""
    trainer: Trainer
    saved: bool = False

    @property
    def world_size(self) -> int:
        return self.trainer.sync.world_size if self.trainer.sync is not None else 1

    def close(self) -> None:
        if self.trainer.sync is not None:
            self.trainer.sync.close()


async def _unless_stopped(aw, stop: asyncio.Event | None, what: str):
    """`await aw`, or raise StoppedBeforeGroupFormed(what) if `stop` is set first."""
    task = asyncio.ensure_future(aw)
    if stop is None:
        return await task
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():   # stopped, or this coroutine cancelled: nothing may poll on behind it
            task.cancel()
    if not task.done() or task.cancelled():
        raise StoppedBeforeGroupFormed(what)
    return task.result()


async def join(membership: FixedGroup | StatefulSetGroup, build: Callable[[GradientSync | None], Trainer],
               metrics: Metrics, stop: asyncio.Event | None, set_ready=None) -> Trainer:
    """Form this learner's group as its membership now says, and build the group's Trainer from rank 0's
    newest checkpoint. While this learner's rank lies outside the group (a scale-down is removing it) it
    waits, not ready (`set_ready(False)`). A group that fails to form is formed again if the membership
    is elastic; a fixed one raises GroupBroken."""
    while True:
        n = await _unless_stopped(membership.world_size(), stop, "stopped while reading the group's size")
        if membership.rank >= n:
            log.info("rank %d lies outside the group of %d learners (being scaled down): waiting", membership.rank, n)
            metrics.set("learner/group_size", n)
            if set_ready is not None:
                await set_ready(False)
            await _unless_stopped(membership.wait_for_change(n), stop,
                                  f"stopped while rank {membership.rank} was outside the group of {n} learners")
            continue
        sync = None
        try:
            if n > 1:
                changed = membership.wait_for_change(n) if membership.elastic else None
                sync = await form_group(membership.rendezvous, n, stop, changed)
            return await asyncio.to_thread(build, sync)
        except FormationAbandoned:
            continue   # the size changed while this group formed: form one of the new size
        except GroupBroken as err:
            if sync is not None:
                sync.close()
            if not membership.elastic:
                raise
            metrics.inc("learner/group_formation_failures_total")
            log.warning("%s; forming the group again", err)
            await _unless_stopped(asyncio.sleep(1.0), stop, "stopped while forming the group again")
        except BaseException:
            if sync is not None:
                sync.close()
            raise


async def train_generation(membership: FixedGroup | StatefulSetGroup, trainer: Trainer, world_size: int,
                           inbox: Inbox, hub: WeightsHub, every: int, progressed: Notifier,
                           stopping: asyncio.Event) -> None:
    """Train as the group now is until this learner stops or, with an elastic membership, the group's size
    changes or a peer leaves (the group breaks or stops at a round's end). A fixed group's break raises."""
    leaving = asyncio.Event()   # this learner's stop, or a new group size

    async def watch() -> None:
        waits = {asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(membership.wait_for_change(world_size))}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        leaving.set()

    watcher = asyncio.create_task(watch(), name="membership")
    try:
        if trainer.sync is not None:
            try:
                await group_train_loop(trainer, inbox, hub, every, progressed, leaving, elastic=membership.elastic)
            except GroupBroken as err:
                if not membership.elastic:
                    raise
                if stopping.is_set():   # stopping anyway: the shutdown's final checkpoint follows
                    log.warning("%s (while stopping)", err)
                else:
                    log.warning("%s; forming the group again", err)
            return
        train = asyncio.create_task(train_loop(trainer, inbox, hub, every, progressed), name="train-alone")
        left = asyncio.create_task(leaving.wait())
        try:
            await asyncio.wait({train, left}, return_when=asyncio.FIRST_COMPLETED)
            if train.done():
                train.result()   # its error; train_loop never returns
        finally:
            left.cancel()
            train.cancel()       # an update in flight finishes in its thread; a checkpoint waits for it on the lock
        await asyncio.wait({train})   # (not `await train`: that would take its cancellation for this task's)
    finally:
        watcher.cancel()


async def learn(membership: FixedGroup | StatefulSetGroup, current: Generation, build, inbox: Inbox,
                hub: WeightsHub, every: int, progressed: Notifier, stopping: asyncio.Event, set_ready) -> None:
    """Train group after group: when one ends without this learner stopping (an elastic membership's new
    size or lost peer), rank 0 checkpoints, and the next group starts from that checkpoint. The weights
    already published keep being served to actors meanwhile."""
    metrics = current.trainer.metrics
    metrics.inc("learner/group_reforms_total", 0)
    metrics.inc("learner/group_formation_failures_total", 0)
    while True:
        await train_generation(membership, current.trainer, current.world_size, inbox, hub, every, progressed,
                               stopping)
        if stopping.is_set():
            return
        # Leave the old group before the checkpoint: the peers are already forming the next one.
        current.close()
        await asyncio.to_thread(current.trainer.checkpoint)
        current.saved = True
        try:
            trainer = await join(membership, build, metrics, stopping, set_ready)
        except StoppedBeforeGroupFormed as err:
            log.info("%s", err)
            return
        current.trainer, current.saved = trainer, False
        metrics.inc("learner/group_reforms_total")
        if stopping.is_set():   # the shutdown has begun (readiness is already NOT_SERVING)
            return
        await set_ready(True)
        await publish(hub, trainer)
        progressed.notify()


@asynccontextmanager
async def serving(cfg: ExperimentConfig, *, listen: str, metrics_listen: str | None = None, buffer: str, checkpoint_dir: str,
                  learner_id: str | None = None, group: GroupSpec | StatefulSetGroup | None = None,
                  stop: asyncio.Event | None = None):
    """Start a learner; yields its Endpoints. Leaving the context runs the shutdown sequence.
    `group`: this learner's place in a group of learners that average gradients: a fixed GroupSpec
    (None or a world size of 1: it trains alone) or an elastic StatefulSetGroup
    (services/learner/membership.py); `stop` set while the first group forms raises StoppedBeforeGroupFormed."""
    learner_id = learner_id or f"learner-{socket.gethostname()}-{os.getpid()}"
    torch.set_num_threads(cfg.learner.torch_threads)
    metrics = Metrics("learner", instance_id=learner_id)
    membership = group if isinstance(group, StatefulSetGroup) else FixedGroup(group or GroupSpec(0, 1, ""))

    def build(sync: GradientSync | None) -> Trainer:
        return Trainer(cfg, metrics, checkpoint_dir, sync)

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
    channel = make_channel(buffer, max_bytes, receive_window_bytes=64 * 1024, tls=cfg.tls)
    lc.on_close(channel.close)
    inbox = Inbox(maxsize=cfg.buffer.batch_prefetch)
    log.info("learner %s: %s on %s, version %d, buffer %s", learner_id, cfg.algorithm, cfg.env.id,
             current.trainer.version, buffer)
    async with lc.running():
        stub = buffer_pb2_grpc.BufferStub(channel)
        fetch = lc.task(fetch_batches(stub, batch_request(cfg, learner_id), inbox, metrics), "fetch")
        progressed = Notifier()
        stopping = asyncio.Event()
        train = lc.task(learn(membership, current, build, inbox, hub, cfg.learner.publish_interval_updates,
                              progressed, stopping, lc.server.set_serving), "train")
        side = [lc.task(checkpoint_loop(current, cfg.learner.checkpoint_interval_s), "checkpoint"),
                lc.task(report_progress(stub, learner_id, current, metrics, progressed), "progress")]

        async def stop_training() -> None:
            """Stop consuming; an update in flight finishes (a group stops together at a round's end)."""
            fetch.cancel()
            stopping.set()
            await asyncio.wait({train}, timeout=SHUTDOWN_DEADLINE_S / 2)
            train.cancel()                 # (the checkpoint below waits for it on the lock)
            if inbox.qsize():
                log.info("discarding %d prefetched batches at shutdown", inbox.qsize())
                discard(metrics, inbox.drain())
            for task in side:              # the last progress report and checkpoint are the steps below
                task.cancel()

        async def last_word() -> None:
            """What was discarded counts as consumed: the buffer stops counting it in flight now rather
            than when this learner's reports expire. Then the final checkpoint."""
            await send_progress(stub, learner_id, current.trainer.version, metrics, timeout=1.0)
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
                   help="buffer address host:port (default $KUBERL_BUFFER or 127.0.0.1:50051)")
    p.add_argument("--checkpoint-dir", default=os.environ.get("KUBERL_CHECKPOINT_DIR", "checkpoints"),
                   help="where checkpoints are written and restored from (default ./checkpoints)")
    p.add_argument("--learner-id", default=None, help="name of this learner (default: learner-host-pid)")
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
                           group=args.group_spec, stop=stop) as endpoints:
            write_ready_file(args.ready_file, endpoints)
            log.info("learner serving gRPC on %s, metrics on %s", endpoints.grpc, endpoints.metrics)
            await stop.wait()
    except StoppedBeforeGroupFormed as err:
        log.info("%s", err)


def main(argv=None) -> int:
    return run_service("learner", parse_args(argv), serve)
