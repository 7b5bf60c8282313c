#!/usr/bin/env python3
"""Exit 0 when a kuberl service reports SERVING on grpc.health.v1, else 1 (the images' HEALTHCHECK).

    kuberl-healthcheck [--service NAME] [--timeout SECONDS] ADDRESS

NAME is "" for the server as a whole or a service's full name (kuberl.v1.Buffer, ...): every kuberl
server reports both, and turns both NOT_SERVING when it starts to shut down. Kubernetes does not use
this (the manifests probe /readyz and /livez on the metrics port); Docker and Compose do.

A role serving TLS is checked over TLS, as the role itself dials: with the tls section of --config
(default $KUBERL_CONFIG, the role's own in its image) and the --tls-* flags or $KUBERL_TLS_*
(docs/security.md). ADDRESS's host (127.0.0.1) must then be in the role's certificate, or
tls.server_name (--tls-server-name) a name that is.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.client import client_channel
from services.common.service.runtime import add_client_arguments


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kuberl-healthcheck", description=__doc__.split("\n")[0])
    p.add_argument("address", help="host:port of the service's gRPC server")
    p.add_argument("--service", default="", help="health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    add_client_arguments(p)
    args = p.parse_args(argv)
    try:
        with client_channel(p, args, args.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"{args.address} {args.service!r}: {err.code().name} {err.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address} {args.service!r}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
