"""Local process supervision, shared by `kuberl up` and the planner's local backend.

One place says how each role is started on this machine (`actor_args`, `learner_args`) and what
happens when a process dies on its own: its exit code and last log lines are recorded, an event is
appended to `<run_dir>/events.jsonl` (which `kuberl up` prints as it happens), and it is started
again with the same command line after a backoff (1, 2, 5, 10, 30 s; reset once it has run for
STABLE_S), like a Deployment's pod. The same listen address is reused, so peers that reconnect with
backoff find it again. One that fails MAX_FAILURES times in a row without running STABLE_S (a bad flag,
a port another program holds) is given up on, and the event says so. A process that is stopped on
purpose (`stop`, `forget`) is never restarted.

Synchronous and free of asyncio: callers poll `check()` from their own loop.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.config import ExperimentConfig
from services.common.procs import ServiceProcess, learner_group_args, spawn

log = logging.getLogger(__name__)
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_S = 60.0        # a process that ran this long before dying starts the backoff over
MAX_FAILURES = 5       # short-lived deaths in a row after which a process is no longer restarted
LOG_TAIL_LINES = 12


def actor_args(name: str, run_name: str, *, buffer: str, learner: str, index: int) -> list[str]:
    """`kuberl actor` flags for actor `name` of a local run (its id is stable across restarts; each
    process still gets its own incarnation, see services/common/fragments.py)."""
    return ["--buffer", buffer, "--learner", learner, "--actor-id", f"{name}-{run_name}", "--actor-index", str(index)]


def learner_args(name: str, run_dir: Path, *, buffer: str, world_size: int = 1, rank: int = 0,
                 group: str = "") -> list[str]:
    """`kuberl learner` flags for learner `name` (rank `rank` of a group of `world_size`)."""
    return ["--buffer", buffer, "--checkpoint-dir", str(Path(run_dir) / "checkpoints"),
            "--learner-id", f"{name}-{Path(run_dir).name}", *learner_group_args(world_size, rank, group)]


def buffer_args(cfg: ExperimentConfig, run_dir: Path) -> list[str]:
    """`kuberl buffer` flags for the buffer of a local run: a relative `buffer.checkpoint_dir` is
    taken inside the run directory, so a restarted buffer restores the run's own replay."""
    if cfg.buffer.checkpoint_dir is None:
        return []
    return ["--checkpoint-dir", str(Path(run_dir) / cfg.buffer.checkpoint_dir)]


@dataclass(frozen=True)
class Spec:
    """How to start one process: `python -m services.<role> --listen <listen> <extra>`."""
    role: str
    name: str
    listen: str
    extra: tuple[str, ...] = ()
    restart: bool = True   # False: a death is recorded and reported, the caller decides (learner groups)


