"""Planner wiring: config -> backend -> planner core -> gRPC API -> shutdown."""

from __future__ import annotations

import argparse
import os

from services.common.runtime import base_parser

PORT = 50054


def build_parser() -> argparse.ArgumentParser:
    p = base_parser("planner", PORT, "Reads every service's rates and rewrites actor/learner replica counts "
                                     "so production and consumption stay balanced.")
    p.add_argument("--backend", choices=("local", "kubernetes", "dry-run"), default=os.environ.get("KUBERL_PLANNER_BACKEND"),
                   help="override planner.backend from the config")
    p.add_argument("--buffer", default=os.environ.get("KUBERL_BUFFER", "127.0.0.1:50051"),
                   help="local backend: the buffer the processes it starts push to / read from (default $KUBERL_BUFFER "
                        "or 127.0.0.1:50051)")
    p.add_argument("--run-dir", default=os.environ.get("KUBERL_RUN_DIR", "."),
                   help="local backend: directory for the started processes' logs/, ready/ and checkpoints/")
    p.add_argument("--actor-port", type=int, default=50053,
                   help="local backend, env.mode external: actor i listens on 127.0.0.1:(this + i) (default 50053)")
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE"),
                   help="kubernetes backend: namespace of the managed Deployments (default $POD_NAMESPACE, "
                        "else planner.kubernetes.namespace, else the kubeconfig's)")
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"),
                   help="kubernetes backend: kubeconfig file (default: in-cluster service-account auth, else $KUBECONFIG)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)
