"""Local process supervision, shared by `kuberl up` and the planner's local backend.

One place says how each role is started on this machine (`actor_args`, `learner_args`, `learner_specs`)
and what happens when a process dies on its own: its exit code and last log lines are recorded, an event
is appended to `<run_dir>/events.jsonl` (which `kuberl up` prints as it happens, and counts restarts
from), and it is started again with the same command line after a backoff (1, 2, 5, 10, 30 s; reset once
it has run for STABLE_S), like a Deployment's pod. The same listen address is reused, so peers that
reconnect with backoff find it again. One that fails MAX_FAILURES times in a row without running STABLE_S
(a bad flag, a port another program holds) is given up on, and the event says so. A process that is
stopped on purpose (`stop`, `release`) is never restarted.

A group (learners averaging gradients, services/learner/distributed.py) cannot take one member back: when
any member dies, the others are stopped (SIGTERM, SIGKILL after STOP_TIMEOUT_S; they are usually exiting
already, their collectives having failed) and, after the same backoff, all are started again with a fresh
rendezvous address, rank 0 on its fixed one; the group resumes from rank 0's newest checkpoint. The
group's failures, backoff and give-up are counted as one process's are.

Synchronous and free of asyncio, and `check()` never blocks: callers poll it from their own loop and run
the blocking waits of a deliberate stop (`stop_procs`) however suits them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.config import CommonConfig
from services.common.local.procs import ServiceProcess, free_port, learner_group_args, spawn

log = logging.getLogger(__name__)
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_S = 60.0        # a process (or group) that ran this long before dying starts the backoff over
MAX_FAILURES = 5       # short-lived deaths in a row after which a process (or group) is no longer started
STOP_TIMEOUT_S = 45.0  # SIGTERM to SIGKILL, for a deliberate stop and for a broken group's survivors
LOG_TAIL_LINES = 12
LEARNERS = "learners"  # the learner group's name in events and restart counts


def actor_args(name: str, run_name: str, *, buffer: str, learner: str, index: int) -> list[str]:
    """`kuberl actor` flags for actor `name` of a local run (its id is stable across restarts; each
    process still gets its own incarnation, see services/common/protocol/fragments.py)."""
    return ["--buffer", buffer, "--learner", learner, "--actor-id", f"{name}-{run_name}", "--actor-index", str(index)]


def learner_args(name: str, run_dir: Path, *, buffer: str, world_size: int = 1, rank: int = 0,
                 group: str = "", policy: str = "") -> list[str]:
    """`kuberl learner` flags for learner `name` (rank `rank` of a group of `world_size`); `policy`: of
    several in the run, the one it trains (its checkpoints in checkpoints/<policy>)."""
    checkpoints = Path(run_dir) / "checkpoints"
    return ["--buffer", buffer, "--checkpoint-dir", str(checkpoints / policy if policy else checkpoints),
            "--learner-id", f"{name}-{Path(run_dir).name}", *learner_group_args(world_size, rank, group),
            *(["--policy", policy] if policy else [])]


def buffer_args(cfg: CommonConfig, run_dir: Path, shard: int = 0) -> list[str]:
    """`kuberl buffer` flags for buffer shard `shard` of a local run: a relative `buffer.checkpoint_dir`
    is taken inside the run directory, so a restarted buffer restores the run's own replay; with
    several shards each checkpoints under its own `shard-<i>` directory there (as does a shard the
    planner adds to a run of one, shard 1 and on)."""
    if cfg.buffer.checkpoint_dir is None:
        return []
    path = Path(run_dir) / cfg.buffer.checkpoint_dir
    return ["--checkpoint-dir", str(path / f"shard-{shard}" if cfg.topology.buffers > 1 or shard > 0 else path)]


@dataclass(frozen=True)
class Spec:
    """How to start one process: `python -m services.<role> --listen <listen> <extra>`."""
    role: str
    name: str
    listen: str
    extra: tuple[str, ...] = ()


def learner_specs(run_dir: Path, n: int, *, buffer: str, listen: str, policy: str = "") -> Callable[[str], list[Spec]]:
    """`start_group`'s `specs` for n learners `learner-<rank>` (`learner-<policy>-<rank>` for one policy of
    several): rank 0 on `listen`, the address actors take weights from (the same for every formation),
    the others on any free port."""
    prefix = f"learner-{policy}-" if policy else "learner-"

    def specs(rendezvous: str) -> list[Spec]:
        return [Spec("learner", f"{prefix}{rank}", listen if rank == 0 else "127.0.0.1:0",
                     tuple(learner_args(f"{prefix}{rank}", run_dir, buffer=buffer, world_size=n, rank=rank,
                                        group=rendezvous, policy=policy)))
                for rank in range(n)]
    return specs


@dataclass
class Group:
    """Processes that live and die together (see the module doc)."""
    name: str                              # its members in the plural: events say "the group of 2 learners"
    size: int
    specs: Callable[[str], list[Spec]]     # the members' specs for one formation's rendezvous address
    port: Callable[[], int]                # a free port for each formation's rendezvous
    members: list[str] = field(default_factory=list)
    rendezvous: str = ""
    formed_at: float = 0.0
    broken: bool = False
    stopping: list[ServiceProcess] = field(default_factory=list)  # broken: members still exiting (SIGTERM sent)
    kill_at: float = math.inf              # broken: when the ones still exiting get SIGKILL
    reform_at: float | None = None         # broken: when to form it again once none is left; None: given up


class Supervisor:
    def __init__(self, run_dir: Path, config_path: Path, *, on_restart: Callable[[str], object] | None = None,
                 log_events: bool = True):
        self.run_dir, self.config_path = Path(run_dir), Path(config_path)
        self.events_path = self.run_dir / "events.jsonl"
        self.specs: dict[str, Spec] = {}          # processes restarted alone (group members are in `groups`)
        self.procs: dict[str, ServiceProcess] = {}  # the process running now under each name
        self.groups: dict[str, Group] = {}
        self.started_at: dict[str, float] = {}
        self.failures: dict[str, int] = {}        # process or group -> consecutive short-lived deaths
        self.next_start: dict[str, float] = {}    # dead, waiting to be started again
        self.restarts: dict[str, int] = {}        # process or group -> restarts (group: re-forms)
        self.exit_codes: dict[str, int | None] = {}  # the last code of every process that ever ran
        self.given_up: dict[str, str] = {}        # process -> why neither it nor its group is started again
        self.on_restart = on_restart              # called with the process or group name after each restart
        self.log_events = log_events              # False where the caller prints events.jsonl itself

    # -- starting and stopping -------------------------------------------------------------------
    def start(self, spec: Spec) -> ServiceProcess:
        """Start (or replace the record of) `spec.name` now, to be restarted alone; returns at once."""
        self.specs[spec.name] = spec
        self.next_start.pop(spec.name, None)
        return self._spawn(spec)

    def start_group(self, name: str, size: int, specs: Callable[[str], list[Spec]], *,
                    port: Callable[[], int] = free_port) -> list[ServiceProcess]:
        """Start `size` processes as one group (`name`: see Group), re-formed as a whole when one dies;
        each formation gets the rendezvous address `127.0.0.1:<port()>`. One alone is no group: it is
        restarted alone."""
        if size == 1:
            return [self.start(specs("")[0])]
        group = self.groups[name] = Group(name, size, specs, port)
        self._form(group, time.monotonic())
        return [self.procs[n] for n in group.members]

    def release(self, names: Iterable[str]) -> list[ServiceProcess]:
        """Stop supervising `names` and return their processes, for the caller to stop or drain. A group
        member takes its whole group along, members still exiting after a break included: a group cannot
        lose one member."""
        out = []
        for name in names:
            group = next((g for g in self.groups.values() if name in g.members), None)
            if group is not None:
                del self.groups[group.name]
                out += group.stopping + [p for n in group.members if (p := self.procs.pop(n, None)) is not None]
                continue
            self.specs.pop(name, None)
            self.next_start.pop(name, None)
            if (proc := self.procs.pop(name, None)) is not None:
                out.append(proc)
        return out

    def stop(self, names: Iterable[str], timeout_s: float) -> dict[str, int | None]:
        """`release` `names` and stop them (`stop_procs`); blocks until they have exited."""
        codes = stop_procs(self.release(names), timeout_s)
        self.exit_codes.update(codes)
        return codes

    def _spawn(self, spec: Spec) -> ServiceProcess:
        proc = spawn(spec.role, spec.name, self.run_dir, self.config_path, spec.listen, list(spec.extra))
        self.procs[spec.name] = proc
        self.started_at[spec.name] = time.monotonic()
        log.info("started %s (pid %d, log %s)", spec.name, proc.popen.pid, proc.log_path)
        return proc

    def _form(self, group: Group, now: float) -> None:
        group.rendezvous = f"127.0.0.1:{group.port()}"
        specs = group.specs(group.rendezvous)
        group.members = [s.name for s in specs]
        for spec in specs:
            self._spawn(spec)
        group.formed_at, group.broken, group.reform_at = now, False, None

    # -- watching --------------------------------------------------------------------------------
    def check(self, now: float | None = None) -> list[ServiceProcess]:
        """Record every supervised process that died on its own since the last check (returned), start
        again the ones whose backoff is over, and carry broken groups on (stop what is left, form them
        again). Never blocks; call about once a second."""
        now = time.monotonic() if now is None else now
        died = []
        for name, proc in list(self.procs.items()):
            spec = self.specs.get(name)
            if spec is None or proc.alive:  # no spec: given up, or a group member (below)
                continue
            if name in self.next_start:
                if now >= self.next_start[name]:
                    self.start(spec)
                    self._restarted(name, "restarted")
                continue
            died.append(proc)
            code = self.exit_codes[name] = proc.popen.returncode
            delay = self._backoff(name, now - self.started_at.get(name, now))
            if delay is not None:
                self.next_start[name] = now + delay
                self.event(name, "exited", code=code, restart_in_s=delay, log_tail=proc.log_tail(LOG_TAIL_LINES))
            else:  # it fails the same way every time (a bad flag, a port taken)
                self.specs.pop(name)
                self.given_up[name] = f"it failed {MAX_FAILURES} times in a row within {STABLE_S:.0f} s of starting"
                self.event(name, "exited", code=code, log_tail=proc.log_tail(LOG_TAIL_LINES),
                           gave_up_after=self.failures[name])
        for group in list(self.groups.values()):
            died += self._check_group(group, now)
        return died

    def _check_group(self, group: Group, now: float) -> list[ServiceProcess]:
        if not group.broken:
            members = [self.procs[n] for n in group.members]
            dead = [p for p in members if not p.alive]
            if dead:
                self._break(group, members, dead, now)
            return dead
        for p in [p for p in group.stopping if not p.alive]:
            group.stopping.remove(p)
            self.exit_codes[p.name] = p.popen.returncode
            log.info("%s (of the broken group of %d %s) exited with code %s", p.name, group.size, group.name,
                     p.popen.returncode)
        if group.stopping and now >= group.kill_at:
            for p in group.stopping:
                log.warning("%s did not exit within %.0f s of its group of %d %s breaking; killing it", p.name,
                            STOP_TIMEOUT_S, group.size, group.name)
                p.popen.kill()
            group.kill_at = math.inf
        if group.stopping:  # the old rank 0 must be gone (its address free) before a new one starts
            return []
        if group.reform_at is None:  # given up, and nothing of it is left
            del self.groups[group.name]
        elif now >= group.reform_at:
            self._form(group, now)
            self._restarted(group.name, "re-formed", size=group.size, rendezvous=group.rendezvous)
        return []

    def _break(self, group: Group, members: list[ServiceProcess], dead: list[ServiceProcess], now: float) -> None:
        """A member died: record it, SIGTERM the others, and plan the next formation (or give up)."""
        for n in group.members:
            del self.procs[n]
        for p in dead:
            self.exit_codes[p.name] = p.popen.returncode
        # Members found dead together: one killed by a signal is the cause, the others' exits (GroupBroken)
        # its effect; otherwise the lowest rank is named.
        cause = min(dead, key=lambda p: (p.popen.returncode >= 0, group.members.index(p.name)))
        for p in dead:
            if p is not cause:
                log.info("%s exited with code %s too", p.name, p.popen.returncode)
        group.broken, group.stopping, group.kill_at = True, [p for p in members if p.alive], now + STOP_TIMEOUT_S
        for p in group.stopping:
            p.terminate()
        delay = self._backoff(group.name, now - group.formed_at)
        fields = {"code": cause.popen.returncode, "group": group.name, "group_size": group.size}
        if delay is not None:
            group.reform_at = now + delay
            fields["reform_in_s"] = delay
        else:
            group.reform_at = None
            self.given_up[cause.name] = (f"its group of {group.size} {group.name} broke {MAX_FAILURES} times in a "
                                         f"row within {STABLE_S:.0f} s of forming")
            fields["gave_up_after"] = self.failures[group.name]
        self.event(cause.name, "exited", **fields, log_tail=cause.log_tail(LOG_TAIL_LINES))

    def _backoff(self, key: str, ran_s: float) -> float | None:
        """Count a death after `ran_s` seconds of running: the delay before the next start, None to give up."""
        self.failures[key] = 0 if ran_s >= STABLE_S else self.failures.get(key, 0) + 1
        if self.failures[key] >= MAX_FAILURES:
            return None
        return RESTART_BACKOFF_S[min(max(self.failures[key] - 1, 0), len(RESTART_BACKOFF_S) - 1)]

    def _restarted(self, name: str, what: str, **fields: Any) -> None:
        self.restarts[name] = self.restarts.get(name, 0) + 1
        self.event(name, what, restarts=self.restarts[name], **fields)
        if self.on_restart is not None:
            self.on_restart(name)

    def event(self, name: str, what: str, **fields: Any) -> None:
        """Append one event to events.jsonl and the log (`kuberl up` prints them as they come)."""
        record = {"unix_s": round(time.time(), 3), "name": name, "event": what, **fields}
        tail = fields.get("log_tail")
        if self.log_events:  # the line `kuberl up` prints, with the whole log tail
            log.log(logging.ERROR if what == "exited" else logging.INFO, "%s%s",
                    format_event({**record, "log_tail": ""}), f"; its log ends:\n{tail}" if tail else "")
        # One write on an O_APPEND descriptor: `kuberl up`'s and the planner's supervisors share the file.
        fd = os.open(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)


def wait_or_kill(p: ServiceProcess, timeout_s: float, message: str | None = None) -> int | None:
    """Wait for `p` to exit (after a SIGTERM sent by the caller), SIGKILL it after `timeout_s`, logging
    `message` (what follows its name; default: that it did not stop in time). Blocking."""
    try:
        return p.popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("%s %s", p.name, message or f"did not stop within {timeout_s:.0f} s; killing it")
        p.popen.kill()
        return p.popen.wait()


def stop_procs(procs: list[ServiceProcess], timeout_s: float) -> dict[str, int | None]:
    """SIGTERM `procs` together, then wait for each (`wait_or_kill`); their exit codes. Blocking, and it
    touches nothing but `procs`, so callers may run it in a thread while their supervisor goes on."""
    for p in procs:
        p.terminate()
    return {p.name: wait_or_kill(p, timeout_s) for p in procs}


def format_event(record: Mapping[str, Any]) -> str:
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
        group = f"the group of {record.get('group_size')} {record.get('group')}"
        if "restart_in_s" in record:
            line += f"; restarting it in {record['restart_in_s']:g} s"
        if "reform_in_s" in record:
            line += f"; re-forming {group} in {record['reform_in_s']:g} s"
        if "gave_up_after" in record:
            line += (f"; not re-forming {group} after it broke {record['gave_up_after']} times in a row"
                     if "group" in record else
                     f"; not restarting it after {record['gave_up_after']} failed starts in a row")
        if isinstance(code, int) and code < 0:
            return line  # killed from outside: its log says nothing about why
        tail = [ln for ln in (record.get("log_tail") or "").splitlines() if ln.strip()][-3:]
        return line + "".join(f"\n    {ln}" for ln in tail)
    if what == "restarted":
        return f"{name} restarted (restart {record.get('restarts')})"
    if what == "re-formed":
        return (f"the group of {record.get('size')} {name} re-formed (re-form {record.get('restarts')}, "
                f"rendezvous {record.get('rendezvous')})")
    return f"{name} {what}"
