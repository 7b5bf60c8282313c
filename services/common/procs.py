"""Local service processes: start one `python -m services.<role>`, find where it serves, stop it.

Used by `kuberl up` (buffer, planner, and every role when the planner is off) and by the planner's
local backend (actors and learners). Each process logs to `<run_dir>/logs/<name>.log` and, once
serving, writes `{address, metrics, pid}` to `<run_dir>/ready/<name>.json`.
"""

from __future__ import annotations

import ctypes
import json
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    """A loopback port free right now. Another process could take it before the service binds it;
    the service then fails to start with a bind error, which its supervisor reports."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class ServiceProcess:
    role: str
    name: str
    popen: subprocess.Popen
    log_path: Path
    ready_path: Path
    address: str = ""
    metrics: str | None = None
    stats: dict = field(default_factory=dict)

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
                                 start_new_session=True, preexec_fn=_die_with_parent)
    return ServiceProcess(role, name, popen, log_path, ready)


def learner_group_args(world_size: int, rank: int, group: str) -> list[str]:
    """The flags that place a learner in a group of `world_size` (none for a learner training alone)."""
    return ["--world-size", str(world_size), "--rank", str(rank), "--group", group] if world_size > 1 else []
