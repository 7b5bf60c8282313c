"""Thin gRPC adapter of the planner: each RPC maps onto the Planner core."""

from __future__ import annotations

import grpc

from kuberl.v1 import common_pb2 as pb
from kuberl.v1 import planner_pb2 as ppb
from kuberl.v1 import planner_pb2_grpc
from services.common.stats import Metrics
from services.planner.core import Planner

DEFAULT_TTL_S = 3600.0
MAX_TTL_S = 7 * 24 * 3600.0
MAX_REASON = 256


class PlannerServicer(planner_pb2_grpc.PlannerServicer):
    def __init__(self, planner: Planner, metrics: Metrics):
        self.planner, self.metrics = planner, metrics

    async def Preview(self, request: ppb.PreviewRequest, context) -> ppb.Decision:
        return await self.planner.step("preview", apply=False)

    async def Apply(self, request: ppb.ApplyRequest, context) -> ppb.Decision:
        if self.planner.paused:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the planner is paused ({self.planner.pause_reason or 'no reason given'}); Resume first")
        return await self.planner.step("apply")

    async def SetReplicas(self, request: ppb.SetReplicasRequest, context) -> ppb.Decision:
        ttl = request.ttl_s or DEFAULT_TTL_S
        if not 0 < ttl <= MAX_TTL_S:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ttl_s: {request.ttl_s} must be in (0, {MAX_TTL_S:.0f}]")
        try:
            self.planner.validate_replicas(request.role, request.replicas)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return await self.planner.set_override(request.role, request.replicas, ttl)

    async def ClearOverride(self, request: ppb.ClearOverrideRequest, context) -> ppb.PlannerStatus:
        try:
            self.planner.clear_override(request.role)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return self.planner.status()

    async def Pause(self, request: ppb.PauseRequest, context) -> ppb.PlannerStatus:
        if len(request.reason) > MAX_REASON:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"reason: longer than {MAX_REASON} characters")
        self.planner.paused, self.planner.pause_reason = True, request.reason
        self.metrics.set("planner/paused", 1)
        return self.planner.status()

    async def Resume(self, request: ppb.ResumeRequest, context) -> ppb.PlannerStatus:
        self.planner.paused, self.planner.pause_reason = False, ""
        self.metrics.set("planner/paused", 0)
        return self.planner.status()

    async def WatchDecisions(self, request: ppb.WatchDecisionsRequest, context):
        after = request.after_id
        while True:
            waiter = self.planner.recorded.waiter()
            for d in list(self.planner.decisions):
                if d.id > after:
                    await context.write(d)
                    after = d.id
            if self.planner.closing:
                return
            await waiter.wait()

    async def GetStatus(self, request: ppb.GetStatusRequest, context) -> ppb.PlannerStatus:
        return self.planner.status()

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        return self.metrics.response()