class Supervisor:
    def __init__(self, run_dir: Path, config_path: Path, *, on_restart=None, log_events: bool = True):
        self.run_dir, self.config_path = Path(run_dir), Path(config_path)
        self.events_path = self.run_dir / "events.jsonl"
        self.specs: dict[str, Spec] = {}
        self.procs: dict[str, ServiceProcess] = {}
        self.started_at: dict[str, float] = {}
        self.failures: dict[str, int] = {}        # consecutive short-lived deaths, for the backoff
        self.next_start: dict[str, float] = {}    # dead, waiting to be started again
        self.restarts: dict[str, int] = {}
        self.exit_codes: dict[str, int | None] = {}
        self.on_restart = on_restart              # called with the name after each restart
        self.log_events = log_events              # False where the caller prints events.jsonl itself

    # -- starting and stopping -------------------------------------------------------------------
    def start(self, spec: Spec) -> ServiceProcess:
        """Start (or replace the record of) `spec.name` now; returns at once."""
        proc = spawn(spec.role, spec.name, self.run_dir, self.config_path, spec.listen, list(spec.extra))
        self.specs[spec.name], self.procs[spec.name] = spec, proc
        self.started_at[spec.name] = time.monotonic()
        self.next_start.pop(spec.name, None)
        log.info("started %s (pid %d, log %s)", spec.name, proc.popen.pid, proc.log_path)
        return proc

    def forget(self, name: str) -> ServiceProcess | None:
        """Stop supervising `name` (the caller stops or drains it); returns its process."""
        self.specs.pop(name, None)
        self.next_start.pop(name, None)
        return self.procs.pop(name, None)

    def stop(self, names, timeout_s: float) -> dict[str, int | None]:
        """SIGTERM `names` together, wait up to `timeout_s` for each, then SIGKILL; never restarted."""
        procs = [p for p in (self.forget(n) for n in names) if p is not None]
        for p in procs:
            p.terminate()
        for p in procs:
            self.exit_codes[p.name] = wait_or_kill(p, timeout_s)
        return {p.name: self.exit_codes[p.name] for p in procs}

    # -- watching --------------------------------------------------------------------------------
    def check(self, now: float | None = None) -> list[ServiceProcess]:
        """Record every supervised process that died since the last check (returned), and start
        again the ones whose backoff is over. Call about once a second."""
        now = time.monotonic() if now is None else now
        died = []
        for name, proc in list(self.procs.items()):
            spec = self.specs.get(name)
            if spec is None or proc.alive:
                continue
            if name in self.next_start:
                if now >= self.next_start[name]:
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    self.start(spec)
                    self.event(name, "restarted", restarts=self.restarts[name])
                    if self.on_restart is not None:
                        self.on_restart(name)
                continue
            died.append(proc)
            code = proc.popen.returncode
            self.exit_codes[name] = code
            ran = now - self.started_at.get(name, now)
            self.failures[name] = 0 if ran >= STABLE_S else self.failures.get(name, 0) + 1
            if spec.restart and self.failures[name] < MAX_FAILURES:
                delay = RESTART_BACKOFF_S[min(max(self.failures[name] - 1, 0), len(RESTART_BACKOFF_S) - 1)]
                self.next_start[name] = now + delay
                self.event(name, "exited", code=code, restart_in_s=delay, log_tail=proc.log_tail(LOG_TAIL_LINES))
            else:  # the caller decides (a group member), or it fails the same way every time (a bad flag)
                self.specs.pop(name, None)
                self.event(name, "exited", code=code, log_tail=proc.log_tail(LOG_TAIL_LINES),
                           **({"gave_up_after": self.failures[name]} if spec.restart else {}))
        return died

    def event(self, name: str, what: str, **fields) -> None:
        """Append one event to events.jsonl and the log (`kuberl up` prints them as they come)."""
        record = {"unix_s": round(time.time(), 3), "name": name, "event": what, **fields}
        tail = fields.get("log_tail")
        if self.log_events:
            log.log(logging.ERROR if what == "exited" else logging.INFO, "%s %s%s", name, what, "".join(f" {k}={v}" for k, v in fields.items() if k != "log_tail")
                      + (f"; its log ends:\n{tail}" if tail else ""))
        # One write on an O_APPEND descriptor: `kuberl up`'s and the planner's supervisors share the file.
        fd = os.open(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)


def wait_or_kill(p: ServiceProcess, timeout_s: float) -> int | None:
    """Wait for `p` to exit (after a SIGTERM sent by the caller), SIGKILL it after `timeout_s`."""
    try:
        return p.popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("%s did not stop within %.0f s; killing it", p.name, timeout_s)
        p.popen.kill()
        return p.popen.wait()


def format_event(record: dict) -> str:
    """One events.jsonl record as the console line `kuberl up` prints."""
    name, what = record.get("name", "?"), record.get("event", "?")
    if what == "exited":
        code = record.get("code")
        line = f"{name} exited with code {code}"
        if isinstance(code, int) and code < 0:
            try:
                line += f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        if "restart_in_s" in record:
            line += f"; restarting it in {record['restart_in_s']:g} s"
        if "gave_up_after" in record:
            line += f"; not restarting it after {record['gave_up_after']} failed starts in a row"
        if isinstance(code, int) and code < 0:
            return line  # killed from outside: its log says nothing about why
        tail = [ln for ln in (record.get("log_tail") or "").splitlines() if ln.strip()][-3:]
        return line + "".join(f"\n    {ln}" for ln in tail)
    if what == "restarted":
        return f"{name} restarted (restart {record.get('restarts')})"
    return f"{name} {what}"
