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

Given the run directory of several policies (config `policies`), each policy's newest checkpoint is
served, each answering the sessions whose hello names it (`EnvHello.policy`; services/actor/serve.py).

The policy comes from the checkpoint alone (algorithm, spaces, network: services/cli/trained.py), so the
env it trained on need not be importable here; `--config` contributes only what
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
import logging
import os
import socket
import sys

from services.actor.policy import Policy
from services.actor.serve import serving, serving_config
from services.common.service.runtime import base_parser, configure_logging, run_service, write_ready_file
from services.common.stats import Metrics
from services.config import load_role_config

log = logging.getLogger(__name__)
DEFAULT_PORT = 50055  # next to the roles' 50051-50054


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
                        "checkpoint's weights stay); a run of several policies: policy=host:port for each, "
                        "separated by commas")
    p.add_argument("--accept-older", action="store_true",
                   help="with --follow-learner, serve a version older than the newest served too (default: refused "
                        "and counted, so a learner restored from an earlier checkpoint does not roll serving back)")
    for action in p._actions:  # the policy's config is the checkpoint's; --config serves the process only
        if action.dest == "config":
            action.help = ("config YAML whose tls, auth and actor (session) sections apply (default: $KUBERL_CONFIG, "
                           "else defaults); the policy's algorithm, spaces and network come from the checkpoint")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace, stop: asyncio.Event, policies: dict[str, Policy], metrics: Metrics,
                serve_id: str, description: str) -> None:
    first = next(iter(policies.values()))
    cfg = serving_config(first.cfg, load_role_config(args))  # ConfigError, TlsError: exit code 2
    import torch

    torch.set_num_threads(cfg.actor.torch_threads)
    async with serving(policies, cfg, metrics, listen=args.listen, metrics_listen=args.metrics_listen or None,
                       follow_learner=args.follow_learner, accept_older=args.accept_older,
                       serve_id=serve_id) as endpoints:
        log.info("serving %s, %s actions, on %s (metrics on %s)%s", description,
                 "deterministic" if first.greedy is not None else f"stochastic (seed {args.seed})",
                 endpoints.grpc, endpoints.metrics,
                 f", following the learner{'s' if isinstance(args.follow_learner, dict) else ''} at "
                 f"{_addresses(args.follow_learner)}" if args.follow_learner else "")
        write_ready_file(args.ready_file, endpoints)   # (after the line: ready means announced, its seed too)
        await stop.wait()


def _addresses(follow: str | dict[str, str]) -> str:
    return follow if isinstance(follow, str) else ", ".join(f"{p}={a}" for p, a in follow.items())


def main(argv=None) -> int:
    """Run until SIGTERM/SIGINT (exit 0); a checkpoint that cannot be served is one line and exit 2."""
    args = parse_args(argv)
    configure_logging(args.log_level, "serve")
    from services.cli.trained import TrainedPolicyError, load_policies, load_trained, policy_checkpoint_dirs
    from services.common.net.policy import learner_addresses

    serve_id = f"serve-{socket.gethostname()}-{os.getpid()}"
    metrics = Metrics("actor", instance_id=serve_id)
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little") >> 1
    try:
        if policy_checkpoint_dirs(args.checkpoint) is not None:   # a run of several policies: each answers its sessions
            trained = load_policies(args.checkpoint, seed=args.seed, greedy=not args.stochastic, metrics=metrics)
            if args.follow_learner:   # (parsed here, to refuse a bad one before serving)
                args.follow_learner = learner_addresses(args.follow_learner, tuple(trained))
            policies = {name: t.policy for name, t in trained.items()}
            description = "; ".join(f"{name}: {t.description}" for name, t in trained.items())
        else:
            one = load_trained(args.checkpoint, seed=args.seed, greedy=not args.stochastic, metrics=metrics)
            policies, description = {one.name: one.policy}, one.description
    except TrainedPolicyError as err:
        print(f"kuberl serve: {err}", file=sys.stderr)
        return 2
    except ValueError as err:   # --follow-learner, for several policies
        print(f"kuberl serve: {str(err).replace('--learner', '--follow-learner')}", file=sys.stderr)
        return 2
    return run_service("serve", args, lambda a, stop: serve(a, stop, policies, metrics, serve_id, description))
