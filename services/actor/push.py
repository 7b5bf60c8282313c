"""Pushes fragments to the buffer over client streams, through a bounded queue, never blocking stepping.

Delivery: each stream is half-closed to receive a PushAck every `ack_interval_s`, or sooner once
`capacity` fragments are unacknowledged; fragments written but not yet acknowledged stay in
`unacked` and are re-sent on the next stream after a failure (the buffer's (actor_id, seq) dedupe
makes that safe). When `capacity` fragments wait unsent, the oldest unsent one is dropped and counted
in `actor/fragments_dropped_total`: the actor never waits for the network.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import grpc

from kuberl.v1 import buffer_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.common.grpcutil import Backoff, describe, raise_if_cancelling
from services.common.stats import Metrics

log = logging.getLogger(__name__)


async def _write(call, msg: pb.TrajectoryFragment) -> None:
    """Write one message; if the RPC already ended (peer gone, or it refused the stream), raise the
    AioRpcError carrying its real status instead of grpc.aio's bare InvalidStateError."""
    try:
        await call.write(msg)
    except asyncio.InvalidStateError:
        await call  # a finished call with a non-OK status raises AioRpcError here
        raise


class Pusher:
    def __init__(self, stub: buffer_pb2_grpc.BufferStub, capacity: int, ack_interval_s: float,
                 metrics: Metrics):
        self.stub, self.capacity, self.ack_interval_s, self.metrics = stub, capacity, ack_interval_s, metrics
        self.queue: deque[pb.TrajectoryFragment] = deque()
        self.unacked: deque[pb.TrajectoryFragment] = deque()
        self._wake = asyncio.Event()
        metrics.track_rate("actor/fragments_pushed_per_s", "actor/fragments_pushed_total")
        metrics.track_rate("actor/samples_pushed_per_s", "actor/samples_pushed_total")
        for name in ("dropped", "rejected", "resent", "acked"):
            metrics.inc(f"actor/fragments_{name}_total", 0)

    @property
    def pending(self) -> int:
        """Fragments not yet acknowledged by the buffer (unsent or in flight)."""
        return len(self.queue) + len(self.unacked)

    def enqueue(self, msg: pb.TrajectoryFragment) -> None:
        """Queue a fragment (event-loop thread). Drops, and counts, the oldest unsent one when full."""
        while len(self.queue) >= self.capacity:
            self.queue.popleft()
            self.metrics.inc("actor/fragments_dropped_total")
        self.queue.append(msg)
        self.metrics.set("actor/push_queue_fragments", len(self.queue))
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
        call = self.stub.PushTrajectories(timeout=self.ack_interval_s + 30.0)
        for msg in list(self.unacked):  # whatever the last broken stream may not have delivered
            await _write(call, msg)
            self.metrics.inc("actor/fragments_resent_total")
        deadline = loop.time() + self.ack_interval_s
        while loop.time() < deadline and len(self.unacked) < self.capacity:
            if not self.queue:
                if stopping.is_set():
                    break
                await self._wait(stopping, deadline - loop.time())
                continue
            msg = self.queue.popleft()
            self.unacked.append(msg)
            await _write(call, msg)
            self.metrics.inc("actor/fragments_pushed_total")
            self.metrics.inc("actor/samples_pushed_total", msg.num_steps * len(msg.env_ids))
        await call.done_writing()
        ack = await call
        if ack.HasField("high_water_seq"):
            self._forget_through(ack.high_water_seq)
        self.metrics.set("actor/push_queue_fragments", len(self.queue))

    def _forget_through(self, seq: int) -> None:
        while self.unacked and self.unacked[0].seq <= seq:
            self.unacked.popleft()
            self.metrics.inc("actor/fragments_acked_total")

    def _rejected(self, err: grpc.aio.AioRpcError) -> None:
        """The buffer refused a fragment as malformed: drop it (counted), keep the rest for re-send.

        The buffer names the refused seq in trailing metadata; without it nothing tells which of
        the unacknowledged fragments was bad, so all of them are dropped (and counted) rather than
        re-sent into the same refusal forever.
        """
        md = dict(err.trailing_metadata() or ())
        if "kuberl-last-accepted-seq" in md:
            self._forget_through(int(md["kuberl-last-accepted-seq"]))
        if "kuberl-rejected-seq" in md:
            bad = int(md["kuberl-rejected-seq"])
            keep = deque(m for m in self.unacked if m.seq != bad)
        else:
            bad, keep = None, deque()
        self.metrics.inc("actor/fragments_rejected_total", len(self.unacked) - len(keep))
        self.unacked = keep
        log.error("buffer rejected fragment seq %s: %s", bad, err.details())
