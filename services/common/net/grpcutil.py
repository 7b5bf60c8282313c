"""gRPC plumbing shared by every service: servers with health + reflection, channels, status mapping.

Message size limits are explicit on both ends (`max_message_bytes`). Servers set a max connection
age so that clients behind a headless Service rebalance onto new pods; long-lived streams are
re-opened by their clients before the grace period ends.

Request frames are parsed here, not by grpcio: every service registers through `add_servicer` (or
`add_handlers`), whose handlers are built from the service's protobuf descriptor as a generated
`add_XServicer_to_server` would build them (`generated_handlers`), receive the raw bytes and parse them
with the generated message's parser, so that a frame that is not a valid message ends its RPC with
INVALID_ARGUMENT naming the RPC and the message type. (grpcio's own deserialization failure surfaces
as UNKNOWN, which tells a client nothing about whose fault it was.) An INVALID_ARGUMENT refusal of a
client stream is sent once the client has half-closed, so that the client sees it rather than a
failed write (`_RequestContext`).
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import logging
import random
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
# These two ship no type information and their stubs (types-grpcio-health-checking, types-grpcio-reflection)
# are not among the dev dependencies: their names are Any here.
from grpc_health.v1 import health, health_pb2  # type: ignore[import-untyped]
from grpc_reflection.v1alpha import reflection  # type: ignore[import-untyped]

from services.common.net.auth import ROLE_RPCS, AuthInterceptor
from services.common.net.policy import policy_interceptors
from services.common.net.streams import read_to_half_close
from services.common.net.tls import TlsError, open_channel, server_credentials

if TYPE_CHECKING:
    from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

    from services.common.net.auth import AuthConfig
    from services.common.net.tls import TlsConfig
    from services.common.stats import Metrics

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

    def __init__(self, server: grpc.aio.Server, health: _Health, names: list[str], address: str):
        self.server, self.health, self.names, self.address = server, health, names, address
        self.loop = asyncio.get_running_loop()

    def probe(self, ready: bool, timeout_s: float) -> str | None:
        """From any thread but the server's: None when the server's event loop runs a callback within
        `timeout_s` and (with `ready`) every service of the server is SERVING, else why not. What the
        HTTP probes of the metrics port answer (services/common/service/prometheus.py): a gRPC health check
        answered from the same loop, for kubelets and load balancers that cannot present the client
        certificate a gRPC probe would need under mutual TLS."""
        answered = threading.Event()
        statuses: dict[str, int] = {}

        def look() -> None:
            statuses.update({name: self.health.status(name) for name in self.names})
            answered.set()

        try:
            self.loop.call_soon_threadsafe(look)
        except RuntimeError:
            return "the server's event loop is closed"
        if not answered.wait(timeout_s):
            return f"the server's event loop did not answer within {timeout_s:g} s"
        if ready:
            down = [name for name, status in statuses.items() if status != health_pb2.HealthCheckResponse.SERVING]
            if down:
                return f"{', '.join(down)} not serving"
        return None

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


def _kind(request_streaming: bool, response_streaming: bool) -> str:
    """"unary_unary", "unary_stream", "stream_unary" or "stream_stream": grpcio's name for an RPC's kind."""
    return ("stream" if request_streaming else "unary") + "_" + ("stream" if response_streaming else "unary")


# grpcio's handler factory for each kind of RPC (`_kind`).
_HANDLER_FACTORIES: dict[str, Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _method_handler(method: MethodDescriptor, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """The handler a generated `add_XServicer_to_server` registers for `method`: of the kind its
    streaming flags say, parsing requests with the input message's parser and writing responses with
    the output message's serializer."""
    make = _HANDLER_FACTORIES[_kind(method.client_streaming, method.server_streaming)]
    return make(behavior, request_deserializer=GetMessageClass(method.input_type).FromString,
                response_serializer=GetMessageClass(method.output_type).SerializeToString)


def generated_handlers(service: ServiceDescriptor,
                       servicer: object) -> tuple[str, dict[str, grpc.RpcMethodHandler[Any, Any]]]:
    """(full service name, {method: handler}) for every RPC of `service` (its descriptor, e.g.
    `actor_pb2.DESCRIPTOR.services_by_name["Actor"]`), each calling `servicer`'s method of the same
    name, as the generated `add_XServicer_to_server(servicer, server)` would register them; to be
    adjusted and passed to `add_handlers`. AttributeError names a method `servicer` lacks (a servicer
    derived from the generated base class has them all)."""
    return service.full_name, {m.name: _method_handler(m, getattr(servicer, m.name)) for m in service.methods}


