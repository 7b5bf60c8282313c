"""Malformed requests, every RPC of each service: a bounded fuzz (bench/fuzz.py, fewer calls) against
real servers on 127.0.0.1:0 in this process.

Every frame that the request type's parser refuses gets INVALID_ARGUMENT, the frame over the
server's message limit RESOURCE_EXHAUSTED (gRPC refuses it before any handler runs), and no call
at all gets UNKNOWN or INTERNAL, well-formed nonsense included. Afterwards the server still answers
health and a good GetStats, and another client's stream opened before the fuzzing still works.
The calls are bounded in number, not time: each waits for its answer (up to a generous bound).
"""

from __future__ import annotations

import pytest

from bench.fuzz import SERVICES, fuzz_config, fuzz_server, max_message_bytes, serve_in_process

CALLS_PER_RPC = 22  # each kind of malformed frame twice per RPC


@pytest.mark.parametrize("role", list(SERVICES))
async def test_every_malformed_frame_gets_a_clear_status(role, tmp_path):
    cfg = fuzz_config()
    async with serve_in_process([role], cfg, tmp_path) as addresses:
        reports = await fuzz_server(addresses[role], max_message=max_message_bytes(role, cfg),
                                    calls_per_rpc=CALLS_PER_RPC, seed=1, stream_wait_s=0.5)
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
