"""The planner's one way to the Kubernetes API: every call goes through `KubeApi.call`, which checks it
against services/planner/rbac.RULES (a call not listed there is a bug and raises), records it in
`calls`, waits on a client-side token bucket (qps/burst), runs the blocking official client in a
thread, retries 429 (honouring Retry-After), 5xx and connection failures with capped exponential
backoff and jitter, and turns what remains into an `ApiError` whose message names the verb, resource,
object and namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import os
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from services.planner import rbac

log = logging.getLogger(__name__)
IN_CLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
MAX_ATTEMPTS = 5            # per call: the first try plus up to 4 retries of 429 / 5xx / connection failures
BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 10.0
RETRY_AFTER_CAP_S = 60.0


class ApiError(RuntimeError):
    """The Kubernetes API refused or failed a call; `status` is the HTTP status (0: no response)."""

    def __init__(self, verb: str, group: str, resource: str, name: str, namespace: str, status: int,
                 reason: str, message: str, retry_after: float | None = None):
        self.verb, self.group, self.resource, self.name, self.namespace = verb, group, resource, name, namespace
        self.status, self.reason, self.message, self.retry_after = status, reason, message, retry_after
        what = f"{verb} {group + '/' if group else ''}{resource}" + (f" {name!r}" if name else "")
        where = f" in namespace {namespace!r}" if namespace else ""
        status_text = f"HTTP {status} {reason}".strip() if status else "no response"
        hint = ""
        if status in (401, 403):
            hint = (" (the planner's identity lacks this permission: its Role must grant the rules in "
                    "services/planner/rbac.py)")
        super().__init__(f"kubernetes API: {what}{where} failed with {status_text}: {message}{hint}")


class TokenBucket:
    """Client-side rate limit: `qps` tokens per second, at most `burst` saved up. `reserve()` takes a
    token (the bucket may go negative) and returns how long the caller must wait before using it."""

    def __init__(self, qps: float, burst: int, clock=time.monotonic):
        self.qps, self.burst, self._clock = qps, burst, clock
        self._tokens = float(burst)
        self._last = clock()

    def reserve(self) -> float:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.qps)
        self._last = now
        self._tokens -= 1
        return max(0.0, -self._tokens / self.qps)

    async def acquire(self) -> None:
        delay = self.reserve()
        if delay > 0:
            await asyncio.sleep(delay)


class KubeApi:
    """Calls to one namespace of one API server, rate-limited to `qps`/`burst`, each with `timeout_s`.
    `namespace` may be set once the client is loaded (the in-cluster one is read then)."""

    def __init__(self, qps: float, burst: int, timeout_s: float, namespace: str = ""):
        self.namespace, self.timeout_s = namespace, timeout_s
        self.calls: set[tuple[str, str, str]] = set()   # (group, resource, verb) of every call made
        self._limiter = TokenBucket(qps, burst)

    async def call(self, verb: str, group: str, resource: str, name: str, fn: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> Any:
        """Run one blocking client call in a thread, rate-limited and retried (see the module docstring)."""
        if not rbac.allowed(group, resource, verb):
            raise RuntimeError(f"bug: the planner tried to {verb} {group or 'core'}/{resource}, which "
                               f"services/planner/rbac.py RULES does not grant")
        self.calls.add((group, resource, verb))
        for attempt in range(MAX_ATTEMPTS):
            await self._limiter.acquire()
            try:
                return await asyncio.to_thread(fn, *args, _request_timeout=self.timeout_s, **kwargs)
            except ApiException as e:
                err = ApiError(verb, group, resource, name, self.namespace, e.status or 0, e.reason or "",
                               _status_message(e), _retry_after(e.headers))
            except (urllib3.exceptions.HTTPError, OSError) as e:
                err = ApiError(verb, group, resource, name, self.namespace, 0, "", f"connection failed: {e}")
            if not (err.status in (0, 429) or err.status >= 500) or attempt == MAX_ATTEMPTS - 1:
                raise err
            delay = err.retry_after
            if delay is None:
                delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** attempt) * random.uniform(0.5, 1.0)
            log.info("%s; retrying in %.2f s (attempt %d of %d)", err, delay, attempt + 2, MAX_ATTEMPTS)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")


def _retry_after(headers) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), capped; None if absent/bad."""
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = (email.utils.parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), RETRY_AFTER_CAP_S)


def _status_message(e: ApiException) -> str:
    try:
        return json.loads(e.body).get("message") or e.body
    except (TypeError, ValueError, AttributeError):
        return (e.body or "").strip() or str(e.reason)


def micro_time(dt: datetime | None = None) -> str:
    """RFC 3339 with microseconds, as a MicroTime field wants it."""
    return (dt or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def load_client(kubeconfig: str | None) -> tuple[client.ApiClient, str]:
    """Blocking: an ApiClient from `kubeconfig` if given, else in-cluster auth, else ~/.kube/config; and the
    namespace that source names ("" if none). urllib3 retries only failed connections: status codes
    (429/5xx) are retried by KubeApi.call, which honours Retry-After and the rate limit."""
    cfg = client.Configuration()
    namespace = ""
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=cfg)
            with contextlib.suppress(OSError), open(IN_CLUSTER_NAMESPACE) as f:
                namespace = f.read().strip()
        except config.ConfigException:
            kubeconfig = os.path.expanduser("~/.kube/config")
    if kubeconfig is not None:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg, persist_config=False)
        _, active = config.list_kube_config_contexts(kubeconfig)
        namespace = (active or {}).get("context", {}).get("namespace", "")
    cfg.retries = urllib3.Retry(total=None, connect=2, read=0, redirect=0, status=0, other=0,
                                respect_retry_after_header=False)
    return client.ApiClient(cfg), namespace