def add_servicer(server: grpc.aio.Server, service: ServiceDescriptor, servicer: object) -> None:
    """Register `servicer` for `service` (its descriptor) as the generated `add_XServicer_to_server`
    would, except that request frames are parsed by `add_handlers`' handlers: a frame that does not
    parse gets INVALID_ARGUMENT. Every service registers through this (or `add_handlers`)."""
    add_handlers(server, *generated_handlers(service, servicer))


def add_handlers(server: grpc.aio.Server, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]) -> None:
    """Register `handlers` of `service`, each taking its request frames as bytes and parsing them
    with the handler's own `request_deserializer` (see `_parsing_handler`). A handler registered
    with no deserializer (`request_deserializer=None`) gets the bytes as they are and answers
    malformed ones itself; a refusal of a client stream still waits for its half-close."""
    wrapped = {name: _parsing_handler(f"{service}/{name}", _input_type_name(service, name), h)
               for name, h in handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
    server.add_registered_method_handlers(service, wrapped)


def _input_type_name(service: str, method: str) -> str:
    try:
        return descriptor_pool.Default().FindServiceByName(service).methods_by_name[method].input_type.name
    except KeyError:  # a service whose descriptors were not loaded into the default pool
        return "request message"




def _not_valid(rpc: str, which: str, type_name: str, err: DecodeError) -> str:
    return f"{rpc}: {which} is not a valid {type_name}: {err}"


class _RequestContext:
    """The servicer context that a stream-request RPC's behaviour sees. `read()` parses each frame
    (with the generated parser; a handler registered without one gets the bytes), and on a client
    stream (stream-unary) `abort(INVALID_ARGUMENT, ...)` first reads and drops what the client still
    sends, up to its half-close (services/common/net/streams.py says why: otherwise the client would not
    see the refusal or its trailing metadata, which fragment to drop, and would re-send the same bad
    data). Everything else is the real context's.
    """

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any], rpc: str, type_name: str,
                 deserialize: Callable[[bytes], Any] | None, client_stream: bool) -> None:
        self._context, self._rpc, self._type_name = context, rpc, type_name
        self._deserialize, self._client_stream = deserialize, client_stream
        self._count = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def read(self) -> Any:
        """The next message (the frame as it is without a parser), or grpc.aio.EOF after the half-close."""
        data = await self._context.read()
        if data is grpc.aio.EOF:
            return data
        self._count += 1
        if self._deserialize is None:
            return data
        try:
            return self._deserialize(data)
        except DecodeError as err:
            await self.abort(grpc.StatusCode.INVALID_ARGUMENT,
                             _not_valid(self._rpc, f"message {self._count}", self._type_name, err))

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: grpc.aio.Metadata | Sequence[tuple[str, str | bytes]] = ()) -> NoReturn:
        if self._client_stream and code == grpc.StatusCode.INVALID_ARGUMENT:
            await read_to_half_close(self._context)
        await self._context.abort(code, details, trailing_metadata)


class _Requests:
    """A stream-request RPC's messages, read through its `_RequestContext` (an async iterator, not
    an async generator: nothing is left to finalize when a handler stops reading early)."""

    def __init__(self, context: _RequestContext):
        self._context = context

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> Any:
        msg = await self._context.read()
        if msg is grpc.aio.EOF:
            raise StopAsyncIteration
        return msg


