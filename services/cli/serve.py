"""`kuberl serve CHECKPOINT --listen ADDR`: a trained policy served over `Actor.EnvSession`, an actor that
only answers.

A simulator that trained against kuberl actors (examples/, kuberl_client) connects to it unchanged and
gets the checkpoint's actions: the same servicer (services/actor/servicer.py), the same session hub
and its space, step and mask checks (sessions.py; the spaces checked are the checkpoint's policy's) and
the same batched inference across sessions (inference.py) as an actor with `env.mode: external`. What
an actor does for training it does not do: its hub has no fragment sink, so no transitions are kept,
no fragment is cut and nothing is pushed; it needs no buffer and no learner. Actions are the
checkpoint's deterministic policy (`Acting.greedy`, what `kuberl eval` runs) unless `--stochastic`
asks for the actors' sampling (seeded by `--seed`, else a seed drawn per process and logged, so
replicas do not sample alike). `--follow-learner ADDR` subscribes to a learner's weights stream as
actors do and swaps each new version in between two batches; a version older than the newest served
(a learner restored from an earlier checkpoint) is refused unless `--accept-older`. Without it the
checkpoint's weights stay.

The policy comes from the checkpoint (algorithm, spaces, network); `--config` contributes only what
belongs to the serving process: its `tls` and `auth` sections (tokens, session caps) and its `actor`
section's session settings (`max_sessions`, `session_timeout_s`, `session_resume_s`, `check_obs_bounds`,
`torch_threads`). A step holding NaN or infinity is refused by the hub (services/actor/finite.py) before
the policy sees it, deterministic or `--stochastic`: INVALID_ARGUMENT, never NaN actions.

Metrics are the actor's names (`actor/sessions_active`, `actor/env_steps_total` for steps served,
`actor/inference_batch_envs_*`, `actor/policy_version`, ...; docs/metrics.md) under the instance id
`serve-<host>-<pid>`, in GetStats and on `--metrics-listen`'s /metrics, with /readyz and /livez.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
import sys
from contextlib import asynccontextmanager

import numpy as np

from kuberl.v1 import actor_pb2, learner_pb2_grpc
from services.actor.inference import BatchedInference
from services.actor.policy import Policy
from services.actor.servicer import ActorServicer
from services.actor.sessions import SessionHub
from services.actor.subscribe import subscribe_weights
from services.config import ExperimentConfig, load_role_config
from services.common.grpcutil import MiB, add_servicer, make_channel, start_server
from services.common.prometheus import serve_metrics
from services.common.runtime import (Endpoints, base_parser, configure_logging, run_service,
                                     write_ready_file)
from services.common.stats import Metrics, tick_forever

log = logging.getLogger(__name__)
DEFAULT_PORT = 50055  # next to the roles' 50051-50054
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
async def serving(policy: Policy, cfg: ExperimentConfig, metrics: Metrics, *, listen: str,
                  metrics_listen: str | None = None, follow_learner: str | None = None, accept_older: bool = False,
                  serve_id: str = "serve"):
    """Serve `policy` (weights loaded) to simulators; yields its Endpoints. `cfg`: `serving_config`'s.
    Leaving the context runs the shutdown sequence."""
    hub = SessionHub(cfg, policy.spec, serve_id, metrics, on_fragment=None)  # no sink: nothing recorded
    inference = BatchedInference(policy, hub, metrics)
    servicer = ActorServicer(metrics, hub.episodes, hub, inference, cfg.actor.session_timeout_s)
    max_bytes = cfg.buffer.max_message_mb * MiB
    srv = await start_server(listen, lambda s: add_servicer(s, actor_pb2.DESCRIPTOR.services_by_name["Actor"], servicer),
                             [actor_pb2.DESCRIPTOR.services_by_name["Actor"].full_name], max_message_bytes=max_bytes,
                             max_connection_age_s=None, tls=cfg.tls, auth=cfg.auth, metrics=metrics)  # long sessions
    prom = serve_metrics(metrics, metrics_listen, health=srv) if metrics_listen else None
    learner_ch = make_channel(follow_learner, max_bytes, tls=cfg.tls) if follow_learner else None
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(inference.run(), name="inference"),
                     tg.create_task(tick_forever(metrics), name="stats")]
            if learner_ch is not None:
                tasks.append(tg.create_task(subscribe_weights(
                    learner_pb2_grpc.LearnerStub(learner_ch), serve_id, FittingWeights(policy, follow_learner, metrics, accept_older),
                    metrics), name="weights"))
            await srv.set_serving(True)
            try:
                yield Endpoints(srv.address, prom.address if prom else None)
            finally:
                # Shutdown, in order, under one hard deadline (nothing to flush: no fragments):
                async with asyncio.timeout(SHUTDOWN_DEADLINE_S):
                    await srv.set_serving(False)          # 1. readiness goes NOT_SERVING
                    hub.close_all()                       # 2. refuse new sessions (UNAVAILABLE), end open ones
                    await srv.server.stop(grace=1.0)      # 3. streams see their end; then stop serving
                    for task in tasks:                    # 4. inference, stats, weights
                        task.cancel()
                    log.info("serve stopped: %d sessions, %d env steps served", metrics.counters["actor/sessions_total"],
                             metrics.counters["actor/env_steps_total"])
    finally:
        await srv.close()
        if prom is not None:
            prom.close()
        if learner_ch is not None:
            await learner_ch.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = base_parser("serve", DEFAULT_PORT, "Serve a trained policy to simulators over Actor.EnvSession, as an actor "
                                           "that only answers: no buffer, no learner, nothing pushed "
                                           "(docs/after-training.md).")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a learner checkpoint (ckpt-*.pt) or a `kuberl up` run directory (its newest checkpoint)")
    p.add_argument("--stochastic", action="store_true",
                   help="act as the actors do (sample; DQN: epsilon-greedy) instead of deterministically")
    p.add_argument("--seed", type=int, default=None,
                   help="the sampling seed of --stochastic (default: drawn per process and logged, so replicas "
                        "sample independently)")
    p.add_argument("--follow-learner", default=None, metavar="ADDR",
                   help="subscribe to this learner's weights stream and serve each new version (default: the "
                        "checkpoint's weights stay)")
    p.add_argument("--accept-older", action="store_true",
                   help="with --follow-learner, serve a version older than the newest served too (default: refused "
                        "and counted, so a learner restored from an earlier checkpoint does not roll serving back)")
    for action in p._actions:  # the policy's config is the checkpoint's; --config serves the process only
        if action.dest == "config":
            action.help = ("config YAML whose tls, auth and actor (session) sections apply (default: $KUBERL_CONFIG, "
                           "else defaults); the policy's algorithm, spaces and network come from the checkpoint")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace, stop: asyncio.Event, policy: Policy, metrics: Metrics,
                serve_id: str, description: str) -> None:
    cfg = serving_config(policy.cfg, load_role_config(args))  # ConfigError, TlsError: exit code 2
    import torch

    torch.set_num_threads(cfg.actor.torch_threads)
    async with serving(policy, cfg, metrics, listen=args.listen, metrics_listen=args.metrics_listen or None,
                       follow_learner=args.follow_learner, accept_older=args.accept_older,
                       serve_id=serve_id) as endpoints:
        write_ready_file(args.ready_file, endpoints)
        log.info("serving %s, %s actions, on %s (metrics on %s)%s", description,
                 "deterministic" if policy.greedy is not None else f"stochastic (seed {args.seed})",
                 endpoints.grpc, endpoints.metrics,
                 f", following the learner at {args.follow_learner}" if args.follow_learner else "")
        await stop.wait()


def main(argv=None) -> int:
    """Run until SIGTERM/SIGINT (exit 0); a checkpoint that cannot be served is one line and exit 2."""
    args = parse_args(argv)
    configure_logging(args.log_level, "serve")
    from services.cli.trained import TrainedPolicyError, load_trained

    serve_id = f"serve-{socket.gethostname()}-{os.getpid()}"
    metrics = Metrics("actor", instance_id=serve_id)
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little") >> 1
    try:
        trained = load_trained(args.checkpoint, seed=args.seed, greedy=not args.stochastic, metrics=metrics)
    except TrainedPolicyError as err:
        print(f"kuberl serve: {err}", file=sys.stderr)
        return 2
    return run_service("serve", args, lambda a, stop: serve(a, stop, trained.policy, metrics, serve_id,
                                                              trained.description))
