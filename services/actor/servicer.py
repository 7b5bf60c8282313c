"""Thin gRPC adapter of the actor: GetStats, and EnvSession for external simulators."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc

from kuberl.v1 import actor_pb2, actor_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.actor.episodes import EpisodeLog
from services.actor.inference import BatchedInference
from services.actor.sessions import SessionError
from services.common.stats import Metrics
from services.common.protocol.tensors import encode

log = logging.getLogger(__name__)


class ActorServicer(actor_pb2_grpc.ActorServicer):
    def __init__(self, metrics: Metrics, episodes: EpisodeLog, seats: Mapping[str, BatchedInference] | None = None,
                 session_timeout_s: float = 30.0):
        """`seats`: where simulators' sessions are played (none: this actor steps local envs), each its own
        hub and batched inference, by its policy's tag (config.tag: "" for a run's one policy). A hello
        names its seat with `EnvHello.policy`: the policy's name, or its tag."""
        self.metrics, self.episodes = metrics, episodes
        self.seats, self.timeout_s = dict(seats or {}), session_timeout_s
        tags = next(iter(self.seats.values())).policy.cfg.tags if self.seats else {}   # (one run's policies)
        self.named = {**self.seats, **{name: self.seats[tag] for name, tag in tags.items() if tag in self.seats}}
        self.names = ", ".join(tags)
        # Every hub's sessions (a hub reports its own under its policy's scope; for a run's one policy the
        # scope is the actor's own, and both say the same).
        if self.seats:
            metrics.add_gauges(lambda: {"actor/sessions_active": float(sum(len(seat.hub.sessions)
                                                                           for seat in self.seats.values()))})

    def _seat(self, hello: actor_pb2.EnvHello) -> BatchedInference:
        """The seat `hello.policy` names (SessionError naming the field where it names none of them)."""
        if (seat := self.named.get(hello.policy)) is not None:
            return seat
        self.metrics.inc("actor/sessions_refused_total")
        raise SessionError("INVALID_ARGUMENT",
                           f"policy: {hello.policy!r} is not one of this actor's policies ({self.names})" if hello.policy
                           else f"policy: this run trains several policies ({self.names}): name the one that plays "
                                f"this session's agents (one session per policy)")

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        """Stats and one page of finished episodes after the request's cursor (see GetStatsRequest)."""
        page = self.episodes.page(request.episodes_after, request.max_episodes)
        return self.metrics.response(episodes=page.episodes, episodes_remaining=page.remaining,
                                     episodes_skipped=page.skipped, oldest_episode_index=page.oldest)

    async def EnvSession(self, request_iterator, context):
        """One simulator's session; the protocol is documented on the RPC in actor.proto."""
        if not self.seats:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this actor steps local envs; start one with env.mode: external for simulators")
        session = first = hub = None
        try:
            first = await self._read(context)
            if first is None:
                return
            if first.WhichOneof("kind") != "hello":
                raise SessionError("FAILED_PRECONDITION", "a session starts with hello")
            inference = self._seat(first.hello)
            hub = inference.hub
            session, resumed = hub.open(first.hello)
            log.info("session %s (%s, %d envs%s) %s", session.session_id, first.hello.simulator[:128],
                     session.num_envs, f", policy {hub.policy}" if hub.policy else "",
                     "resumed" if resumed else "opened")
            await context.write(actor_pb2.ActorMessage(accepted=actor_pb2.SessionAccepted(
                session_id=session.session_id, resumed=resumed, policy_version=inference.policy.version or 0,
                session_timeout_ms=int(self.timeout_s * 1000))))
            while (msg := await self._read(context)) is not None:
                if msg.WhichOneof("kind") != "step":
                    raise SessionError("FAILED_PRECONDITION", "hello may be sent only once, first")
                obs = hub.observe(session, msg.step)
                held = session.held_s
                actions, extras, version, state = await inference.act(obs, session.mask, hub.state_of(session))
                hub.record_actions(session, actions, extras, version, state)
                await context.write(actor_pb2.ActorMessage(actions=actor_pb2.ActionReply(
                    step_id=msg.step.step_id, actions=encode(hub.to_send(actions)), policy_version=version,
                    held_ms=min(int((session.held_s - held) * 1000), 2**32 - 1))))
        except SessionError as err:
            if session is not None and hub is not None:
                hub.close(session, "timeout" if err.code == "DEADLINE_EXCEEDED" else "error")
            if session is None and first is not None and first.WhichOneof("kind") == "hello":
                # Counted too (actor/sessions_refused_total); the log says who and why.
                log.warning("refused a hello from %r (session %r): %s %s", first.hello.simulator[:128],
                            first.hello.session_id[:128], err.code, err)
            else:
                log.info("session %s ended: %s %s (replies held %.1f s in all)",
                         session.session_id if session else "(no hello)", err.code, err,
                         session.held_s if session else 0.0)
            await context.abort(getattr(grpc.StatusCode, err.code), str(err))
        finally:
            if session is not None and hub is not None:
                hub.close(session, "closed")  # no-op if already closed; flushes data otherwise

    async def _read(self, context):
        """The next message, None at half-close; SessionError after session_timeout_s of silence."""
        try:
            async with asyncio.timeout(self.timeout_s):  # (not wait_for: see services/common/notify.py)
                msg = await context.read()
        except TimeoutError:
            raise SessionError("DEADLINE_EXCEEDED", f"no message for {self.timeout_s:g} s "
                                                    f"(actor.session_timeout_s); session closed") from None
        return None if msg is grpc.aio.EOF else msg
