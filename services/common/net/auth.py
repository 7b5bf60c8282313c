"""Bearer tokens and session caps on the RPCs that people and simulators call (docs/security.md).

The settings are the config's `auth` section (services/common/config.AuthConfig):

- `TokenStore`: the tokens of `auth.token_files`, one per line (`TOKEN` or `TOKEN scope1,scope2`, `#`
  comments), read again when a file changes (its mtime, size or inode), so that tokens are rotated
  without a restart. Only SHA-256 digests are kept, and every presented token is compared with every
  known one with `hmac.compare_digest` on equal-length digests: no early exit, no length leak.
- `AuthInterceptor`: the server interceptor every role installs (`start_server`). EnvSession needs
  scope `envsession`, the planner's write RPCs `planner:write`, and with `auth.protect_reads` the
  read-only ones (GetStats, the planner's status, decisions and preview) `read`. Health, reflection and
  the roles' internal RPCs (PushTrajectories, WatchInsertLimit, StreamBatches, ReportProgress, SubscribeWeights,
  SetTopology) are never
  asked for a token: probes need health, and mTLS guards the internal ones. With `tls.role_names` it
  also authorises those per role: each is served only to a client whose certificate names the role
  that calls it (`ROLE_RPCS`), PERMISSION_DENIED otherwise. It also caps EnvSession sessions per token
  (per peer host without tokens): `auth.max_sessions_per_token` open at once and
  `auth.new_sessions_per_minute` (a token bucket).
What clients send (`read_client_token`, `bearer_metadata`, `with_token`) is services/common/net/tokens.py.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import math
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from services.common.atomic import stamps
from services.common.settings import require
from services.common.net.streams import read_to_half_close
from services.common.net.tokens import AuthError

if TYPE_CHECKING:
    from services.common.stats import Metrics

    Context = grpc.aio.ServicerContext[Any, Any]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AuthConfig:
    """Bearer tokens on the RPCs people and simulators call, and caps on EnvSession sessions
    (services/common/net/auth.py, docs/security.md). No token files: those RPCs stay open, as before."""
    token_files: tuple[str, ...] = ()  # files of accepted tokens, one per line
    #                               ("TOKEN" or "TOKEN scope1,scope2"; scopes envsession, planner:write, read;
    #                               none = all); re-read when they change, so tokens rotate without a restart
    protect_reads: bool = False     # GetStats and the planner's read-only RPCs also need a token (scope read)
    client_token_file: str = ""     # the token this role sends when it calls others (the planner's GetStats reads)
    max_sessions_per_token: int = 0     # EnvSession sessions open at once per token (per peer host without
    #                                     tokens); 0 = unlimited
    new_sessions_per_minute: float = 0  # new EnvSession sessions a minute per token (a token bucket); 0 = unlimited

    def __post_init__(self) -> None:
        for i, path in enumerate(self.token_files):
            require(isinstance(path, str) and bool(path.strip()), f"token_files[{i}]", path,
                    "must be a file path")
        require(self.max_sessions_per_token >= 0, "max_sessions_per_token", self.max_sessions_per_token,
                "must be >= 0 (0 = unlimited)")
        require(math.isfinite(self.new_sessions_per_minute) and self.new_sessions_per_minute >= 0,
                "new_sessions_per_minute", self.new_sessions_per_minute, "must be >= 0 (0 = unlimited)")


SCOPES = ("envsession", "planner:write", "read")
ENV_SESSION = "/kuberl.v1.Actor/EnvSession"
PLANNER_WRITES = frozenset(f"/kuberl.v1.Planner/{m}" for m in ("Apply", "SetReplicas", "ClearOverride", "Pause",
                                                              "Resume"))
PLANNER_READS = frozenset(f"/kuberl.v1.Planner/{m}" for m in ("Preview", "WatchDecisions", "GetStatus"))
STATS = frozenset(f"/kuberl.v1.{s}/GetStats" for s in ("Actor", "Buffer", "Learner", "Planner"))
# The roles' internal RPCs and the one role that calls each: what tls.role_names authorises.
ROLE_RPCS = {"/kuberl.v1.Buffer/PushTrajectories": "actor", "/kuberl.v1.Buffer/WatchInsertLimit": "actor",
             "/kuberl.v1.Buffer/StreamBatches": "learner", "/kuberl.v1.Buffer/ReportProgress": "learner",
             "/kuberl.v1.Learner/SubscribeWeights": "actor",
             # The planner's shard list (optional: authorised only where tls.role_names names the planner).
             "/kuberl.v1.Buffer/SetTopology": "planner"}


def scope_of(method: str, protect_reads: bool) -> str | None:
    """The scope an RPC needs, or None when it is open (health, reflection, internal RPCs, and reads
    unless `protect_reads`)."""
    if method == ENV_SESSION:
        return "envsession"
    if method in PLANNER_WRITES:
        return "planner:write"
    if protect_reads and (method in PLANNER_READS or method in STATS):
        return "read"
    return None


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def parse_tokens(text: str, where: str) -> list[tuple[bytes, frozenset[str]]]:
    """(digest, scopes) per token line of a token file; no scopes = every scope."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2:
            raise AuthError(f"{where}:{n}: a line is 'TOKEN' or 'TOKEN scope1,scope2' (scopes: {', '.join(SCOPES)})")
        scopes = frozenset(s for s in (parts[1].split(",") if len(parts) == 2 else ()) if s)
        if scopes - set(SCOPES):   # not echoed: a line written the wrong way round would print its token
            raise AuthError(f"{where}:{n}: an unknown scope after the token (known: {', '.join(SCOPES)})")
        out.append((_digest(parts[0].encode()), frozenset(SCOPES) if not scopes else scopes))
    return out


