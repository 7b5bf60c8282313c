"""Thin gRPC adapter of the learner: SubscribeWeights -> WeightsHub, GetStats -> Metrics."""

from __future__ import annotations

import logging

import grpc

from kuberl.v1 import common_pb2 as pb
from kuberl.v1 import learner_pb2, learner_pb2_grpc
from services.common.protocol.fragments import MAX_ID_LEN
from services.common.stats import Metrics
from services.learner.publish import WeightsHub

log = logging.getLogger(__name__)


class LearnerServicer(learner_pb2_grpc.LearnerServicer):
    def __init__(self, hub: WeightsHub, metrics: Metrics):
        self.hub, self.metrics = hub, metrics

    async def SubscribeWeights(self, request: learner_pb2.WeightsRequest, context):
        if not 0 < len(request.subscriber_id) <= MAX_ID_LEN:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"subscriber_id: must be 1..{MAX_ID_LEN} characters")
        held = request.after_version if request.HasField("after_version") else None
        self.metrics.inc("learner/weight_subscribers", 1)
        try:
            while (chunks := await self.hub.differing_from(held)) is not None:
                for chunk in chunks:
                    await context.write(chunk)
                held = chunks[0].version
                self.metrics.inc("learner/weights_sent_total")
        finally:
            self.metrics.inc("learner/weight_subscribers", -1)

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        return self.metrics.response()
