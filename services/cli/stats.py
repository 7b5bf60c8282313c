"""`kuberl stats ADDR`: print any kuberl service's GetStats as JSON (it works out which service it is)."""

from __future__ import annotations

import argparse
import json

import grpc
from google.protobuf.json_format import MessageToDict

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc, planner_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.cli.client import client_channel
from services.common.service.runtime import add_client_arguments

NO_EPISODES = 1 << 62  # an episode cursor past any actor's count: metrics only
STUBS = (buffer_pb2_grpc.BufferStub, learner_pb2_grpc.LearnerStub, actor_pb2_grpc.ActorStub,
         planner_pb2_grpc.PlannerStub)


def get_stats(channel: grpc.Channel, timeout_s: float = 5.0, episodes_after: int = 0,
              max_episodes: int = 0) -> pb.GetStatsResponse:
    """GetStats from whichever kuberl service listens on `channel` (blocking)."""
    last: grpc.RpcError | None = None
    for stub in STUBS:
        try:
            return stub(channel).GetStats(pb.GetStatsRequest(episodes_after=episodes_after, max_episodes=max_episodes),
                                          timeout=timeout_s)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            last = err
    raise last


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kuberl stats", description=__doc__)
    p.add_argument("address", help="host:port of an actor, buffer, learner or planner")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--episodes", type=int, default=10, metavar="N",
                   help="actors: include the newest N finished episodes (default 10; 0 = none)")
    add_client_arguments(p)
    args = p.parse_args(argv)
    if args.episodes < 0:
        p.error(f"--episodes: {args.episodes} is negative")
    with client_channel(p, args, args.address) as channel:
        try:
            resp = get_stats(channel, args.timeout, episodes_after=NO_EPISODES)
            total = int(resp.metrics.get("actor/episodes_total", 0))
            if resp.role == "actor" and args.episodes and total:
                resp = get_stats(channel, args.timeout, episodes_after=max(0, total - args.episodes),
                                 max_episodes=args.episodes)
        except grpc.RpcError as err:
            print(f"kuberl stats: {args.address}: {err.code().name}: {err.details()}")
            return 1
    print(json.dumps(MessageToDict(resp, preserving_proto_field_name=True), indent=2, sort_keys=True))
    return 0