class TokenStore:
    """The tokens of `files`, read again when one changes; a change that does not load is logged and the
    previous tokens kept."""

    def __init__(self, files: list[str] | tuple[str, ...]):
        self.files = tuple(files)
        self.lock = threading.Lock()
        stamp = self._stamp()  # before reading: a change in between is read again at the next call
        self.tokens = self._load(self.files)  # AuthError naming the file when one cannot be read
        self.stamp = stamp

    def _stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        return stamps(self.files)  # None for a file that is gone

    def _reload(self) -> list[tuple[bytes, frozenset[str]]]:
        """The tokens of the files still there: a deleted file (a token file taken out of a Secret)
        revokes its tokens. All of them gone is refused (the previous tokens are kept)."""
        present = [path for path in self.files if os.path.exists(path)]
        if len(present) < len(self.files):
            log.warning("token files gone, their tokens no longer accepted: %s",
                        ", ".join(sorted(set(self.files) - set(present))))
        if not present:
            raise AuthError(f"auth.token_files: none of {', '.join(self.files)} exists")
        return self._load(present)

    def _load(self, files: Sequence[str]) -> list[tuple[bytes, frozenset[str]]]:
        tokens = []
        for path in files:
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as err:
                raise AuthError(f"auth.token_files: cannot read {path}: {getattr(err, 'strerror', None) or err}") \
                    from None
            tokens += parse_tokens(text, f"auth.token_files: {path}")
        if not tokens:
            raise AuthError(f"auth.token_files: {', '.join(files)} hold no token")
        return tokens

    def current(self) -> list[tuple[bytes, frozenset[str]]]:
        with self.lock:
            stamp = self._stamp()
            if stamp != self.stamp:
                self.stamp = stamp
                try:
                    self.tokens = self._reload()
                    log.info("token files changed: %d tokens now accepted", len(self.tokens))
                except AuthError as err:
                    log.warning("token files changed but do not load, keeping the previous tokens: %s", err)
            return self.tokens

    def scopes(self, token: str) -> frozenset[str] | None:
        """The scopes of `token`, None when it is not known. Every known token is compared."""
        presented = _digest(token.encode())
        found = None
        for digest, scopes in self.current():
            if hmac.compare_digest(digest, presented) and found is None:
                found = scopes
        return found


MAX_BUCKETS = 10_000  # token buckets kept before full ones (no recent sessions) are dropped


