"""Process lifecycle shared by every service: argument parsing, logging, uvloop, signals, exit codes.

`run_service` runs `serve(args, stop)` on uvloop; SIGTERM and SIGINT set `stop`, after which the
service runs its own shutdown sequence. A crash in any background loop ends the process with
exit code 1 (Kubernetes restarts it); a clean stop exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NoReturn
from pathlib import Path

from services.common.procs import die_with_parent

log = logging.getLogger(__name__)


def base_parser(role: str, default_port: int, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"kuberl {role}", description=description)
    p.add_argument("--config", default=os.environ.get("KUBERL_CONFIG"),
                   help="experiment config YAML (default: $KUBERL_CONFIG, else built-in CartPole PPO)")
    p.add_argument("--listen", default=f"0.0.0.0:{default_port}",
                   help=f"host:port to serve gRPC on; port 0 picks a free one (default 0.0.0.0:{default_port})")
    p.add_argument("--metrics-listen", default=os.environ.get("KUBERL_METRICS_LISTEN", "0.0.0.0:9400"),
                   help="host:port for the Prometheus /metrics endpoint; '' turns it off (default 0.0.0.0:9400)")
    p.add_argument("--ready-file", default=None,
                   help="write {address, metrics, pid} as JSON here once serving (used by `kuberl up`)")
    p.add_argument("--log-level", default=os.environ.get("KUBERL_LOG_LEVEL", "INFO"))
    return p


def configure_logging(level: str, role: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s")


@dataclass(frozen=True)
class Endpoints:
    """Where a running service listens: gRPC, and the Prometheus /metrics endpoint (None if off)."""
    grpc: str
    metrics: str | None = None


def write_ready_file(path: str | None, endpoints: Endpoints) -> None:
    if not path:
        return
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": endpoints.grpc, "metrics": endpoints.metrics, "pid": os.getpid()}))
    tmp.replace(path)


def stop_cleanly_until_serving() -> None:
    """Until run_service installs its own handlers, SIGTERM ends the process at once with exit code 0.

    Every role's `__main__` calls this before importing its service (torch alone takes seconds). A
    process asked to stop while still importing has served nothing, holds nothing and has nothing to
    flush; the default action would end it with -15, which `kuberl up`, the planner's local backend and
    Kubernetes all read as a crash (seen: an actor the planner added just before a run's target was
    reached, stopped mid-import)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))


def run_service(role: str, args: argparse.Namespace,
                serve: Callable[[argparse.Namespace, asyncio.Event], Awaitable[None]]) -> int:
    """Run a service until SIGTERM/SIGINT; return the process exit code."""
    die_with_parent()
    configure_logging(args.log_level, role)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(args, stop)

    import uvloop

    try:
        uvloop.run(main())
    except Exception as exc:  # a background loop crashed: end loudly, let the supervisor restart us
        for err in (exc.exceptions if isinstance(exc, BaseExceptionGroup) else [exc]):
            log.critical("%s failed: %s", role, err, exc_info=err)
        return 1
    log.info("%s stopped cleanly", role)
    return 0


def exit_process(code: int) -> NoReturn:
    """End a service process once its shutdown sequence has run: flush logs and stdio, then leave
    without interpreter finalisation. By then every server, channel and checkpoint is closed; what is
    left are library threads (gRPC's poller, torch's pools), and joining those at exit is where a
    process can hang (seen with gRPC in pytest's final garbage collection), leaving its supervisor to
    kill it and count a failure."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
