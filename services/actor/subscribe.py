"""Receives new policy weights from the learner on a background server stream.

Reconnects with backoff when the stream breaks, asking only for versions newer than the one held.
Chunks are verified (order, checksum) by WeightsAssembler; a bad version is skipped and counted.
"""

from __future__ import annotations

import logging

import grpc

from kuberl.v1 import learner_pb2, learner_pb2_grpc
from services.actor.policy import Policy
from services.common.grpcutil import Backoff, describe, raise_if_cancelling
from services.common.stats import Metrics
from services.common.tensors import TensorError
from services.common.weights import WeightsAssembler

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
                try:
                    got = assembler.add(chunk)
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
