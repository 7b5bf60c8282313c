"""Thin gRPC adapter of the buffer: PushTrajectories, StreamBatches, ReportProgress, WatchInsertLimit,
GetStats -> Store. Every call on the Store goes through its StoreOwner (services/buffer/owner.py): on
the event loop, or on the thread that owns the store."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import grpc

from kuberl.v1 import buffer_pb2, buffer_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services import algorithms
from services.buffer.owner import StoreOwner
from services.buffer.store import Outcome, Store
from services.common.protocol.fragments import MAX_ID_LEN, RawFragment, batch_samples
from services.common.net.grpcutil import add_handlers, generated_handlers
from services.common.net.shards import buffer_addresses
from services.common.notify import Notifier
from services.common.stats import Metrics
from services.common.protocol.tensors import TensorError

log = logging.getLogger(__name__)
MAX_BATCH_SIZE = 1 << 20
# A StreamBatches stream ends itself (OK, after every batch written) once it has served this long,
# and the learner opens the next at once. The server's max connection age (services/common/net/grpcutil.py:
# 300 s, then 30 s of grace) would otherwise cancel a long-lived stream mid-write every few minutes,
# leaving the batch on the wire unsent (taken back: buffer/batches_unsent_total) and losing any it
# had written that the learner had not read yet. Well inside the grace, so a stream never outlives it.
BATCH_STREAM_S = 20.0
# WatchInsertLimit sends at most one InsertLimit per this interval per actor, and re-reads the limit
# at least this often (LIMIT_RECHECK_S) when nothing wakes it (a learner's report expiring moves it).
LIMIT_INTERVAL_S = 0.01
LIMIT_RECHECK_S = 1.0
# A draining shard is drained only after this long with no fragment received, no push stream open and
# no actor watching: an actor that moved away may still be pushing its last fragments here (it moves
# its insert-limit stream at once, its pusher only once what it queued for this shard is acknowledged).
DRAIN_QUIET_S = 2.0


class BufferServicer(buffer_pb2_grpc.BufferServicer):
    def __init__(self, store: Store, metrics: Metrics, owner: StoreOwner | None = None):
        self.store, self.metrics = store, metrics
        self.run = owner or StoreOwner(threaded=False)   # every call on `store` goes through it
        self.inserted = Notifier()
        self.changed = Notifier()  # what the insert limit is computed from moved (WatchInsertLimit)
        self.closing = False
        # Actors with an insert-limit stream open (each opens one as it starts and keeps it): the
        # live actors, which an actor without an index counts to pick the least loaded shard.
        self._watching: Counter[str] = Counter()
        metrics.add_gauges(lambda: {"buffer/actors_live": float(len(self._watching))})
        self._reading: set[asyncio.Task] = set()   # push streams waiting for their next message
        self._ended: set[asyncio.Task] = set()     # ... that `close` woke to send their ack
        # The shard list the planner set (generation 0: none) and this shard's place in it.
        self.topology = buffer_pb2.BufferTopology()
        self.shard: int | None = None
        self._pushing = 0                          # push streams open
        self._last_received = time.monotonic()
        self._drained_at_generation = 0   # (the generation a drained shard last said so under, logged once)
        metrics.inc("buffer/samples_evicted_on_drain_total", 0)
        metrics.add_gauges(lambda: {"buffer/topology_generation": float(self.topology.generation),
                                    "buffer/draining": float(self.draining)})

    @property
    def draining(self) -> bool:
        """The planner set a topology in which this shard is past the active ones."""
        return self.shard is not None and self.shard >= self.topology.active

    def close(self) -> None:
        """Start the shutdown: refuse new pushes and batch streams, and end every push stream now
        with its PushAck for what it stored, instead of leaving it to the server's grace period
        (which cancels it, unacknowledged: its sender would re-send to the next buffer what this one
        took, and a learner may already have trained on it)."""
        self.closing = True
        self.inserted.notify()
        self.changed.notify()
        for task in list(self._reading):
            self._ended.add(task)
            task.cancel()

    async def PushTrajectories(self, request_iterator, context) -> buffer_pb2.PushAck:
        """Fragments arrive as serialized bytes (see `add_to_server`) and are read without copying.

        The stream ends with a PushAck when its sender half-closes it or when the buffer shuts down
        (`close`); either way everything it stored is acknowledged (`high_water_seq`)."""
        ack = buffer_pb2.PushAck()
        task = asyncio.current_task()
        messages = aiter(request_iterator)
        self._pushing += 1
        try:
            return await self._read_pushes(messages, ack, task, context)
        finally:
            self._pushing -= 1
            self._last_received = time.monotonic()

    async def _read_pushes(self, messages, ack: buffer_pb2.PushAck, task, context) -> buffer_pb2.PushAck:
        sender = None  # (actor_id, incarnation) of the last fragment read
        index = -1     # position of the message in this stream, from 0
        while True:
            if self.closing:
                if sender is None:  # nothing stored from this stream: the sender retries elsewhere
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "buffer is shutting down")
                break
            self._reading.add(task)
            try:
                data = await anext(messages)
            except StopAsyncIteration:
                break
            except asyncio.CancelledError:
                if task not in self._ended:
                    raise
                task.uncancel()  # `close` ended the stream: answer with the ack below
                break
            finally:
                self._reading.discard(task)
                self._ended.discard(task)
            index += 1
            msg = RawFragment(data)
            try:
                outcome = await self.run(self.store.insert, msg)
            except TensorError as err:
                self.metrics.inc("buffer/fragments_invalid_total")
                log.warning("refused fragment seq %d from %r: %s", msg.seq, msg.actor_id[:MAX_ID_LEN], err)
                # Its position in the stream identifies it even when its bytes do not parse: the
                # sender forgets what came before it (processed), drops it, and re-sends the rest.
                md = [("kuberl-accepted", str(ack.accepted)), ("kuberl-rejected-index", str(index))]
                if msg.error is None:  # bytes that do not parse cannot be trusted to name their seq
                    md.append(("kuberl-rejected-seq", str(msg.seq)))
                if ack.HasField("last_accepted_seq"):
                    md.append(("kuberl-last-accepted-seq", str(ack.last_accepted_seq)))
                context.set_trailing_metadata(md)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"kuberl.v1.Buffer/PushTrajectories: fragment seq {msg.seq}: {err}")
            sender = (msg.actor_id, msg.incarnation)
            if outcome is Outcome.ACCEPTED:
                ack.accepted += 1
                ack.last_accepted_seq = max(msg.seq, ack.last_accepted_seq) if ack.HasField(
                    "last_accepted_seq") else msg.seq
                self.inserted.notify()
                self.changed.notify()
            elif outcome is Outcome.DUPLICATE:
                ack.duplicates += 1
            else:  # counted by the store under its reason (buffer/fragments_too_old_total)
                ack.rejected += 1
        if sender is not None and (high := await self.run(self.store.high_water, *sender)) is not None:
            ack.high_water_seq = high
        return ack

    async def StreamBatches(self, request: buffer_pb2.BatchRequest, context):
        if not 0 < len(request.learner_id) <= MAX_ID_LEN:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"learner_id: must be 1..{MAX_ID_LEN} characters")
        if request.algorithm != self.store.algorithm.code:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"algorithm: request is for {algorithms.name_of(request.algorithm)}"
                                f" but this buffer serves {self.store.algorithm.name}")
        if not 0 < request.batch_size <= MAX_BATCH_SIZE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"batch_size: {request.batch_size} is outside 1..{MAX_BATCH_SIZE}")
        log.debug("learner %s streaming batches of %d", request.learner_id, request.batch_size)
        sent, ends = 0, time.monotonic() + BATCH_STREAM_S
        while not self.closing and (request.max_batches == 0 or sent < request.max_batches):
            if sent and time.monotonic() >= ends:
                return   # a clean end: the learner reads what was written, then opens the next stream
            batch, why = await self.run(self._cut, request.batch_size, request.learner_id, urgent=True,
                                        orphan=lambda cut: self._unsent(cut[0], request.learner_id))
            if batch is None:
                if time.monotonic() >= ends:
                    return
                started = time.monotonic()
                await self.inserted.wait(timeout=1.0)
                if why == "paced":
                    self.metrics.inc("buffer/paced_seconds_total", time.monotonic() - started)
                continue
            batch.batch_id = sent
            self.changed.notify()  # served moved: actors held by the limiter may go on
            try:
                await context.write(batch)
            except (asyncio.CancelledError, Exception) as err:
                # The learner went away with this batch unsent: the store takes it back.
                # (Any exception: what grpcio raises for a write to a call that its peer already
                # ended, UsageError or ExecuteBatchError, has no public type; whatever the cause,
                # the batch was not delivered.)
                self.run.post(self._unsent, batch, request.learner_id)
                log.info("learner %s went away (%r); batch %d (%d samples) was not delivered",
                         request.learner_id, err, sent, batch_samples(batch))
                if isinstance(err, asyncio.CancelledError):
                    raise
                return
            sent += 1

    def _cut(self, batch_size: int, learner_id: str) -> tuple[pb.TrainingBatch | None, str]:
        """(the next batch for `learner_id`, or None and why not); on the store's owner."""
        batch = self.store.next_batch(batch_size, learner_id)
        return batch, "" if batch is not None else self.store.wait_reason

    def _unsent(self, batch: pb.TrainingBatch | None, learner_id: str) -> None:
        """A batch cut for a learner that went away before it was sent: nothing of it is lost
        (Store.unserve). On the store's owner."""
        if batch is not None:
            self.store.unserve(learner_id, batch)

    async def ReportProgress(self, request: buffer_pb2.LearnerProgress, context) -> buffer_pb2.ProgressAck:
        if not 0 < len(request.learner_id) <= MAX_ID_LEN:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"learner_id: must be 1..{MAX_ID_LEN} characters")
        ack = await self.run(self._progress, request, urgent=True)
        self.inserted.notify()  # a newer version may make queued fragments stale
        self.changed.notify()   # batches trained on, and a new learner, move the insert limit
        if self.topology.generation:
            ack.topology.CopyFrom(self.topology)
        return ack

    def _progress(self, request: buffer_pb2.LearnerProgress) -> buffer_pb2.ProgressAck:
        store = self.store
        store.report_progress(request.learner_id, request.policy_version, request.batches_consumed_total)
        return buffer_pb2.ProgressAck(samples_inserted_total=store.inserted_samples,
                                      warmup_samples=min(store.limiter.warmup, store.inserted_samples))

    async def SetTopology(self, request: buffer_pb2.SetTopologyRequest, context) -> buffer_pb2.TopologyAck:
        """Take a newer shard list from the planner (older ones are ignored); report whether this shard,
        if it drains, is drained (`drained`)."""
        t = request.topology
        problem = topology_problem(t, request.shard)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kuberl.v1.Buffer/SetTopology: {problem}")
        if t.generation > self.topology.generation:
            was = self.draining
            self.topology.CopyFrom(t)
            self.shard = request.shard
            log.info("topology %d: shard %d of %d (%d active)%s", t.generation, request.shard, len(t.addresses),
                     t.active, ": draining" if self.draining else "")
            if self.draining and not was:
                self._last_received = time.monotonic()
            self.changed.notify()   # actors hear it on their insert-limit streams
        ack = buffer_pb2.TopologyAck(generation=self.topology.generation, draining=self.draining,
                                     actors_live=len(self._watching))
        ack.drained = self.draining and await self.run(self._drained)
        if ack.drained and self._drained_at_generation != self.topology.generation:
            self._drained_at_generation = self.topology.generation
            log.info("drained: no actor watches or pushes, nothing left to serve (generation %d)",
                     self.topology.generation)
        ack.size_samples = self.store.size
        if self.topology.generation:
            ack.topology.CopyFrom(self.topology)
        return ack

    def _drained(self) -> bool:
        """(On the store's owner.) Whether a draining shard is done: no actor watches it or pushes to it (none has for
        DRAIN_QUIET_S), it holds nothing to serve, and every batch it served a live learner has been
        reported consumed (one still in a stream's buffers would be lost with the stream). A FIFO drains
        by serving what it holds; a replay's samples are not served out (each would be sampled many
        times more), so they are counted as evicted, buffer/samples_evicted_on_drain_total, and the
        replay is emptied."""
        if self._watching or self._pushing or time.monotonic() - self._last_received < DRAIN_QUIET_S:
            return False
        if self.store.in_flight_total():
            return False
        if self.store.replay is not None and self.store.size:
            evicted = self.store.evict_all()
            self.metrics.inc("buffer/samples_evicted_on_drain_total", evicted)
            log.info("drained: %d replay samples counted as evicted (buffer/samples_evicted_on_drain_total)", evicted)
        return self.store.size == 0

    async def WatchInsertLimit(self, request: buffer_pb2.InsertLimitRequest, context):
        """Stream the insert limit to one actor: at once, then on every change, at most one message
        per LIMIT_INTERVAL_S (docs/rate-limiter.md)."""
        if not 0 < len(request.actor_id) <= MAX_ID_LEN:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"actor_id: must be 1..{MAX_ID_LEN} characters")
        sent, told = None, 0   # the last limit written, and the generation of the shard list it carried
        self._watching[request.actor_id] += 1
        try:
            while not self.closing:
                waiter = self.changed.waiter()  # taken before reading: a change in between is not missed
                msg = await self.run(self._insert_limit, request.actor_id, request.incarnation, urgent=True)
                if msg != sent or self.topology.generation != told:
                    out = msg
                    if self.topology.generation != told:   # the shard list once per change, not in every limit
                        out = buffer_pb2.InsertLimit()
                        out.CopyFrom(msg)
                        out.topology.CopyFrom(self.topology)
                        told = self.topology.generation
                    await context.write(out)
                    sent = msg
                    await asyncio.sleep(LIMIT_INTERVAL_S)
                    continue
                try:
                    async with asyncio.timeout(LIMIT_RECHECK_S):
                        await waiter.wait()
                except TimeoutError:
                    pass
        finally:
            self._watching[request.actor_id] -= 1
            if self._watching[request.actor_id] <= 0:
                del self._watching[request.actor_id]

    def _insert_limit(self, actor_id: str, incarnation: int) -> buffer_pb2.InsertLimit:
        """(On the store's owner.)"""
        store = self.store
        msg = buffer_pb2.InsertLimit(samples_inserted_total=store.inserted_samples,
                                     samples_served_total=store.served_samples,
                                     replay_ratio_target=store.limiter.ratio)
        if (limit := store.insert_limit()) is not None:
            msg.insert_limit_samples = max(0, limit)
        if (high := store.high_water(actor_id, incarnation)) is not None:
            msg.high_water_seq = high
        return msg

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        return await self.run(self.metrics.response, urgent=True)   # (the store's gauges, read between its calls)


