"""The actor's inference-only mode (`kuberl serve`): a trained policy served over `Actor.EnvSession`, an
actor that only answers.

A simulator that trained against kuberl actors (examples/, kuberl_client) connects to it unchanged and
gets the policy's actions: the same servicer (servicer.py), the same session hub and its space, step
and mask checks (sessions.py) and the same batched inference across sessions (inference.py) as an
actor with `env.mode: external`, on the same lifecycle (services/common/service/lifecycle.py). What an actor
does for training it does not do: its hub has no fragment sink, so no transitions are kept, no
fragment is cut and nothing is pushed; it needs no buffer and no learner. With a learner to follow,
it subscribes to its weights stream as actors do (`FittingWeights` guards what is swapped in).
`kuberl serve` (services/cli/serve.py) loads the checkpoint into a Policy and runs `serving`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import numpy as np

from kuberl.v1 import actor_pb2, learner_pb2_grpc
from services.actor.episodes import EpisodeLog
from services.actor.inference import BatchedInference
from services.actor.policy import Policy
from services.actor.servicer import ActorServicer
from services.actor.sessions import SessionHub
from services.actor.subscribe import subscribe_weights
from services.common.net.grpcutil import MiB, add_servicer, make_channel
from services.common.net.policy import learner_addresses
from services.common.service.lifecycle import Lifecycle
from services.common.service.runtime import Endpoints
from services.common.stats import Metrics
from services.config import ExperimentConfig

log = logging.getLogger(__name__)
SHUTDOWN_DEADLINE_S = 10.0


def serving_config(trained: ExperimentConfig, own: ExperimentConfig) -> ExperimentConfig:
    """The checkpoint's config with the serving process's own `tls`, `auth` and `actor` sections. Pacing
    (`actor.fragments_per_version`) is off: nothing is recorded, so there is nothing to pace, and a
    training config's setting must not be checked against another algorithm's checkpoint."""
    return dataclasses.replace(trained, tls=own.tls, auth=own.auth,
                               actor=dataclasses.replace(own.actor, fragments_per_version=0))


def _misfit(got: dict[str, tuple], want: dict[str, tuple]) -> str:
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    if missing or extra:
        return f"its tensors are another network's (missing {missing[:3]}, unexpected {extra[:3]})"
    name = next(k for k in want if got[k] != want[k])
    return f"{name} is {list(got[name])}, the checkpoint's network has {list(want[name])}"


class FittingWeights:
    """What `subscribe_weights` offers versions to: the policy, behind two checks.

    - Each version must fit the checkpoint's network (tensor names and shapes). A learner of another
      network would otherwise fail the load in the inference thread and end the process; here its
      version is refused, counted (`actor/weights_invalid_total`) and logged.
    - Unless `accept_older`, a version older than the newest served is refused and counted
      (`actor/weights_older_total`): a learner restored from an earlier checkpoint republishes older
      weights (actors take them, to stay on-policy; a served policy would regress), until it trains
      past what is served. The first refusal of a run of them is logged, and the version that ends it.

    Serving goes on with the weights it has."""

    def __init__(self, policy: Policy, learner: str, metrics: Metrics, accept_older: bool = False):
        self.policy, self.learner, self.metrics, self.accept_older = policy, learner, metrics, accept_older
        self.shapes = {k: tuple(v.shape) for k, v in policy.net.state_dict().items()}
        self.newest = policy.version   # the newest version accepted (the checkpoint's, at first)
        self.refused_older = 0         # older versions refused since the last one accepted
        for name in ("actor/weights_invalid_total", "actor/weights_older_total"):
            metrics.inc(name, 0)       # (reported from the start, as docs/metrics.md lists them)

    def offer_weights(self, version: int, arrays: dict[str, np.ndarray]) -> None:
        got = {k: tuple(np.shape(v)) for k, v in arrays.items()}
        if got != self.shapes:
            self.metrics.inc("actor/weights_invalid_total")
            log.error("refusing weights version %d from the learner at %s: %s; still serving version %s",
                      version, self.learner, _misfit(got, self.shapes), self.newest)
            return
        if not self.accept_older and self.newest is not None and version < self.newest:
            self.metrics.inc("actor/weights_older_total")
            if not self.refused_older:
                log.warning("refusing weights version %d from the learner at %s: older than version %d, served; "
                            "refusing older versions until it publishes %d or later (--accept-older takes them)",
                            version, self.learner, self.newest, self.newest)
            self.refused_older += 1
            return
        if self.refused_older:
            log.info("weights version %d from the learner at %s, after %d older versions refused",
                     version, self.learner, self.refused_older)
            self.refused_older = 0
        log.info("weights version %d from the learner at %s: swapped in at the next batch", version, self.learner)
        self.newest = version
        self.policy.offer_weights(version, arrays)


@asynccontextmanager
async def serving(policies: Mapping[str, Policy], cfg: ExperimentConfig, metrics: Metrics, *, listen: str,
                  metrics_listen: str | None = None, follow_learner: str | Mapping[str, str] | None = None,
                  accept_older: bool = False,
                  serve_id: str = "serve") -> AsyncIterator[Endpoints]:
    """Serve `policies` (weights loaded; by policy name: a run's one, or its several of config `policies`)
    to simulators; yields its Endpoints. `cfg`: `serving_config`'s. Each answers the sessions whose hello
    names it (`EnvHello.policy`), with its own hub (its spaces) and batched inference, its gauges under
    its tag's scope (actor/policies/<name>/ for each of several); `follow_learner` is an address for each
    (`learner_addresses`: one, or `name=host:port` for each, or that map). Leaving the context runs the
    shutdown sequence (nothing to flush: no fragments)."""
    if isinstance(follow_learner, Mapping):
        learners = dict(follow_learner)
    elif follow_learner:   # (ValueError naming what is wrong)
        learners = learner_addresses(follow_learner, tuple(policies))
    else:
        learners = {}
    episodes = EpisodeLog(metrics)
    seats = {}
    for name, policy in policies.items():
        tag = policy.cfg.tag(name)
        if policy.name != tag:   # (its version gauge is under its tag's scope)
            raise ValueError(f"the policy named {policy.name!r} is offered as {name!r}: serve each under its own name")
        hub = SessionHub(cfg, policy.spec, serve_id, metrics.scoped(tag), on_fragment=None,  # no sink: nothing recorded
                         state_size=policy.state_size, policy=tag, episodes=episodes)
        seats[tag] = BatchedInference(policy, hub, metrics.scoped(tag))
    servicer = ActorServicer(metrics, episodes, seats, cfg.actor.session_timeout_s)
    max_bytes = cfg.buffer.max_message_mb * MiB
    lc = Lifecycle("serve", metrics, deadline_s=SHUTDOWN_DEADLINE_S)
    service = actor_pb2.DESCRIPTOR.services_by_name["Actor"]
    await lc.serve(listen, lambda s: add_servicer(s, service, servicer), [service.full_name], max_message_bytes=max_bytes,
                   metrics_listen=metrics_listen, max_connection_age_s=None,   # long sessions
                   tls=cfg.tls, auth=cfg.auth)
    learner_chs = {name: make_channel(address, max_bytes, tls=cfg.tls) for name, address in learners.items()}
    for ch in learner_chs.values():
        lc.on_close(ch.close)
    async with lc.running():
        for tag, seat in seats.items():
            lc.task(seat.run(), f"inference {tag}".rstrip())
        for name, ch in learner_chs.items():
            weights = FittingWeights(policies[name], learners[name], metrics, accept_older)
            lc.task(subscribe_weights(learner_pb2_grpc.LearnerStub(ch), serve_id, weights, metrics),
                    f"weights {policies[name].name}".rstrip())

        def stopped() -> None:
            log.info("serve stopped: %d sessions, %d env steps served", metrics.counters["actor/sessions_total"],
                     metrics.counters["actor/env_steps_total"])
        for seat in seats.values():
            lc.on_stop(seat.hub.close_all)       # refuse new sessions (UNAVAILABLE), end open ones
        lc.on_stop(lc.stop_server(grace=1.0))    # streams see their end; then stop serving
        lc.on_stop(stopped)
        await lc.ready()
        yield lc.endpoints
