"""Servers end client connections after `max_connection_age_s` so that clients of a headless Service
re-resolve and spread over new pods; the actor's server (None) keeps them, for long simulator sessions."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.net.grpcutil import MiB, make_channel, start_server


async def _left_ready(max_connection_age_s: float | None, wait_s: float) -> bool:
    """Whether a client's READY connection changes state (the server's GOAWAY) within `wait_s`. The
    round_robin channel reconnects at once, so the change itself is what is observed."""
    srv = await start_server("127.0.0.1:0", lambda s: None, [], max_message_bytes=MiB,
                             max_connection_age_s=max_connection_age_s)
    channel = make_channel(srv.address, MiB)
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert channel.get_state() == grpc.ChannelConnectivity.READY
        try:
            await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), wait_s)
            return True
        except TimeoutError:
            return False
    finally:
        await channel.close()
        await srv.close()


async def test_a_server_with_a_max_connection_age_sends_its_clients_away():
    assert await _left_ready(0.5, 10)


async def test_the_actor_setting_keeps_connections():
    assert not await _left_ready(None, 3)
