"""`grpcutil.generated_handlers` builds a service's method handlers from its protobuf descriptor: they
must be the ones the generated `add_XServicer_to_server` registers. And `grpcutil._Health`'s record
of statuses (what the HTTP probes and Health/List answer) must be what grpcio's servicer answers."""

from __future__ import annotations

from unittest import mock

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from kuberl.v1 import actor_pb2, actor_pb2_grpc, buffer_pb2, buffer_pb2_grpc
from services.common.net.grpcutil import _Health, generated_handlers

SERVICES = [  # (descriptor, generated add function, servicer); between them, every kind of RPC
    (buffer_pb2.DESCRIPTOR.services_by_name["Buffer"], buffer_pb2_grpc.add_BufferServicer_to_server,
     buffer_pb2_grpc.BufferServicer()),  # stream-unary, unary-stream, unary-unary
    (actor_pb2.DESCRIPTOR.services_by_name["Actor"], actor_pb2_grpc.add_ActorServicer_to_server,
     actor_pb2_grpc.ActorServicer()),  # unary-unary, stream-stream
    (health_pb2.DESCRIPTOR.services_by_name["Health"], health_pb2_grpc.add_HealthServicer_to_server,
     health.aio.HealthServicer()),
    (reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
     reflection_pb2_grpc.add_ServerReflectionServicer_to_server, reflection.aio.ReflectionServicer([])),
]


def registered_by_generated(add_generated, servicer) -> tuple[str, dict[str, grpc.RpcMethodHandler]]:
    """What `add_generated` registers on a grpc.aio.Server, read from the calls it makes on an
    autospec of that interface."""
    server = mock.create_autospec(grpc.aio.Server, instance=True)
    add_generated(servicer, server)
    server.add_registered_method_handlers.assert_called_once()
    service, handlers = server.add_registered_method_handlers.call_args.args
    return service, handlers


@pytest.mark.parametrize(("descriptor", "add_generated", "servicer"), SERVICES,
                         ids=[d.full_name for d, _, _ in SERVICES])
def test_handlers_from_descriptor_are_the_generated_ones(descriptor, add_generated, servicer):
    service, handlers = generated_handlers(descriptor, servicer)
    want_service, want = registered_by_generated(add_generated, servicer)
    assert service == want_service == descriptor.full_name
    assert list(handlers) == list(want)  # the same methods, in the same order
    for name, h in handlers.items():
        w = want[name]
        assert (h.request_streaming, h.response_streaming) == (w.request_streaming, w.response_streaming), name
        assert h.request_deserializer == w.request_deserializer, name
        assert h.response_serializer == w.response_serializer, name
        assert (h.unary_unary, h.unary_stream, h.stream_unary, h.stream_stream) == (
            w.unary_unary, w.unary_stream, w.stream_unary, w.stream_stream), name
        assert h == w, name


def test_the_services_cover_every_kind_of_rpc():
    kinds = {(h.request_streaming, h.response_streaming)
             for descriptor, _, servicer in SERVICES[:2] for h in generated_handlers(descriptor, servicer)[1].values()}
    assert kinds == {(False, False), (False, True), (True, False), (True, True)}


def test_a_servicer_missing_a_method_is_named():
    class Partial:
        async def GetStats(self, request, context):
            raise AssertionError("never called")

    with pytest.raises(AttributeError, match="EnvSession"):
        generated_handlers(actor_pb2.DESCRIPTOR.services_by_name["Actor"], Partial())


async def check(servicer: _Health, name: str) -> int:
    return (await servicer.Check(health_pb2.HealthCheckRequest(service=name), None)).status


async def test_health_record_follows_grpcio_servicer():
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    h = _Health()
    assert h.status("") == await check(h, "") == serving  # grpcio's servicer starts the server SERVING
    assert h.status("kuberl.v1.Test") == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    await h.set("kuberl.v1.Test", not_serving)
    await h.set("", not_serving)
    await h.set("kuberl.v1.Test", serving)
    for name in ("", "kuberl.v1.Test"):
        assert h.status(name) == await check(h, name)
    assert h.status("kuberl.v1.Test") == serving
    listed = await h.List(health_pb2.HealthListRequest(), None)
    assert {name: s.status for name, s in listed.statuses.items()} == {"": not_serving, "kuberl.v1.Test": serving}

    await h.enter_graceful_shutdown()
    await h.set("kuberl.v1.Test", serving)  # ignored once the graceful shutdown began, by both
    for name in ("", "kuberl.v1.Test"):
        assert h.status(name) == await check(h, name) == not_serving
    listed = await h.List(health_pb2.HealthListRequest(), None)
    assert {name: s.status for name, s in listed.statuses.items()} == {"": not_serving, "kuberl.v1.Test": not_serving}
