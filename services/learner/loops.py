"""The learner's loops, each a task main.py starts and its shutdown stops:

- `learn` (the train task) trains generation after generation (`train_generation`): alone, `train_loop`
  takes each iteration the next batch from the inbox (waiting for one: starved time), trains on it in a
  thread, and publishes the weights every `learner.publish_interval_updates` updates; in a group,
  `group_train_loop` first agrees a round with the others (all go on, and all hold a batch) so that the
  gradient all-reduces line up. It stops when the shutdown sets `stopping` (a group at a round's end;
  alone, once the update in flight is done). An elastic group that changes size or loses a peer ends
  the generation instead: rank 0 checkpoints and `learn` joins the next group (services/learner/group.py).
- `fetch_batches`, one per buffer shard: keeps a StreamBatches stream open and puts each batch into the
  inbox (waiting while it is full), re-opening the stream when it ends, with back-off after an error.
- `report_progress`, one per buffer shard: sends the version and what was consumed from the shard after
  each publication (`progressed`) and at least once a second.
  Both are cancelled when their shard leaves the shard list (services/learner/shards.py) or at shutdown.
- `checkpoint_loop`: checkpoints every `learner.checkpoint_interval_s` until cancelled at shutdown (the
  last checkpoint is the shutdown's own).

`Generation` is what they train with: the group as it is now (`learn` replaces its Trainer when the
group forms again)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from kuberl.v1 import buffer_pb2
from services import algorithms
from services.config import ExperimentConfig
from services.common.net.grpcutil import Backoff, describe, raise_if_cancelling
from services.common.notify import Notifier
from services.common.stats import Metrics
from services.learner.distributed import GroupBroken
from services.learner.group import StoppedBeforeGroupFormed, join
from services.learner.inbox import Fetched, Inbox, Shard, samples_per_insert, starved_get
from services.learner.membership import FixedGroup, StatefulSetGroup
from services.learner.publish import WeightsHub
from services.learner.shards import ShardSet
from services.learner.trainer import Trainer

log = logging.getLogger(__name__)
GROUP_ROUND_WAIT_S = 0.5       # a learner of a group without a batch joins the round after this long
GROUP_PEER_STOP_GRACE_S = 10.0


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


def batch_request(cfg: ExperimentConfig, learner_id: str) -> buffer_pb2.BatchRequest:
    algorithm = algorithms.get(cfg.algorithm)
    return buffer_pb2.BatchRequest(learner_id=learner_id, algorithm=algorithm.code, batch_size=algorithm.batch_size(cfg))


async def fetch_batches(shard: Shard, request: buffer_pb2.BatchRequest, inbox: Inbox, metrics: Metrics) -> None:
    """Keep a StreamBatches stream open to one buffer shard, re-opening it when it ends; the inbox bounds
    prefetch. With several shards one of these runs per shard, all filling the same inbox: the learner
    trains on whichever shard's batch comes first, and each shard serves it as fast as its own rate
    limiter allows, so each shard is sampled in proportion to what its actors insert."""
    backoff = Backoff()
    while True:
        try:
            async for batch in shard.stub.StreamBatches(request):
                # Shielded: a batch read off the stream reaches the inbox even if this task is cancelled
                # while the inbox is full (a shard leaving the topology, services/learner/shards.py).
                await asyncio.shield(inbox.put(Fetched(batch, shard)))
                metrics.inc("learner/batches_received_total")
                backoff.reset()
        except grpc.aio.AioRpcError as err:
            raise_if_cancelling(err)
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise RuntimeError(f"the buffer at {shard.address} refused this learner's batch request: "
                                   f"{err.details()}") from err
            metrics.inc("learner/batch_stream_errors_total")
            log.log(logging.INFO if err.code() == grpc.StatusCode.UNAVAILABLE else logging.WARNING,
                    "batch stream from buffer %s ended (%s); reconnecting", shard.address, describe(err))
        await backoff.sleep()


async def publish(hub: WeightsHub, trainer: Trainer) -> None:
    """Publish the trainer's current weights, unless it refuses them (NaN or infinity: `Trainer.weights`;
    then the newest version published stands)."""
    if (chunks := await asyncio.to_thread(trainer.weights)) is not None:
        hub.publish(chunks)


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


async def train_loop(trainer: Trainer, inbox: Inbox, hub: WeightsHub, every: int,
                     progressed: Notifier) -> None:
    """Train on each batch as it arrives; publish when `every` updates have passed since the last."""
    published = trainer.version
    trainer.metrics.inc("learner/starved_seconds_total", 0)
    while True:
        item = await starved_get(inbox, trainer.metrics)
        item.consumed()   # before: a cancel while the thread trains must not leave it uncounted
        await asyncio.to_thread(trainer.train, item.batch)
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
            item, held = held, None
            item.consumed()
            await asyncio.to_thread(trainer.train, item.batch)
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


async def send_progress(shard: Shard, shards: ShardSet, learner_id: str, version: int, metrics: Metrics,
                        timeout: float = 5.0) -> None:
    """One LearnerProgress to one buffer shard: the version, and what this learner has consumed from
    that shard so far. `learner/samples_per_insert` is over every shard. The shard's answer carries
    the planner's newest shard list, which `shards` follows (services/learner/shards.py)."""
    request = buffer_pb2.LearnerProgress(
        learner_id=learner_id, policy_version=version, samples_consumed_total=shard.samples_consumed,
        batches_consumed_total=shard.batches_consumed)
    try:
        ack = await shard.stub.ReportProgress(request, timeout=timeout)
        shard.produced = max(0, ack.samples_inserted_total - ack.warmup_samples)   # the warm-up is not production
        if ack.HasField("topology"):
            shards.update(ack.topology)
        if (ratio := samples_per_insert(shards)) is not None:
            metrics.set("learner/samples_per_insert", ratio)
    except grpc.aio.AioRpcError as err:
        raise_if_cancelling(err)
        metrics.inc("learner/progress_report_errors_total")
        log.debug("progress report to buffer %s failed: %s", shard.address, describe(err))


async def report_progress(shard: Shard, shards: ShardSet, learner_id: str, current: Generation,
                          metrics: Metrics, progressed: Notifier) -> None:
    """Tell one buffer shard the current version after each publication, and at least once a second."""
    while True:
        await send_progress(shard, shards, learner_id, current.trainer.version, metrics)
        await progressed.wait(timeout=1.0)


async def checkpoint_loop(current: Generation, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        if not current.saved:
            await asyncio.to_thread(current.trainer.checkpoint)
