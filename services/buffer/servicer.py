"""Thin gRPC adapter of the buffer: PushTrajectories, StreamBatches, ReportProgress, WatchInsertLimit,
SetTopology, GetStats -> the Store, the stream loops (services/buffer/loops.py) and the shard's drain
(services/buffer/drain.py). Every call on the Store goes through its StoreOwner (services/buffer/owner.py):
on the event loop, or on the thread that owns the store."""

from __future__ import annotations

import asyncio
import logging

import grpc

from kuberl.v1 import buffer_pb2, buffer_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services import algorithms
from services.buffer.drain import ShardDrain
from services.buffer.loops import serve_batches, stream_insert_limits
from services.buffer.owner import StoreOwner
from services.buffer.store import Outcome, Store
from services.common.protocol.fragments import MAX_ID_LEN, RawFragment
from services.common.net.grpcutil import add_handlers, generated_handlers
from services.common.net.shards import buffer_addresses
from services.common.notify import Notifier
from services.common.stats import Metrics
from services.common.protocol.tensors import TensorError

log = logging.getLogger(__name__)
MAX_BATCH_SIZE = 1 << 20


class BufferServicer(buffer_pb2_grpc.BufferServicer):
    def __init__(self, store: Store, metrics: Metrics, owner: StoreOwner | None = None):
        self.store, self.metrics = store, metrics
        self.run = owner or StoreOwner(threaded=False)   # every call on `store` goes through it
        self.inserted = Notifier()
        self.changed = Notifier()  # what the insert limit is computed from moved (WatchInsertLimit)
        self.closing = False
        # The shard list the planner set, this shard's place in it, the actors watching and the push
        # streams open: what its drain waits on (services/buffer/drain.py).
        self.drain = ShardDrain(store, metrics)
        self._reading: set[asyncio.Task] = set()   # push streams waiting for their next message
        self._ended: set[asyncio.Task] = set()     # ... that `close` woke to send their ack

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
        self.drain.push_opened()
        try:
            return await self._read_pushes(messages, ack, task, context)
        finally:
            self.drain.push_closed()

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
        await serve_batches(self, request, context)

    async def ReportProgress(self, request: buffer_pb2.LearnerProgress, context) -> buffer_pb2.ProgressAck:
        if not 0 < len(request.learner_id) <= MAX_ID_LEN:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"learner_id: must be 1..{MAX_ID_LEN} characters")
        ack = await self.run(self._progress, request, urgent=True)
        self.inserted.notify()  # a newer version may make queued fragments stale
        self.changed.notify()   # batches trained on, and a new learner, move the insert limit
        if self.drain.topology.generation:
            ack.topology.CopyFrom(self.drain.topology)
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
        drain = self.drain
        if drain.take(t, request.shard):
            self.changed.notify()   # actors hear it on their insert-limit streams
        ack = buffer_pb2.TopologyAck(generation=drain.topology.generation, draining=drain.draining,
                                     actors_live=drain.actors_live)
        ack.drained = drain.draining and await self.run(drain.drained)
        if ack.drained:
            drain.said_drained()
        ack.size_samples = self.store.size
        if drain.topology.generation:
            ack.topology.CopyFrom(drain.topology)
        return ack

    async def WatchInsertLimit(self, request: buffer_pb2.InsertLimitRequest, context):
        """Stream the insert limit to one actor: at once, then on every change, at most one message
        per LIMIT_INTERVAL_S (services/buffer/loops.py, docs/rate-limiter.md)."""
        if not 0 < len(request.actor_id) <= MAX_ID_LEN:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"actor_id: must be 1..{MAX_ID_LEN} characters")
        await stream_insert_limits(self, request, context)

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