def _parsing_handler(rpc: str, type_name: str, h: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """`h` taking its request frames as bytes: a unary request is parsed before the behaviour runs,
    a stream's messages as the behaviour reads them (`_RequestContext`); a frame that does not parse
    ends the RPC with INVALID_ARGUMENT naming the RPC and the message type."""
    kind = _kind(h.request_streaming, h.response_streaming)
    behavior = getattr(h, kind)
    if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
        # A synchronous method: left to grpcio as it is (none in kuberl's servicers; see _Health).
        return h
    deserialize = h.request_deserializer
    if deserialize is None and not h.request_streaming:
        return h  # the behaviour reads the bytes itself

    async def arguments(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> tuple[object, object]:
        """The behaviour's arguments: the request (parsed) or the stream's messages, and its context."""
        if h.request_streaming:  # `request`, grpcio's iterator over the frames, is never read
            ctx = _RequestContext(context, rpc, type_name, deserialize, client_stream=not h.response_streaming)
            return _Requests(ctx), ctx
        assert deserialize is not None  # a unary request without a parser was left as it is, above
        try:
            return deserialize(request), context
        except DecodeError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _not_valid(rpc, "request", type_name, err))

    # The wrapper is of the same kind as the behaviour: grpcio tells a handler that writes through
    # its context (a coroutine) from one that yields its responses (an async generator) by that.
    handler: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], object]
    if inspect.isasyncgenfunction(behavior):
        async def generator_handler(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            async for response in behavior(*await arguments(request, context)):
                yield response
        handler = generator_handler
    else:
        async def coroutine_handler(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            return await behavior(*await arguments(request, context))
        handler = coroutine_handler

    return _HANDLER_FACTORIES[kind](handler, request_deserializer=None, response_serializer=h.response_serializer)


class _Health(health.aio.HealthServicer):  # type: ignore[misc]  # Any: grpcio-health-checking has no types
    """grpcio's asyncio health servicer, plus the Health/List RPC it leaves to the generated base
    class (a synchronous UNIMPLEMENTED stub, which grpcio would also answer garbage for with UNKNOWN).

    The base class keeps its statuses to itself, so this one keeps the same record through the
    public `set` and `enter_graceful_shutdown`: the server's overall status starts SERVING, a `set`
    after the graceful shutdown began changes nothing, and that shutdown turns every status NOT_SERVING.
    """

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, int] = {health.OVERALL_HEALTH: health_pb2.HealthCheckResponse.SERVING}
        self._shutting_down = False

    async def set(self, service: str, status: int) -> None:
        await super().set(service, status)
        if not self._shutting_down:
            self._statuses[service] = status

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        self._shutting_down = True
        self._statuses = dict.fromkeys(self._statuses, health_pb2.HealthCheckResponse.NOT_SERVING)

    def status(self, name: str) -> int:
        """The status a Check of `name` reports now (SERVICE_UNKNOWN for a name never set)."""
        unknown: int = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN  # (health_pb2 is untyped: Any)
        return self._statuses.get(name, unknown)

    async def List(self, request: health_pb2.HealthListRequest,
                   context: grpc.aio.ServicerContext[Any, Any]) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status) for name, status in self._statuses.items()})


