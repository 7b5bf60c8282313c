"""Planner commands: `kuberl plan`, `kuberl scale ROLE N`, `kuberl pause`, `kuberl resume`, `kuberl decisions`.

Each talks to a planner's gRPC API (--planner, default $KUBERL_PLANNER or 127.0.0.1:50054; `kuberl up`
prints its planner's address). Decisions print as one line each, or as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import grpc
from google.protobuf.json_format import MessageToDict

from kuberl.v1 import planner_pb2 as ppb
from kuberl.v1 import planner_pb2_grpc
from services.cli.client import client_channel
from services.common.service.runtime import add_client_arguments

ACTION = {ppb.DECISION_ACTION_HOLD: "hold", ppb.DECISION_ACTION_SCALE: "scale",
          ppb.DECISION_ACTION_SUPPRESSED: "suppressed"}


def _role(value: str) -> str:
    """A role `kuberl scale` names: the planner checks a policy's name against the run's."""
    if value in ("actor", "learner", "buffer") or (value.startswith("learner/") and len(value) > len("learner/")):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: expected actor, learner, buffer or learner/POLICY")


def describe(d: ppb.Decision) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(d.unix_s))
    roles = ", ".join(f"{r.role} {r.current}->{r.target}" + (f" (best {r.proposed})" if r.proposed != r.target else "")
                      + (f" @ {r.rate_per_replica:,.0f}/s each" if r.rate_per_replica else "") for r in d.roles)
    state = "applied" if d.applied else ("dry run" if d.dry_run else "not applied")
    line = f"[{when}] #{d.id} {ACTION.get(d.action, '?')} ({d.trigger}, {state}): {roles}\n    {d.reason}"
    if d.buffer_shards_target != d.buffer_shards or d.buffer_shards_reason:
        line += f"\n    buffer shards {d.buffer_shards}->{d.buffer_shards_target}: {d.buffer_shards_reason or 'held'}"
    if d.error:
        line += f"\n    error: {d.error}"
    return line


def _print(msg, as_json: bool) -> None:
    if as_json:
        print(json.dumps(MessageToDict(msg, preserving_proto_field_name=True), sort_keys=True), flush=True)
    elif isinstance(msg, ppb.Decision):
        print(describe(msg), flush=True)
    else:
        print(f"backend {msg.backend}, {'leader' if msg.leader else 'NOT the leader'}, "
              f"{'PAUSED (' + (msg.pause_reason or 'no reason') + ')' if msg.paused else 'active'}", flush=True)
        for o in msg.overrides:
            print(f"  override: {o.role} = {o.replicas} until {time.strftime('%H:%M:%S', time.localtime(o.expires_unix_s))}")
        for r in msg.replicas:
            print(f"  {r.role:8} {r.name:24} {r.address or '-':22} {'ready' if r.ready else 'not ready'}")
        if msg.HasField("last_decision"):
            print("last decision: " + describe(msg.last_decision))


def main(command: str, argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"kuberl {command}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--planner", default=os.environ.get("KUBERL_PLANNER", "127.0.0.1:50054"),
                   help="planner address host:port (default $KUBERL_PLANNER or 127.0.0.1:50054)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--timeout", type=float, default=30.0)
    if command == "plan":
        p.add_argument("--apply", action="store_true", help="apply the decision (default: preview only)")
    elif command == "scale":
        p.add_argument("role", type=_role, help="actor, learner, buffer, or learner/POLICY (one policy's learners "
                                                "in a run of several)")
        p.add_argument("replicas", type=int)
        p.add_argument("--ttl", type=float, default=3600.0, help="seconds the override holds (default 3600)")
    elif command == "unscale":
        p.add_argument("role", type=_role, help="actor, learner, buffer or learner/POLICY")
    elif command == "pause":
        p.add_argument("--reason", default="")
    elif command == "decisions":
        p.add_argument("--follow", "-f", action="store_true", help="keep printing new decisions")
        p.add_argument("--after", type=int, default=0, help="only decisions with a larger id")
    add_client_arguments(p)
    args = p.parse_args(argv)
    if command == "scale" and args.replicas < 0:
        p.error(f"replicas: {args.replicas} must be >= 0")
    with client_channel(p, args, args.planner) as channel:
        stub = planner_pb2_grpc.PlannerStub(channel)
        try:
            if command == "plan":
                _print(stub.Apply(ppb.ApplyRequest(), timeout=args.timeout) if args.apply
                       else stub.Preview(ppb.PreviewRequest(), timeout=args.timeout), args.json)
            elif command == "scale":
                _print(stub.SetReplicas(ppb.SetReplicasRequest(role=args.role, replicas=args.replicas, ttl_s=args.ttl),
                                        timeout=args.timeout), args.json)
            elif command == "unscale":
                _print(stub.ClearOverride(ppb.ClearOverrideRequest(role=args.role), timeout=args.timeout), args.json)
            elif command == "pause":
                _print(stub.Pause(ppb.PauseRequest(reason=args.reason), timeout=args.timeout), args.json)
            elif command == "resume":
                _print(stub.Resume(ppb.ResumeRequest(), timeout=args.timeout), args.json)
            elif command == "status":
                _print(stub.GetStatus(ppb.GetStatusRequest(), timeout=args.timeout), args.json)
            elif command == "decisions":
                stream = stub.WatchDecisions(ppb.WatchDecisionsRequest(after_id=args.after),
                                             timeout=None if args.follow else args.timeout)
                if not args.follow:  # print what is recorded, then stop
                    status = stub.GetStatus(ppb.GetStatusRequest(), timeout=args.timeout)
                    last = status.last_decision.id
                    if last <= args.after:
                        stream.cancel()
                        return 0
                for d in stream:
                    _print(d, args.json)
                    if not args.follow and d.id >= last:
                        stream.cancel()
                        break
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:
                return 0
            print(f"kuberl {command}: {args.planner}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return 0
