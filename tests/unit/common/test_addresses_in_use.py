"""A role whose address is taken refuses to start with a ConfigError naming the flag that sets it
(`--metrics-listen`, the Prometheus port every role defaults to, or `--listen`), which `run_service`
turns into one line and exit code 2 (tests/integration/test_lifecycle.py runs it as a process); what
it had bound is released."""

from __future__ import annotations

import socket

import pytest

from services.common.service.lifecycle import Lifecycle, unbindable
from services.common.settings import ConfigError
from services.common.stats import Metrics


@pytest.fixture
def taken():
    """host:port of a listening socket held for the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


async def _serve(listen: str, metrics_listen: str | None) -> Lifecycle:
    lc = Lifecycle("test", Metrics("buffer"), deadline_s=1.0)
    await lc.serve(listen, lambda server: None, [], max_message_bytes=1 << 20, metrics_listen=metrics_listen)
    return lc


async def test_a_taken_metrics_port_is_refused_naming_its_flag_and_the_grpc_port_is_released(taken):
    with socket.socket() as s:   # a port free now, for the gRPC server
        s.bind(("127.0.0.1", 0))
        grpc_address = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ConfigError) as refused:
        await _serve(grpc_address, taken)
    assert unbindable(grpc_address) is None, "the gRPC server bound before the refusal is closed"
    message = str(refused.value)
    assert refused.value.key == "--metrics-listen" and taken in message, message
    assert "in use" in message and "--metrics-listen HOST:PORT" in message and "''" in message, message
    assert "\n" not in message


async def test_a_taken_grpc_port_is_refused_naming_listen(taken):
    with pytest.raises(ConfigError) as refused:
        await _serve(taken, None)
    message = str(refused.value)
    assert refused.value.key == "--listen" and taken in message and "in use" in message, message
    assert "--listen HOST:PORT" in message and "metrics" not in message, message


async def test_a_host_not_of_this_machine_is_refused_naming_its_flag():
    with pytest.raises(ConfigError) as refused:
        await _serve("127.0.0.1:0", "192.0.2.1:9400")   # TEST-NET-1: never an address of this machine
    assert refused.value.key == "--metrics-listen" and "192.0.2.1:9400" in str(refused.value)
    assert "in use" not in str(refused.value)


async def test_free_addresses_serve_and_the_refused_ones_were_let_go(taken):
    free = taken.rsplit(":", 1)[0] + ":0"
    assert unbindable(taken) is not None and unbindable(free) is None
    lc = await _serve(free, free)
    async with lc.running():
        grpc_port, metrics_port = (int(a.rsplit(":", 1)[1]) for a in (lc.endpoints.grpc, lc.endpoints.metrics))
        assert unbindable(f"127.0.0.1:{metrics_port}") is not None   # held while serving
    assert unbindable(f"127.0.0.1:{metrics_port}") is None and unbindable(f"127.0.0.1:{grpc_port}") is None