def topology_problem(t: buffer_pb2.BufferTopology, shard: int) -> str:
    """What is wrong with a SetTopology request, in words naming the field; "" when nothing is."""
    n = len(t.addresses)
    if n == 0:
        return "topology.addresses: empty (list every shard, in shard order)"
    try:
        buffer_addresses(",".join(t.addresses))
    except ValueError as err:
        return f"topology.addresses: {err}"
    if not 0 < t.active <= n:
        return f"topology.active: {t.active} is outside 1..{n} (the shards listed)"
    if shard >= n:
        return f"shard: {shard} is outside 0..{n - 1} (the shards listed)"
    return ""


def add_to_server(servicer: buffer_pb2_grpc.BufferServicer, server) -> None:
    """Register the Buffer service as every service does (`grpcutil.add_handlers`: frames that do not
    parse get INVALID_ARGUMENT), except that PushTrajectories gets each fragment as the serialized
    bytes (no deserializer), which `RawFragment` reads without copying the tensor payloads: on
    loopback that is most of what a push costs the buffer. It refuses malformed bytes itself."""
    service, handlers = generated_handlers(buffer_pb2.DESCRIPTOR.services_by_name["Buffer"], servicer)
    handlers["PushTrajectories"] = grpc.stream_unary_rpc_method_handler(
        servicer.PushTrajectories, request_deserializer=None,
        response_serializer=buffer_pb2.PushAck.SerializeToString)
    add_handlers(server, service, handlers)
