"""Malformed requests, every RPC of each service: a bounded fuzz (bench/fuzz.py, fewer calls) against
real servers on 127.0.0.1:0 in this process.

Every frame that the request type's parser refuses gets INVALID_ARGUMENT, the frame over the
server's message limit RESOURCE_EXHAUSTED (gRPC refuses it before any handler runs), and no call
at all gets UNKNOWN or INTERNAL, well-formed nonsense included. Afterwards the server still answers
health and a good GetStats, and another client's stream opened before the fuzzing still works.
The calls are bounded in number, not time: each waits for its answer (up to a generous bound).
Each service is fuzzed in plaintext and over mutual TLS (its clients presenting a role certificate,
as its peers do): what a frame gets does not depend on the transport.
"""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.fuzz import SERVICES, fuzz_config, fuzz_server, max_message_bytes, serve_in_process
from services.config import config_from_dict
from services.common.net.tls import open_channel
from tests.certs import Pki

CALLS_PER_RPC = 22  # each kind of malformed frame twice per RPC


def secured(cfg: dict, transport: str, tmp_path) -> dict:
    """`cfg` with every role serving and dialling mutual TLS (transport "mtls"), or as it is."""
    if transport == "mtls":
        cfg["tls"] = Pki(tmp_path / "pki").issue("role").tls()
    return cfg


@pytest.mark.parametrize("transport", ["plaintext", "mtls"])
@pytest.mark.parametrize("role", list(SERVICES))
async def test_every_malformed_frame_gets_a_clear_status(role, transport, tmp_path):
    cfg = secured(fuzz_config(), transport, tmp_path)
    tls = config_from_dict(cfg).tls
    async with serve_in_process([role], cfg, tmp_path) as addresses:
        reports = await fuzz_server(addresses[role], max_message=max_message_bytes(role, cfg),
                                    calls_per_rpc=CALLS_PER_RPC, seed=1, stream_wait_s=0.5, tls=tls)
    report = reports[SERVICES[role]]
    unexpected = [f"{o.rpc} {o.kind} ({o.frame}, {o.sample}): {o.code} {o.details}" for o in report.unexpected]
    assert not unexpected, "\n".join(unexpected)
    assert report.deaths == 0
    assert report.codes["UNKNOWN"] == report.codes["INTERNAL"] == 0
    garbage = report.by_frame["garbage"]
    assert sum(garbage.values()) >= CALLS_PER_RPC and set(garbage) == {"INVALID_ARGUMENT"}, garbage
    assert set(report.by_frame["oversize"]) == {"RESOURCE_EXHAUSTED"}
    assert report.calls == (CALLS_PER_RPC + 1) * len(report.by_rpc)
    assert report.get_stats_ok and report.bystander_ok


@pytest.mark.parametrize("transport", ["plaintext", "mtls"])
async def test_health_and_reflection_answer_garbage_with_invalid_argument(transport, tmp_path):
    """gRPC's own services go through the same parsing registration; Health/List included (grpcio's
    asyncio health servicer leaves it unimplemented, kuberl implements it)."""
    cfg = secured(fuzz_config(), transport, tmp_path)
    tls = config_from_dict(cfg).tls
    async with serve_in_process(["buffer"], cfg, tmp_path) as addresses:
        reports = await fuzz_server(addresses["buffer"], max_message=max_message_bytes("buffer", cfg),
                                    calls_per_rpc=CALLS_PER_RPC, seed=2, stream_wait_s=0.5, include_grpc=True,
                                    tls=tls)
        async with open_channel(addresses["buffer"], tls, aio=True) as channel:
            listed = await health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
    for service in ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"):
        report = reports[service]
        assert not report.unexpected, [f"{o.rpc} {o.kind}: {o.code} {o.details}" for o in report.unexpected]
        assert report.codes["UNKNOWN"] == report.codes["INTERNAL"] == 0
        assert set(report.by_frame["garbage"]) == {"INVALID_ARGUMENT"}, report.by_frame["garbage"]
    assert "/grpc.health.v1.Health/List" in reports["grpc.health.v1.Health"].by_rpc
    assert listed.statuses["kuberl.v1.Buffer"].status == health_pb2.HealthCheckResponse.SERVING
