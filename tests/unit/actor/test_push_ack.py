"""The actor's Pusher (services/actor/push.py) reads the ack of a push stream that the buffer ended while
a write was in flight (a buffer stopped with SIGTERM), instead of taking grpcio's failed write for the
stream's outcome: what that buffer stored is acknowledged, and only the rest goes to the next stream.
The streams are fakes standing for grpcio's calls, so the interleaving is fixed, not raced."""

from __future__ import annotations

import asyncio

import grpc

from kuberl.v1 import buffer_pb2
from services.actor.push import Pusher
from services.common.protocol.fragments import EncodedFragment
from services.common.stats import Metrics


def frag(seq: int) -> EncodedFragment:
    return EncodedFragment(seq=seq, samples=16, payload=f"fragment {seq}".encode())


class Stream:
    """A push stream to a buffer that stores the messages written to it and, after `ends_after` of
    them, ends the stream with its ack: the next write fails as grpcio fails it, with a status of its
    own (INTERNAL), while awaiting the call gives the ack the buffer sent. `ends_after` None: the
    stream stays open until the sender half-closes it."""

    def __init__(self, ends_after: int | None = None):
        self.ends_after = ends_after
        self.stored: list[bytes] = []
        self.ended = False

    def add_done_callback(self, callback) -> None:
        pass

    def done(self) -> bool:
        return self.ended

    async def write(self, payload: bytes) -> None:
        if self.ended or len(self.stored) == self.ends_after:
            self.ended = True
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, details="Internal error from Core")
        self.stored.append(payload)

    async def done_writing(self) -> None:
        self.ended = True

    async def _ack(self) -> buffer_pb2.PushAck:
        seqs = [int(p.split()[1]) for p in self.stored]
        return buffer_pb2.PushAck(accepted=len(seqs), high_water_seq=max(seqs))

    def __await__(self):
        return self._ack().__await__()


class Channel:
    """Hands out the given streams, one per call."""

    def __init__(self, *streams: Stream):
        self.streams = list(streams)

    def stream_unary(self, *args, **kwargs):
        return lambda **kw: self.streams.pop(0)


async def test_a_write_the_buffers_ack_overtakes_leaves_unacknowledged_only_what_it_did_not_store():
    old, new = Stream(ends_after=2), Stream()   # the old buffer stores 0 and 1, then ends with its ack
    metrics = Metrics("actor")
    pusher = Pusher(Channel(old, new), capacity=64, ack_interval_s=3600.0, metrics=metrics)
    for seq in range(4):
        pusher.enqueue(frag(seq))
    stopping = asyncio.Event()
    stopping.set()   # half-close each stream as soon as the queue is written
    await pusher.run(stopping)
    assert old.stored == [b"fragment 0", b"fragment 1"]
    assert new.stored == [b"fragment 2", b"fragment 3"]   # 2 re-sent: written, not stored; 0 and 1 never
    assert metrics.counters["actor/fragments_resent_total"] == 1
    assert metrics.counters["actor/fragments_acked_total"] == 4
    assert metrics.counters["actor/push_stream_errors_total"] == 0
    assert pusher.pending == 0
