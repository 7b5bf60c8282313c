"""Planner wiring: config -> backend -> planner core -> gRPC API -> the decision loop (loops.py) -> shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from contextlib import asynccontextmanager
from pathlib import Path

from kuberl.v1 import planner_pb2
from services.config import ExperimentConfig, dump_config, load_config, load_role_config
from services.common.net.grpcutil import MiB, add_servicer
from services.common.service.lifecycle import Lifecycle
from services.common.service.runtime import base_parser, run_service, write_ready_file
from services.common.stats import Metrics
from services.planner.backend import DryRunBackend
from services.planner.core import Planner
from services.planner.local import LocalBackend
from services.planner.loops import decision_loop
from services.planner.servicer import PlannerServicer

log = logging.getLogger(__name__)
SHUTDOWN_DEADLINE_S = 10.0   # readiness off, decisions stopped, watch streams ended, calls drained; the
#                              backend's own close (draining actors it started) comes after, unbounded

PORT = 50054


def build_parser() -> argparse.ArgumentParser:
    p = base_parser("planner", PORT, "Reads every service's rates and rewrites actor/learner replica counts "
                                     "so production and consumption stay balanced.")
    p.add_argument("--backend", choices=("local", "kubernetes", "dry-run"), default=os.environ.get("KUBERL_PLANNER_BACKEND"),
                   help="override planner.backend from the config")
    p.add_argument("--buffer", default=os.environ.get("KUBERL_BUFFER", "127.0.0.1:50051"),
                   help="local backend: the buffer the processes it starts push to / read from, host:port, or one per "
                        "shard separated by commas (default $KUBERL_BUFFER or 127.0.0.1:50051)")
    p.add_argument("--run-dir", default=os.environ.get("KUBERL_RUN_DIR", "."),
                   help="local backend: directory for the started processes' logs/, ready/ and checkpoints/")
    p.add_argument("--actor-port", type=int, default=50053,
                   help="local backend, env.mode external: actor i listens on 127.0.0.1:(this + i) (default 50053)")
    p.add_argument("--journal", default=None,
                   help="append every decision as a JSON line to this file (default: <run-dir>/decisions.jsonl "
                        "with the local backend, none otherwise)")
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE"),
                   help="kubernetes backend: namespace of the managed workloads (default $POD_NAMESPACE, "
                        "else planner.kubernetes.namespace, else the kubeconfig's)")
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"),
                   help="kubernetes backend: kubeconfig file (default: in-cluster service-account auth, else $KUBECONFIG)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def make_backend(cfg: ExperimentConfig, args: argparse.Namespace, metrics: Metrics):
    """The backend named by --backend (else planner.backend). dry-run observes through the Kubernetes
    backend when it can reach a cluster (in a pod, or with --kubeconfig), else through the local one
    (which then starts the configured topology and never changes it)."""
    kind = args.backend or cfg.planner.backend
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    if kind == "kubernetes" or (kind == "dry-run" and (in_cluster or args.kubeconfig)):
        from services.planner.kube import KubernetesBackend

        # Several policies: a learner StatefulSet per policy (services/planner/kube.py; the Helm chart).
        inner = KubernetesBackend(cfg.planner.kubernetes, namespace=args.namespace, kubeconfig=args.kubeconfig,
                                  policies=tuple(cfg.policies))
    else:
        if args.config is None:
            raise SystemExit("the local backend starts processes with the same config: pass --config FILE")
        config = Path(args.config)
        if cfg.tls != load_config(config).tls:
            # This planner's --tls-* flags reach the processes it starts through the config they read.
            config = Path(args.run_dir) / "planner-config.yaml"
            config.parent.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, config)
        inner = LocalBackend(cfg, config_path=config, run_dir=Path(args.run_dir), buffer=args.buffer,
                             actor_port=args.actor_port, metrics=metrics)
    return DryRunBackend(inner) if kind == "dry-run" else inner


@asynccontextmanager
async def serving(cfg: ExperimentConfig, backend, *, listen: str, metrics_listen: str | None = None,
                  metrics: Metrics | None = None, journal: Path | None = None):
    """Start the planner on `backend`; yields (Endpoints, Planner). Leaving stops the backend's processes."""
    metrics = metrics or Metrics("planner")
    planner = Planner(cfg, backend, metrics, journal=journal)
    servicer = PlannerServicer(planner, metrics)
    lc = Lifecycle("planner", metrics, deadline_s=SHUTDOWN_DEADLINE_S)
    await lc.serve(listen, lambda s: add_servicer(s, planner_pb2.DESCRIPTOR.services_by_name["Planner"], servicer),
                   [planner_pb2.DESCRIPTOR.services_by_name["Planner"].full_name], max_message_bytes=4 * MiB,
                   metrics_listen=metrics_listen, tls=cfg.tls, auth=cfg.auth)
    lc.on_close(backend.close)                 # drain actors, stop learners (local)
    async with lc.running():
        await backend.start()
        decide = lc.task(decision_loop(planner) if cfg.planner.enabled else asyncio.Event().wait(), "decide")
        lc.on_stop(decide.cancel)              # no more decisions
        lc.on_stop(planner.close)              # end watch streams
        lc.on_stop(lc.stop_server(grace=1.0))
        await lc.ready()
        yield lc.endpoints, planner


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    cfg = load_role_config(args)
    metrics = Metrics("planner")
    backend = make_backend(cfg, args, metrics)
    journal = args.journal or (Path(args.run_dir) / "decisions.jsonl" if isinstance(
        getattr(backend, "inner", backend), LocalBackend) else None)
    async with serving(cfg, backend, listen=args.listen, metrics_listen=args.metrics_listen or None,
                       metrics=metrics, journal=journal) as (endpoints, _):
        write_ready_file(args.ready_file, endpoints)
        log.info("planner (%s backend) serving gRPC on %s, metrics on %s", backend.name, endpoints.grpc,
                 endpoints.metrics)
        await stop.wait()


def main(argv=None) -> int:
    return run_service("planner", parse_args(argv), serve)
