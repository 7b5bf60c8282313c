"""Clients balance per pod behind a headless Service, as the manifests assume.

A headless Service's DNS name resolves to every ready pod; services/common/net/grpcutil.make_channel must
then spread calls over all of those addresses (round_robin), not stick to the first (gRPC's default
pick_first). Two real servers stand in for two pods; the target lists both addresses, as DNS would.
"""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.net.grpcutil import MiB, make_channel, start_server


async def _count_answers(channel: grpc.aio.Channel, calls: int) -> dict[str, int]:
    """Which server answered each call: one reflection call lists the answering server's services, and
    each server registers its own name ("pod-a" or "pod-b")."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    counts = {"pod-a": 0, "pod-b": 0}
    for _ in range(calls):
        call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                         timeout=5, wait_for_ready=True)
        async for reply in call:
            names = {s.name for s in reply.list_services_response.service}
            (pod,) = names & set(counts)
            counts[pod] += 1
    return counts


async def test_make_channel_spreads_calls_over_every_resolved_address():
    servers = [await start_server("127.0.0.1:0", lambda s: None, [name], max_message_bytes=MiB)
               for name in ("pod-a", "pod-b")]
    try:
        for srv in servers:
            await srv.set_serving(True)
        target = "ipv4:" + ",".join(srv.address for srv in servers)
        channel = make_channel(target, MiB)
        try:
            for _ in range(200):     # until both connections are up (round_robin uses ready ones only)
                if min((await _count_answers(channel, 2)).values()) > 0:
                    break
            counts = await _count_answers(channel, 40)
        finally:
            await channel.close()
        assert sum(counts.values()) == 40
        assert min(counts.values()) >= 15, f"calls were not balanced across both servers: {counts}"
        # The same target without make_channel's options sticks to one server: the check can fail.
        plain = grpc.aio.insecure_channel(target)
        try:
            sticky = await _count_answers(plain, 20)
        finally:
            await plain.close()
        assert sorted(sticky.values()) == [0, 20], sticky
    finally:
        for srv in servers:
            await srv.server.stop(None)
