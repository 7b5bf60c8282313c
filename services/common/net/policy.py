"""Which policy a call is about, when one run trains several (config `policies`, docs/multi-agent.md
"Several policies"): the request metadata key `kuberl-policy`.

A buffer holds one table per policy and a learner trains one policy: an actor's calls to a buffer about
policy p (its pushes and insert-limit stream) and p's learners' calls (their batch streams and progress
reports) carry `kuberl-policy: p`, added to every call of a channel by `policy_interceptors`. A call without
it is about the run's only policy; a buffer of several tables refuses it, naming them."""

from __future__ import annotations

import re
from typing import Any

import grpc

METADATA_KEY = "kuberl-policy"
DEFAULT = "default"   # the one policy of a run whose config names none
NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?")   # (a DNS label of at most 32: names processes and pods)


def name_problem(name: str) -> str:
    """What is wrong with a policy name, in words; "" when nothing is."""
    if not NAME.fullmatch(name):
        return (f"{name!r} is not a policy name: 1..32 lowercase letters, digits and '-', starting and "
                f"ending with a letter or digit")
    return ""


def requested(context: Any) -> str | None:
    """The policy a server-side call names in its metadata, or None."""
    for key, value in context.invocation_metadata() or ():
        if key == METADATA_KEY:
            return str(value)
    return None


def _with_policy(details: grpc.aio.ClientCallDetails, policy: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(METADATA_KEY, policy)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, policy: str):
        self.policy = policy

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_policy(client_call_details, self.policy), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, policy: str):
        self.policy = policy

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_policy(client_call_details, self.policy), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, policy: str):
        self.policy = policy

    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_policy(client_call_details, self.policy), request_iterator)


def policy_interceptors(policy: str) -> list[Any]:
    """Channel interceptors that name `policy` in every call's metadata (grpc.aio files an interceptor
    under the first call kind it is one of, so each kind needs its own; no RPC of ours is bidirectional)."""
    return [_UnaryUnary(policy), _UnaryStream(policy), _StreamUnary(policy)]


def learner_flag(addresses: dict[str, str]) -> str:
    """An actor's --learner naming each policy's learner address (`learner_addresses` reads it back,
    for one policy as for several)."""
    return ",".join(f"{name}={address}" for name, address in addresses.items())


def learner_addresses(text: str, policies: tuple[str, ...]) -> dict[str, str]:
    """An actor's --learner for the run's `policies`: one address (a run of one policy), or
    `policy=host:port` for each policy, separated by commas. ValueError naming what is wrong."""
    if "=" not in text:
        if len(policies) > 1:
            raise ValueError(f"--learner: this run trains several policies ({', '.join(policies)}): give "
                             f"policy=host:port for each, separated by commas")
        return {policies[0]: text}
    out: dict[str, str] = {}
    for item in text.split(","):
        name, sep, address = item.strip().partition("=")
        if not sep or not address or name in out:
            raise ValueError(f"--learner: {item.strip()!r} is not policy=host:port (or names a policy twice)")
        out[name] = address
    if sorted(out) != sorted(policies):
        raise ValueError(f"--learner: names {', '.join(out)}; this run's policies are {', '.join(policies)}")
    return out
