"""Thin gRPC adapter of the actor: GetStats (rates, counters and the finished-episode feed)."""

from __future__ import annotations

from kuberl.v1 import actor_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.actor.rollout import Rollout
from services.common.stats import Metrics


class ActorServicer(actor_pb2_grpc.ActorServicer):
    def __init__(self, rollout: Rollout, metrics: Metrics):
        self.rollout, self.metrics = rollout, metrics

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        return self.metrics.response(episodes=self.rollout.episodes_after(request.episodes_after))
