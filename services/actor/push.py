"""Pushes fragments to the buffer over client streams, through a bounded queue, never blocking stepping.

Delivery: each stream is half-closed to receive a PushAck every `ack_interval_s`, or sooner once
`capacity` fragments are unacknowledged; fragments written but not yet acknowledged stay in
`unacked` and are re-sent on the next stream after a failure (the buffer's (actor_id, seq) dedupe
makes that safe). When `capacity` fragments, or `max_bytes`, wait unsent, the oldest unsent one is
dropped and counted in `actor/fragments_dropped_total`: the actor never waits for the network.

Fragments travel as bytes serialized once, by whoever cut them (the rollout thread, with
`encode_fragment`), and are written to the stream as they are: the event loop never re-encodes a payload.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import grpc

from kuberl.v1 import buffer_pb2
from kuberl.v1 import common_pb2 as pb
from services.common.protocol.fragments import DEDUPE_WINDOW, EncodedFragment
from services.common.net.grpcutil import Backoff, describe, raise_if_cancelling
from services.common.stats import Metrics

log = logging.getLogger(__name__)


PUSH_METHOD = "/kuberl.v1.Buffer/PushTrajectories"


async def _write(call, item: EncodedFragment) -> bool:
    """Write one message; False if the buffer already ended the stream with its ack (it is shutting
    down: the message was not delivered). If the RPC failed (peer gone, or it refused the stream),
    raise the AioRpcError carrying its real status instead of grpc.aio's bare InvalidStateError.

    A write in flight when the buffer's ack arrives fails in grpcio with an AioRpcError of grpcio's
    own making (INTERNAL, "Internal error from Core": its send failed), not the status the buffer
    sent. Taken as the stream's outcome, it would leave the ack unread and everything the buffer
    stored from this stream to be re-sent to the next one; so the call itself is awaited: its ack,
    or the error it really ended with."""
    if call.done():
        await call  # a finished call with a non-OK status raises AioRpcError here
        return False
    try:
        await call.write(item.payload)
    except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
        await call
        return False
    return True


class Pusher:
    def __init__(self, channel: grpc.aio.Channel, capacity: int, ack_interval_s: float, metrics: Metrics,
                 max_bytes: int = 64 << 20):
        # PushTrajectories with the payload already serialized (no request serializer).
        self.push = channel.stream_unary(PUSH_METHOD, request_serializer=None,
                                         response_deserializer=buffer_pb2.PushAck.FromString)
        self.capacity, self.ack_interval_s, self.metrics, self.max_bytes = capacity, ack_interval_s, metrics, max_bytes
        self.queue: deque[EncodedFragment] = deque()
        self.queued_bytes = 0      # payload bytes in `queue`
        self.unacked_bytes = 0     # payload bytes in `unacked`
        self.unacked: deque[EncodedFragment] = deque()
        self._written: list[EncodedFragment] = []  # the current stream's messages, in the order written
        self._wake = asyncio.Event()
        metrics.track_rate("actor/fragments_pushed_per_s", "actor/fragments_pushed_total")
        metrics.track_rate("actor/samples_pushed_per_s", "actor/samples_pushed_total")
        metrics.track_rate("actor/bytes_pushed_per_s", "actor/bytes_pushed_total")
        for name in ("dropped", "rejected", "resent", "acked"):
            metrics.inc(f"actor/fragments_{name}_total", 0)
        metrics.inc("actor/push_stream_errors_total", 0)
        for name in ("dropped", "rejected"):
            metrics.inc(f"actor/samples_{name}_total", 0)
        self._gauge_queue()

    def drop_pending(self) -> int:
        """Give up on everything not acknowledged (the buffer stayed unreachable at shutdown): count
        it as dropped, fragments and samples; returns the number of fragments."""
        gone = list(self.queue) + list(self.unacked)
        self.metrics.inc("actor/fragments_dropped_total", len(gone))
        self.metrics.inc("actor/samples_dropped_total", sum(m.samples for m in gone))
        self.queue.clear()
        self.unacked.clear()
        self.queued_bytes = self.unacked_bytes = 0
        return len(gone)

    @property
    def pending(self) -> int:
        """Fragments not yet acknowledged by the buffer (unsent or in flight)."""
        return len(self.queue) + len(self.unacked)

    def enqueue(self, msg: EncodedFragment | pb.TrajectoryFragment) -> None:
        """Queue a fragment (event-loop thread). Drops, and counts, the oldest unsent one when full.

        Pass an `EncodedFragment` serialized off the loop; a message is serialized here."""
        if not isinstance(msg, EncodedFragment):
            msg = EncodedFragment.of(msg)
        while self.queue and (len(self.queue) >= self.capacity
                              or self.queued_bytes + len(msg.payload) > self.max_bytes):
            old = self.queue.popleft()
            self.queued_bytes -= len(old.payload)
            self.metrics.inc("actor/fragments_dropped_total")
            self.metrics.inc("actor/samples_dropped_total", old.samples)
        self.queue.append(msg)
        self.queued_bytes += len(msg.payload)
        self._gauge_queue()
        self._wake.set()

    async def run(self, stopping: asyncio.Event) -> None:
        """Push until `stopping` is set and everything queued has been acknowledged."""
        backoff = Backoff()
        while not (stopping.is_set() and self.pending == 0):
            if self.pending == 0:
                await self._wait(stopping, None)
                continue
            try:
                await self._stream(stopping)
                backoff.reset()
            except grpc.aio.AioRpcError as err:
                raise_if_cancelling(err)
                if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    self._rejected(err)
                else:
                    self.metrics.inc("actor/push_stream_errors_total")
                    log.warning("push stream to buffer failed (%s); %d fragments pending, retrying",
                                describe(err), self.pending)
                    await backoff.sleep()

    async def _wait(self, stopping: asyncio.Event, timeout: float | None) -> None:
        self._wake.clear()
        waiters = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(stopping.wait())]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def _stream(self, stopping: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        call = self.push(timeout=self.ack_interval_s + 30.0)
        call.add_done_callback(lambda _: self._wake.set())  # a buffer shutting down acks early
        self._written = []
        open_ = True
        for msg in list(self.unacked):  # whatever the last broken stream may not have delivered
            self._written.append(msg)
            if not (open_ := await _write(call, msg)):
                break
            self.metrics.inc("actor/fragments_resent_total")
        deadline = loop.time() + self.ack_interval_s
        while open_ and loop.time() < deadline and len(self.unacked) < self.capacity \
                and self.unacked_bytes < self.max_bytes:
            if call.done():
                break
            if not self.queue:
                if stopping.is_set():
                    break
                await self._wait(stopping, deadline - loop.time())
                continue
            msg = self.queue.popleft()
            self.queued_bytes -= len(msg.payload)
            self.unacked.append(msg)
            self.unacked_bytes += len(msg.payload)
            self._written.append(msg)
            if not (open_ := await _write(call, msg)):
                break   # not delivered: it stays unacknowledged, for the next stream
            self.metrics.inc("actor/fragments_pushed_total")
            self.metrics.inc("actor/samples_pushed_total", msg.samples)
            self.metrics.inc("actor/bytes_pushed_total", len(msg.payload))
        if not call.done():
            await call.done_writing()
        ack = await call
        written, self._written = self._written, []  # acknowledged: nothing of it is needed again
        if ack.rejected:
            # Seqs the buffer could no longer dedupe (more than DEDUPE_WINDOW behind this incarnation's
            # newest): refused, not stored. Config keeps the send queue inside the window, so only a
            # sender that broke that bound sees this; counted, never taken as delivered.
            floor = ack.high_water_seq - DEDUPE_WINDOW if ack.HasField("high_water_seq") else -1
            self.metrics.inc("actor/fragments_rejected_total", ack.rejected)
            self.metrics.inc("actor/samples_rejected_total", sum(m.samples for m in written if m.seq <= floor))
            log.error("buffer refused %d fragments as too old to deduplicate", ack.rejected)
        if ack.HasField("high_water_seq"):
            self._forget_through(ack.high_water_seq, refused=ack.rejected)
        self._gauge_queue()

    def _gauge_queue(self) -> None:
        self.metrics.set("actor/push_queue_fragments", len(self.queue))
        # The share of this queue's own bound in use (fragments or bytes, whichever is nearer): the
        # planner's evidence of a communication bottleneck, right whatever config this actor runs.
        self.metrics.set("actor/push_queue_fill", max(len(self.queue) / self.capacity,
                                                      self.queued_bytes / self.max_bytes))

    def _forget_through(self, seq: int, refused: int = 0) -> None:
        """Forget the unacknowledged fragments up to `seq`: acknowledged, but for `refused` of them."""
        forgotten = 0
        while self.unacked and self.unacked[0].seq <= seq:
            self.unacked_bytes -= len(self.unacked.popleft().payload)
            forgotten += 1
        self.metrics.inc("actor/fragments_acked_total", max(0, forgotten - refused))

    def _rejected(self, err: grpc.aio.AioRpcError) -> None:
        """The buffer refused a fragment as malformed: drop it (counted), keep the rest for re-send.

        The buffer names the refused message's position in the stream (`kuberl-rejected-index`):
        everything written before it was processed (stored, or counted by the buffer as a duplicate)
        and is forgotten, it is dropped, and what came after it is re-sent on the next stream. An
        older buffer may name only the refused seq, or nothing; then, without a way to tell which
        fragment was bad, every unacknowledged one is dropped (and counted) rather than re-sent
        into the same refusal forever.
        """
        md = dict(err.trailing_metadata() or ())
        index = int(md.get("kuberl-rejected-index", -1))
        if 0 <= index < len(self._written):
            bad = self._written[index]
            done = {id(m) for m in self._written[:index + 1]}
            keep = deque(m for m in self.unacked if id(m) not in done)
            self.metrics.inc("actor/fragments_acked_total", len(self.unacked) - len(keep) - 1)
            self.metrics.inc("actor/fragments_rejected_total")
            self.metrics.inc("actor/samples_rejected_total", bad.samples)
            bad = bad.seq
        else:
            if "kuberl-last-accepted-seq" in md:
                self._forget_through(int(md["kuberl-last-accepted-seq"]))
            if "kuberl-rejected-seq" in md:
                bad = int(md["kuberl-rejected-seq"])
                keep = deque(m for m in self.unacked if m.seq != bad)
            else:
                bad, keep = None, deque()
            self.metrics.inc("actor/fragments_rejected_total", len(self.unacked) - len(keep))
            self.metrics.inc("actor/samples_rejected_total", sum(m.samples for m in self.unacked) -
                             sum(m.samples for m in keep))
        self.unacked = keep
        self.unacked_bytes = sum(len(m.payload) for m in keep)
        self._written = []
        log.error("buffer rejected fragment seq %s: %s", bad, err.details())
