"""Bearer tokens as clients send them (docs/security.md): the first token of a token file
(`read_client_token`), the metadata that carries it (`bearer_metadata`), and a blocking channel that
sends it on every call (`with_token`). What servers check is services/common/net/auth.py. Imports only
grpc: the Python simulator client (kuberl_client) uses this and nothing of the servers' side.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)
_Req = TypeVar("_Req")     # an intercepted call's request and response
_Resp = TypeVar("_Resp")


class AuthError(ValueError):
    """A token file that cannot be used; the message names the setting and the file."""


def read_client_token(path: str, setting: str = "token_file") -> str:
    """The first token of a token file (scopes and comments ignored)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise AuthError(f"{setting}: cannot read {path}: {err.strerror or err}") from None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            return line.split()[0]
    raise AuthError(f"{setting}: {path} holds no token")


_warned_plaintext = False


def bearer_metadata(token: str | None, secure: bool) -> tuple[tuple[str, str], ...]:
    """The metadata that carries `token` (none without one); over plaintext, one warning per process."""
    global _warned_plaintext
    if not token:
        return ()
    if not secure and not _warned_plaintext:
        _warned_plaintext = True
        log.warning("sending a bearer token without TLS: anyone on the path can read it (docs/security.md)")
    return (("authorization", f"Bearer {token}"),)


class _MetadataClient(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                      grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `metadata` to every call of a blocking channel."""

    def __init__(self, metadata: Iterable[tuple[str, str]]):
        self.metadata = tuple(metadata)

    def _details(self, details: grpc.ClientCallDetails) -> _Details:
        return _Details(details.method, details.timeout, (*(details.metadata or ()), *self.metadata),
                        details.credentials, getattr(details, "wait_for_ready", None),
                        getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Callable[[grpc.ClientCallDetails, _Req], grpc._CallFuture[_Resp]],
                              details: grpc.ClientCallDetails, request: _Req) -> grpc._CallFuture[_Resp]:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[[grpc.ClientCallDetails, _Req], grpc._CallIterator[_Resp]],
                               details: grpc.ClientCallDetails, request: _Req) -> grpc._CallIterator[_Resp]:
        return continuation(self._details(details), request)

    def intercept_stream_unary(
            self, continuation: Callable[[grpc.ClientCallDetails, Iterator[_Req]], grpc._CallFuture[_Resp]],
            details: grpc.ClientCallDetails, requests: Iterator[_Req]) -> grpc._CallFuture[_Resp]:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(
            self, continuation: Callable[[grpc.ClientCallDetails, Iterator[_Req]], grpc._CallIterator[_Resp]],
            details: grpc.ClientCallDetails, requests: Iterator[_Req]) -> grpc._CallIterator[_Resp]:
        return continuation(self._details(details), requests)


@dataclass(frozen=True)
class _Details(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: tuple[tuple[str, str | bytes], ...]
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


def with_token(channel: grpc.Channel, token: str | None, secure: bool) -> grpc.Channel:
    """`channel` sending `token` as bearer metadata on every call (as it is without a token)."""
    metadata = bearer_metadata(token, secure)
    return grpc.intercept_channel(channel, _MetadataClient(metadata)) if metadata else channel
