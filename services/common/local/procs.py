"""Local service processes: start one `python -m services.<role>`, find where it serves, stop it.

Used by `kuberl up` (buffer, planner, and every role when the planner is off) and by the planner's
local backend (actors and learners). Each process logs to `<run_dir>/logs/<name>.log` and, once
serving, writes `{address, metrics, pid}` to `<run_dir>/ready/<name>.json`.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback port free right now, for a process that will bind it later.

    It comes from below the kernel's ephemeral range: a port from `bind(("127.0.0.1", 0))` is
    ephemeral, and any process listening on port 0 in the meantime (an actor, a test server) could be
    handed the same one (seen: an actor took the port picked for the learner, which then failed to
    bind on every restart). Ports below the range are never handed out that way. Another process could
    still bind the port explicitly; the service then fails with a bind error its supervisor reports."""
    lo, _ = _ephemeral_range()
    candidates = random.sample(range(10_000, lo), min(64, max(lo - 10_000, 0)))
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free below the range: fall back to an ephemeral port
        s.bind(("127.0.0.1", 0))
        ephemeral: int = s.getsockname()[1]
        return ephemeral


class PortPicker:
    """Ports for one run's processes: each free when picked (`free_port`), never one in `avoid`, and
    never one handed out before: a process still starting has not bound its port, so a free-now check
    alone can pick it again (seen: the planner got the port of a buffer still starting and failed to
    bind it five times)."""

    def __init__(self, avoid: Iterable[int] = ()):
        self.taken = set(avoid)

    def __call__(self) -> int:
        while (port := free_port()) in self.taken:
            pass
        self.taken.add(port)
        return port


# Names the supervisor's pid to the child, which asks the kernel for SIGTERM when it dies
# (`die_with_parent`, called by every service at start), so no service outlives `kuberl up`.
PARENT_ENV = "KUBERL_PARENT_PID"


def die_with_parent() -> None:
    """Set PR_SET_PDEATHSIG (SIGTERM) in a process a kuberl supervisor started, after exec.

    Not in a preexec_fn: that makes subprocess fork() instead of vfork(), and gRPC's fork handlers then
    run in the child between fork and exec, which was seen aborting it with SIGABRT (2 in 650 spawns;
    grpc/grpc#43055). A supervisor that died before this ran is detected by the parent pid."""
    parent = os.environ.pop(PARENT_ENV, None)  # this process's own children get their own
    if not parent:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):
        raise SystemExit(f"the supervisor (pid {parent}) that started this process is gone")


@dataclass
class ServiceProcess:
    role: str
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    ready_path: Path
    address: str = ""
    metrics: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    def poll_ready(self) -> bool:
        """True once the service serves (its ready file exists); fills address and metrics."""
        if self.address:
            return True
        try:
            info = json.loads(self.ready_path.read_text())
        except (OSError, ValueError):
            return False
        self.address, self.metrics = info["address"], info.get("metrics")
        return True

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def spawn(role: str, name: str, run_dir: Path, config: Path, listen: str, extra: list[str]) -> ServiceProcess:
    """Start `python -m services.<role>` with its log and ready file under run_dir; returns at once."""
    run_dir = Path(run_dir)
    for sub in ("logs", "ready"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    ready = run_dir / "ready" / f"{name}.json"
    ready.unlink(missing_ok=True)
    log_path = run_dir / "logs" / f"{name}.log"
    cmd = [sys.executable, "-m", f"services.{role}", "--config", str(config), "--listen", listen,
           "--metrics-listen", "127.0.0.1:0", "--ready-file", str(ready), *extra]
    with open(log_path, "ab") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env={**os.environ, PARENT_ENV: str(os.getpid())})
    return ServiceProcess(role, name, popen, log_path, ready)


def learner_group_args(world_size: int, rank: int, group: str) -> list[str]:
    """The flags that place a learner in a group of `world_size` (none for a learner training alone)."""
    return ["--world-size", str(world_size), "--rank", str(rank), "--group", group] if world_size > 1 else []
