"""gRPC plumbing shared by every service: servers with health + reflection, channels, status mapping.

Message size limits are explicit on both ends (`max_message_bytes`). Servers set a max connection
age so that clients behind a headless Service rebalance onto new pods; long-lived streams are
re-opened by their clients before the grace period ends.
"""

from __future__ import annotations

import asyncio
import logging
import random

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MiB = 1 << 20
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


def server_options(max_message_bytes: int, max_connection_age_s: float | None = 300.0) -> list[tuple[str, int]]:
    age = [] if max_connection_age_s is None else [
        ("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", 30_000),
    ]
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *age,
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),
    ]


class Serving:
    """A started gRPC server with health and reflection; `address` is the bound host:port."""

    def __init__(self, server: grpc.aio.Server, health: HealthServicer, names: list[str], address: str):
        self.server, self.health, self.names, self.address = server, health, names, address

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self.names]:
            await self.health.set(name, status)

    async def close(self) -> None:
        """Stop at once, cancelling calls still running; a no-op after a graceful `server.stop`.
        Each service's `serving()` ends with this, so a shutdown sequence that failed part-way
        (a crashed loop re-raised mid-sequence) never leaves a server running behind it."""
        await self.server.stop(None)


async def start_server(listen: str, register, service_names: list[str], *,
                       max_message_bytes: int, max_connection_age_s: float | None = 300.0) -> Serving:
    """Create a server, let `register(server)` add servicers, add health + reflection, bind, start.

    `listen` is host:port; port 0 binds a free port (the returned address has the real one).
    Health starts NOT_SERVING; the caller flips it when ready. `max_connection_age_s` (None = no limit)
    makes clients reconnect, and so rebalance onto new pods; it also ends every stream on the
    connection, so services whose clients hold long sessions (actors) pass None.
    """
    server = grpc.aio.server(options=server_options(max_message_bytes, max_connection_age_s))
    register(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([*service_names, "grpc.health.v1.Health",
                                         reflection.SERVICE_NAME], server)
    host = listen.rsplit(":", 1)[0]
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"could not bind {listen}")
    await server.start()
    serving = Serving(server, health, service_names, f"{host}:{port}")
    await serving.set_serving(False)
    return serving


def make_channel(target: str, max_message_bytes: int, receive_window_bytes: int | None = None) -> grpc.aio.Channel:
    """One channel per peer per process; round-robin over DNS results (headless Services).

    `receive_window_bytes` pins the HTTP/2 receive window (BDP probing off) so that at most about
    that much unread data waits in transit per stream: a learner uses it to keep batches from
    going stale in socket buffers, where no one can count or drop them.
    """
    window = [] if receive_window_bytes is None else [
        ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", receive_window_bytes)]
    return grpc.aio.insecure_channel(target, options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.enable_retries", 0),
        *window,
        *KEEPALIVE,
    ])


class Backoff:
    """Capped exponential backoff with full jitter, for re-opening streams to a peer."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 2.0):
        self._rng = random.Random()
        self.base_s, self.cap_s, self.attempt = base_s, cap_s, 0

    def reset(self) -> None:
        self.attempt = 0

    async def sleep(self) -> None:
        delay = min(self.cap_s, self.base_s * (2 ** self.attempt))
        self.attempt += 1
        await asyncio.sleep(self._rng.uniform(0, delay))


def raise_if_cancelling(err: grpc.aio.AioRpcError) -> None:
    """In a retry loop's `except AioRpcError`: a call cut short because this task is being cancelled
    can surface as CANCELLED; re-raise the cancellation instead of retrying, or shutdown would hang."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from err


def describe(err: grpc.aio.AioRpcError) -> str:
    """A one-line summary of an RPC error for logs."""
    return f"{err.code().name}: {err.details()}"