class _Bucket:
    def __init__(self, per_minute: float):
        self.capacity = max(1.0, per_minute)
        self.rate = per_minute / 60.0
        self.level, self.at = self.capacity, time.monotonic()

    def full(self) -> bool:
        return self.level + (time.monotonic() - self.at) * self.rate >= self.capacity

    def take(self) -> bool:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level < 1.0:
            return False
        self.level -= 1.0
        return True


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


@dataclass
class _Caps:
    max_open: int
    per_minute: float
    metrics: Metrics | None

    def __post_init__(self) -> None:
        self.open: dict[str, int] = defaultdict(int)
        self.buckets: dict[str, _Bucket] = {}

    def acquire(self, key: str) -> None:
        if self.max_open and self.open.get(key, 0) >= self.max_open:
            self._refuse("cap", f"auth.max_sessions_per_token: {self.max_open} sessions already open "
                                f"for this {'token' if key.startswith('token:') else 'peer'}")
        if self.per_minute:
            if len(self.buckets) >= MAX_BUCKETS:  # many clients: forget those whose buckets refilled, and
                # at most MAX_BUCKETS of the rest (the oldest first: dicts keep insertion order)
                kept = [(k, b) for k, b in self.buckets.items() if not b.full()]
                self.buckets = dict(kept[len(kept) - MAX_BUCKETS // 2:] if len(kept) > MAX_BUCKETS // 2 else kept)
            bucket = self.buckets.setdefault(key, _Bucket(self.per_minute))
            if not bucket.take():
                self._refuse("rate", f"auth.new_sessions_per_minute: more than {self.per_minute:g} new sessions a "
                                     f"minute for this {'token' if key.startswith('token:') else 'peer'}")
        self.open[key] += 1

    def release(self, key: str) -> None:
        self.open[key] -= 1
        if self.open[key] <= 0:
            del self.open[key]

    def _refuse(self, reason: str, details: str) -> NoReturn:
        if self.metrics is not None:
            self.metrics.inc("actor/sessions_refused_total")
            self.metrics.inc(f"actor/sessions_refused_{reason}_total")
        raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, details)


def _bearer(context: Context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            value = value.decode("latin-1") if isinstance(value, bytes) else value
            if value[:7].lower() == "bearer ":
                return value[7:].strip()
            return None
    return None


def peer_names(context: Context) -> list[str]:
    """The names the client's verified certificate carries, lower-cased: the DNS names of its
    subjectAltName, or its CN when it has none (RFC 6125: a CN is not looked at beside DNS names). IP,
    URI and email entries are not names here. Empty without a client certificate."""
    props = context.auth_context() or {}
    names = props.get("peer_dns") or props.get("x509_common_name") or ()
    return [(n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n)).strip().lower() for n in names]


def _peer_host(context: Context) -> str:
    peer = context.peer() or "unknown"
    return peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Asks for tokens and scopes (when tokens are configured), for the calling role's certificate on
    the internal RPCs (with `role_names`, tls.role_names), and caps EnvSession sessions."""

    def __init__(self, auth: AuthConfig | None, role: str, metrics: Metrics | None = None,
                 role_names: dict[str, tuple[str, ...]] | None = None):
        self.store = TokenStore(auth.token_files) if auth is not None and auth.token_files else None
        self.protect_reads = auth is not None and auth.protect_reads
        self.role, self.metrics = role, metrics
        self.role_names = {r: frozenset(n.strip().lower() for n in names) for r, names in (role_names or {}).items()}
        self._logged_wrong: set[tuple[str, tuple[str, ...]]] = set()
        self.caps = _Caps(auth.max_sessions_per_token, auth.new_sessions_per_minute, metrics) \
            if auth is not None and (auth.max_sessions_per_token or auth.new_sessions_per_minute) else None
        if metrics is not None and self.store is not None:
            for name in ("auth_refused_total", "auth_denied_total"):
                metrics.inc(f"{role}/{name}", 0)
        if metrics is not None and self.role_names:
            metrics.inc(f"{role}/auth_wrong_role_total", 0)
        if metrics is not None and self.caps is not None and role == "actor":
            for name in ("sessions_refused_cap_total", "sessions_refused_rate_total"):
                metrics.inc(f"actor/{name}", 0)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        scope = scope_of(method, self.protect_reads) if self.store is not None else None
        capped = self.caps is not None and method == ENV_SESSION
        caller = ROLE_RPCS.get(method) if self.role_names else None
        if caller not in self.role_names:
            caller = None
        if handler is None or (scope is None and not capped and caller is None):
            return handler
        return _guarded(handler, method, lambda context: self._admit(context, method, scope, capped, caller),
                        self._release)

    def _admit(self, context: Context, method: str, scope: str | None, capped: bool,
               caller: str | None = None) -> str | None:
        key: str | None = None
        if caller is not None:
            names = peer_names(context)
            if not self.role_names[caller].intersection(names):
                self._count("auth_wrong_role_total")
                presented = ", ".join(names[:4]) or "no DNS name or CN"
                kind = (caller, tuple(names[:4]))
                if kind not in self._logged_wrong and len(self._logged_wrong) < 1000:   # once per kind of caller
                    self._logged_wrong.add(kind)
                    log.warning("refusing %s to %s (%s): its certificate names %s, none of tls.role_names.%s (%s)",
                                method, _peer_host(context), caller, presented, caller,
                                ", ".join(sorted(self.role_names[caller])))
                # (the names accepted are in the server's log, not told to whoever asks)
                raise _Refused(grpc.StatusCode.PERMISSION_DENIED,
                               f"{method} is served to {caller}s only: the client certificate names {presented}, "
                               f"not one of tls.role_names.{caller}")
        if scope is not None:
            assert self.store is not None   # a scope is asked for only where tokens are configured
            token = _bearer(context)
            scopes = self.store.scopes(token) if token else None
            if scopes is None:
                self._count("auth_refused_total")
                raise _Refused(grpc.StatusCode.UNAUTHENTICATED,
                               f"{method}: {'no bearer token' if not token else 'the bearer token is not known'}; send "
                               f"'authorization: Bearer <token>' metadata with a token of auth.token_files")
            if scope not in scopes:
                self._count("auth_denied_total")
                raise _Refused(grpc.StatusCode.PERMISSION_DENIED, f"{method}: the token lacks scope '{scope}'")
            assert token    # (no token has no scopes: refused above)
            key = "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]
        if capped:
            key = key or "peer:" + _peer_host(context)
            assert self.caps is not None    # (capped: there are caps)
            self.caps.acquire(key)
            return key
        return None

    def _release(self, key: str | None) -> None:
        if key is not None:   # (a key is given only where there are caps)
            assert self.caps is not None
            self.caps.release(key)

    def _count(self, name: str) -> None:
        if self.metrics is not None:
            self.metrics.inc(f"{self.role}/{name}")


def _guarded(handler: grpc.RpcMethodHandler[Any, Any], method: str, admit: Callable[[Context], str | None],
             release: Callable[[str | None], None]) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` run only once `admit(context)` passed (its key given to `release` when the RPC ends)."""
    kind = ("stream" if handler.request_streaming else "unary") + "_" + \
        ("stream" if handler.response_streaming else "unary")
    behavior = getattr(handler, kind)

    client_stream = handler.request_streaming and not handler.response_streaming

    async def check(context: Context) -> str | None:
        try:
            return admit(context)
        except _Refused as err:
            if client_stream:   # (services/common/net/streams.py: else the client would see INTERNAL)
                await read_to_half_close(context)
            await context.abort(err.code, err.details)

    wrapped: Callable[[Any, Context], Any]
    if inspect.isasyncgenfunction(behavior):
        async def streamed(request: Any, context: Context) -> AsyncIterator[Any]:
            key = await check(context)
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                release(key)
        wrapped = streamed
    else:
        async def answered(request: Any, context: Context) -> Any:
            key = await check(context)
            try:
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
            finally:
                release(key)
        wrapped = answered

    make = getattr(grpc, f"{kind}_rpc_method_handler")
    guarded: grpc.RpcMethodHandler[Any, Any] = make(wrapped, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)
    return guarded
