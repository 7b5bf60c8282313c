"""The one start-and-shutdown skeleton every role process runs on (the actor, the buffer, the learner,
the planner): a gRPC server and its metrics endpoint, background tasks, readiness, and an ordered list
of shutdown steps under one deadline. A role's `main.py` wires its parts into a `Lifecycle`; its
loops live in its own modules.

    lc = Lifecycle("buffer", metrics, deadline_s=10.0)
    await lc.serve(listen, register, [service name], max_message_bytes=..., tls=cfg.tls, auth=cfg.auth,
                   metrics_listen=metrics_listen)
    async with lc.running():
        lc.task(checkpointer.run(stop), "checkpoint")
        lc.on_stop(servicer.close)              # shutdown steps, in the order given
        lc.on_stop(lc.stop_server(grace=2.0))
        lc.after_deadline(last_checkpoint)
        await lc.ready()
        yield lc.endpoints

The contract of `running()`:
- On entry: a TaskGroup, with the stats tick (`tick_forever`) among its tasks. `ready()`, once the
  role's tasks are started, turns readiness SERVING. A task that raises ends the process (the TaskGroup cancels the rest, and the role's `serving`
  context unwinds through the same shutdown as a clean stop; `run_service` exits 1).
- On exit, however the body ends:
  1. readiness NOT_SERVING (load balancers and probes stop sending work);
  2. the steps given to `on_stop`, in order, all under one deadline (`deadline_s`): a hung drain
     cannot wedge a pod past its termination grace;
  3. every task still running is cancelled (but those started with `keep`, which a step ends);
  4. the steps given to `after_deadline`, in order, outside it (a last checkpoint: cut short, it
     would leave the previous one, so it is not raced against the clock);
  5. finally the server and the metrics endpoint close, then what was given to `on_close`, in reverse
     order of registration (channels, envs: the resources the role opened).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from services.common.net.grpcutil import Serving, start_server
from services.common.service.prometheus import MetricsServer, serve_metrics
from services.common.service.runtime import Endpoints
from services.common.settings import ConfigError
from services.common.stats import Metrics, tick_forever

log = logging.getLogger(__name__)

Step = Callable[[], Awaitable[Any] | None]


class Lifecycle:
    """One role process's server, tasks and shutdown sequence (see the module's docstring)."""

    def __init__(self, role: str, metrics: Metrics, *, deadline_s: float):
        self.role, self.metrics, self.deadline_s = role, metrics, deadline_s
        self.server: Serving | None = None
        self.prom: MetricsServer | None = None
        self._stop_steps: list[Step] = []
        self._after_steps: list[Step] = []
        self._closers: list[Step] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._group: asyncio.TaskGroup | None = None

    async def serve(self, listen: str, register: Callable[[Any], None], service_names: list[str], *,
                    max_message_bytes: int, metrics_listen: str | None = None, **server_options: Any) -> None:
        """Bind the role's gRPC server (`grpcutil.start_server`: health NOT_SERVING until `running()`)
        and, with `metrics_listen`, its Prometheus endpoint with the /livez and /readyz probes. An
        address that cannot be bound (in use, not this host's) is a ConfigError naming its flag,
        `--listen` or `--metrics-listen`: `run_service` says so in one line and exits 2."""
        if (why := unbindable(listen)) is not None:   # before gRPC, whose C core logs its own failure first
            raise bind_error("--listen", listen, why)
        try:
            self.server = await start_server(listen, register, service_names, max_message_bytes=max_message_bytes,
                                             metrics=self.metrics, **server_options)
        except (OSError, RuntimeError) as err:   # grpcio: RuntimeError("Failed to bind to address ...")
            if str(err).startswith(("Failed to bind", "could not bind")):
                raise bind_error("--listen", listen, unbindable(listen) or str(err)) from None
            raise
        if metrics_listen:
            try:
                self.prom = serve_metrics(self.metrics, metrics_listen, health=self.server)
            except OSError as err:   # socket.gaierror too: a host that is not this machine's
                await self.server.close()
                raise bind_error("--metrics-listen", metrics_listen, _os_error(err)) from None
            except BaseException:
                await self.server.close()
                raise

    @property
    def endpoints(self) -> Endpoints:
        """Where the role serves: its gRPC address and its metrics address (None: not served)."""
        assert self.server is not None, "serve() first"
        return Endpoints(self.server.address, self.prom.address if self.prom else None)

    def task(self, coro: Coroutine[Any, Any, Any], name: str, *, keep: bool = False) -> asyncio.Task[Any]:
        """Run `coro` as a task of the role (inside `running()`): its failure ends the process. At
        shutdown it is cancelled after the deadline's steps, unless `keep`: then a step ends it (a
        checkpoint loop told to write its last checkpoint, awaited after the deadline)."""
        assert self._group is not None, "tasks run inside running()"
        t = self._group.create_task(coro, name=name)
        if not keep:
            self._tasks.append(t)
        return t

    def on_stop(self, step: Step) -> None:
        """A shutdown step, run after the ones given before it, under the deadline."""
        self._stop_steps.append(step)

    def after_deadline(self, step: Step) -> None:
        """A shutdown step run after the deadline's steps and the tasks' cancellation, not raced against it."""
        self._after_steps.append(step)

    def on_close(self, closer: Step) -> None:
        """A resource to release at the very end, whatever happened (reverse order of registration)."""
        self._closers.append(closer)

    def stop_server(self, grace: float) -> Step:
        """The step that stops the gRPC server, letting calls in flight finish for `grace` seconds."""
        async def stop() -> None:
            assert self.server is not None
            await self.server.server.stop(grace=grace)
        return stop

    async def ready(self) -> None:
        """Readiness SERVING (the gRPC health service and /readyz): the role takes work."""
        assert self.server is not None, "serve() first"
        await self.server.set_serving(True)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Lifecycle]:
        """Serve until the body exits, then shut down in order (see the module's docstring)."""
        assert self.server is not None, "serve() first"
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                self.task(tick_forever(self.metrics), "stats")
                try:
                    yield self
                finally:
                    async with asyncio.timeout(self.deadline_s):
                        await self.server.set_serving(False)
                        for step in self._stop_steps:
                            await _run(step)
                    for t in self._tasks:
                        t.cancel()
                    for step in self._after_steps:
                        await _run(step)
        finally:
            self._group = None
            await self.server.close()
            if self.prom is not None:
                self.prom.close()
            for closer in reversed(self._closers):
                await _run(closer)


def unbindable(listen: str) -> str | None:
    """Why a TCP server could not bind `listen` (host:port) now, e.g. "[Errno 98] Address already in
    use"; None when it can (or for port 0, which binds a free one). Binds and closes a socket, with
    SO_REUSEADDR as the servers set it, so a port left in TIME_WAIT by a process just stopped is free."""
    shown, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return None
    host = shown.strip("[]") or None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as err:
        return _os_error(err)
    return None


def bind_error(flag: str, listen: str, why: str) -> ConfigError:
    """The one-line refusal of an address a role cannot serve on, naming the flag that sets it."""
    if "in use" in why:
        advice = ("another process serves there (another role on this machine: each needs its own ports); "
                  f"give this one {flag} HOST:PORT")
    else:
        advice = f"give {flag} HOST:PORT with a host of this machine"
    if flag == "--metrics-listen":
        advice += ", or '' to turn the metrics endpoint off"
    else:
        advice += " (port 0 picks a free one)"
    return ConfigError(flag, f"{listen} cannot be served on ({why}): {advice}")


def _os_error(err: OSError) -> str:
    return f"[Errno {err.errno}] {err.strerror}" if err.errno is not None and err.strerror else str(err)


async def _run(step: Step) -> None:
    result = step()
    if inspect.isawaitable(result):
        await result