def is_loopback(host: str) -> bool:
    """True for a host only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def role_names_served(tls: TlsConfig | None, service_names: list[str]) -> dict[str, tuple[str, ...]]:
    """`tls.role_names` where these services have internal RPCs to authorise (the buffer's, the
    learner's), else {}. Authorising by certificate needs verified client certificates: TlsError
    otherwise."""
    if tls is None or not tls.role_names:
        return {}
    if not any(method.split("/")[1] in service_names for method in ROLE_RPCS):
        return {}
    if not tls.enabled or tls.client_auth != "require":
        raise TlsError(f"tls.role_names is set, so {', '.join(service_names)} authorises its callers by their "
                       f"certificates, but {'tls.enabled is false' if not tls.enabled else 'tls.client_auth is none'}:"
                       f" it needs tls.enabled and client_auth: require")
    return dict(tls.role_names)


async def start_server(listen: str, register: Callable[[grpc.aio.Server], None], service_names: list[str], *,
                       max_message_bytes: int, max_connection_age_s: float | None = 300.0,
                       tls: TlsConfig | None = None, auth: AuthConfig | None = None,
                       metrics: Metrics | None = None) -> Serving:
    """Create a server, let `register(server)` add servicers, add health + reflection, bind, start.

    `register` adds each servicer with `add_servicer` (or `add_handlers`), so that malformed
    request frames get INVALID_ARGUMENT.

    `listen` is host:port; port 0 binds a free port (the returned address has the real one).
    Health starts NOT_SERVING; the caller flips it when ready. `max_connection_age_s` (None = no limit)
    makes clients reconnect, and so rebalance onto new pods; it also ends every stream on the
    connection, so services whose clients hold long sessions (actors) pass None.

    `tls` on: every RPC, health and reflection included, is served over TLS on this one port, with
    client certificates required under `client_auth: require` (services/common/net/tls.py); the
    certificate files are read again when they change. Off on an address other hosts can reach: one
    warning says so.

    With `tls.role_names`, the internal RPCs among `service_names` are served only to clients whose
    certificate names the role that calls them (services/common/net/auth.ROLE_RPCS).

    `auth` (the config's auth section): bearer tokens and EnvSession caps (services/common/net/auth.py);
    `metrics` counts refusals. No token files on an address other hosts can reach, for a service with
    RPCs that would need one: one warning says so.
    """
    host = listen.rsplit(":", 1)[0]
    served_tls = tls if tls is not None and tls.enabled else None  # TLS on
    credentials = server_credentials(served_tls) if served_tls is not None else None  # TlsError before anything is bound
    role = service_names[0].rsplit(".", 1)[-1].lower() if service_names else "grpc"
    role_names = role_names_served(tls, service_names)  # TlsError before anything is bound
    interceptors = [AuthInterceptor(auth, role, metrics, role_names)] if auth is not None or role_names else []
    # (AuthError before binding)
    server = grpc.aio.server(interceptors=interceptors,
                             options=server_options(max_message_bytes, max_connection_age_s))
    register(server)
    health_servicer = _Health()
    # Health and reflection go through the same parsing registration as the services' own RPCs.
    pool = descriptor_pool.Default()
    add_servicer(server, pool.FindServiceByName(health.SERVICE_NAME), health_servicer)
    reflector = reflection.aio.ReflectionServicer([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME])
    add_servicer(server, pool.FindServiceByName(reflection.SERVICE_NAME), reflector)
    port = server.add_secure_port(listen, credentials) if credentials is not None else server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"could not bind {listen}")
    if served_tls is not None:
        log.info("serving TLS on %s with %s (%s)", listen, served_tls.cert_file, "client certificates required"
                 if served_tls.client_auth == "require" else "no client certificate asked for")
    elif not is_loopback(host):
        log.warning("serving %s on %s without TLS: anyone who can reach this address can call every RPC; "
                    "set tls.enabled (docs/security.md)", ", ".join(service_names) or "gRPC", listen)
    guarded = [m for m in ("Actor/EnvSession", "Planner/SetReplicas")
               if any(name.endswith("." + m.split("/")[0]) for name in service_names)]
    if guarded and not (auth and auth.token_files) and not is_loopback(host):
        log.warning("serving %s on %s without tokens: anyone who can reach this address can call %s; set "
                    "auth.token_files (docs/security.md)", ", ".join(service_names), listen,
                    "EnvSession" if "Actor/EnvSession" in guarded else "the planner's write RPCs")
    await server.start()
    serving = Serving(server, health_servicer, service_names, f"{host}:{port}")
    await serving.set_serving(False)
    return serving


DNS_MIN_INTERVAL_MS = 1000       # re-resolve a peer's name at most once a second (default 30 s)
MAX_RECONNECT_BACKOFF_MS = 5000  # a peer restarted on the same address is tried again within 5 s (default 120 s)


def make_channel(target: str, max_message_bytes: int, receive_window_bytes: int | None = None, *,
                 tls: TlsConfig | None = None, policy: str | None = None) -> grpc.aio.Channel:
    """One channel per peer per process; round-robin over DNS results (headless Services).

    `receive_window_bytes` pins the HTTP/2 receive window (BDP probing off) so that at most about
    that much unread data waits in transit per stream: a learner uses it to keep batches from
    going stale in socket buffers, where no one can count or drop them. `tls` on: the peer's
    certificate is verified and this process's presented (services/common/net/tls.open_channel).
    `policy`: every call names it in its metadata (services/common/net/policy.py): a buffer's calls
    about one policy of several.
    """
    window = [] if receive_window_bytes is None else [
        ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", receive_window_bytes)]
    return open_channel(target, tls, aio=True, interceptors=policy_interceptors(policy) if policy else (), options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.enable_retries", 0),
        # A replaced pod comes back on a new address that only DNS knows. gRPC re-resolves when its
        # connections fail, but at most once per 30 s by default: the e2e pod-deletion test measured an
        # actor held off its new buffer for about 25 s, its send queue filling to 858 fragments.
        ("grpc.dns_min_time_between_resolutions_ms", DNS_MIN_INTERVAL_MS),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
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
