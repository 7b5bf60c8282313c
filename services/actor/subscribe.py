"""The actor's two background server streams: new policy weights from the learner, and the insert
limit of the buffer's rate limiter.

Both reconnect with backoff when the stream breaks. Weights: only versions newer than the one held
are asked for; chunks are verified (order, checksum) by WeightsAssembler; a bad version is skipped
and counted. Insert limits go to the actor's InsertGate (limiter.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from kuberl.v1 import buffer_pb2, buffer_pb2_grpc, learner_pb2, learner_pb2_grpc
from services.actor.limiter import InsertGate
from services.actor.policy import Policy
from services.common.net.grpcutil import Backoff, describe, raise_if_cancelling
from services.common.stats import Metrics
from services.common.protocol.tensors import TensorError
from services.common.protocol.weights import WeightsAssembler

log = logging.getLogger(__name__)


async def subscribe_weights(stub: learner_pb2_grpc.LearnerStub, subscriber_id: str, policy: Policy,
                            metrics: Metrics) -> None:
    """Run until cancelled, offering each complete version to `policy`."""
    backoff = Backoff()
    latest: int | None = None
    while True:
        req = learner_pb2.WeightsRequest(subscriber_id=subscriber_id)
        if latest is not None:
            req.after_version = latest
        assembler = WeightsAssembler()
        try:
            # Long-lived by design: liveness comes from HTTP/2 keepalive, not a deadline.
            async for chunk in stub.SubscribeWeights(req):
                try:   # joining and hashing a version (megabytes for a CNN) runs off the event loop
                    got = await asyncio.to_thread(assembler.assemble) if assembler.take(chunk) else None
                except TensorError as err:
                    metrics.inc("actor/weights_invalid_total")
                    log.error("discarding weights: %s", err)
                    continue
                if got is not None:
                    latest = got[0]
                    policy.offer_weights(*got)
                    metrics.inc("actor/weights_received_total")
                    backoff.reset()
        except grpc.aio.AioRpcError as err:
            raise_if_cancelling(err)
            metrics.inc("actor/weights_stream_errors_total")
            log.log(logging.INFO if latest is None else logging.WARNING,
                    "weights stream from learner ended (%s); reconnecting", describe(err))
        await backoff.sleep()


async def watch_insert_limit(stub: buffer_pb2_grpc.BufferStub, actor_id: str, incarnation: int, gate: InsertGate,
                             metrics: Metrics,
                             on_topology: Callable[[buffer_pb2.BufferTopology], None] | None = None) -> None:
    """Run until cancelled, handing each InsertLimit of the buffer's rate limiter to `gate`, and the
    planner's shard list it carries to `on_topology` (services/actor/shardlink.py). While the stream is
    down no limit is known and `gate` holds nothing; a buffer without the RPC (an older release) is
    logged once and never asked again."""
    backoff = Backoff()
    req = buffer_pb2.InsertLimitRequest(actor_id=actor_id, incarnation=incarnation)
    while True:
        try:
            async for msg in stub.WatchInsertLimit(req):
                gate.update(msg.insert_limit_samples if msg.HasField("insert_limit_samples") else None,
                            msg.samples_inserted_total,
                            msg.high_water_seq if msg.HasField("high_water_seq") else None,
                            msg.samples_served_total, msg.replay_ratio_target)
                if on_topology is not None and msg.HasField("topology"):
                    on_topology(msg.topology)
                backoff.reset()
        except grpc.aio.AioRpcError as err:
            raise_if_cancelling(err)
            gate.clear()
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("the buffer has no rate limiter (WatchInsertLimit: %s): this actor is not held", describe(err))
                return
            metrics.inc("actor/limit_stream_errors_total")
            log.log(logging.DEBUG if err.code() == grpc.StatusCode.UNAVAILABLE else logging.INFO,
                    "insert-limit stream from buffer ended (%s); reconnecting", describe(err))
        else:
            gate.clear()
        await backoff.sleep()
