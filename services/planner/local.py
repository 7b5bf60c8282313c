"""The local backend: a supervisor that runs actors and learners as processes on this machine.

Scale-up starts processes at once (each picks a free loopback port, or `actor_port + index` for
external simulators). Scale-down stops the newest actors with SIGTERM: an actor's shutdown stops
stepping, flushes its partial fragment and waits until the buffer has acknowledged everything queued
(see services/actor/main.py), so its in-flight fragments reach the buffer before it exits. A process
that dies on its own is restarted with exponential backoff, like a Deployment's pod, and counted.

Learners run as one group (services/learner/distributed.py): n processes, ranks 0..n-1, averaging
gradients. A group cannot change size in place, so a new learner count stops the whole group (rank 0
writes a checkpoint as it stops) and starts a new one of the new size, which resumes from that
checkpoint. Rank 0 always listens on the same address, the one actors subscribe to for weights. A
learner that dies breaks its group: the others are stopped and the group restarted, with backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from services.common.config import ExperimentConfig
from services.common.procs import ServiceProcess, free_port, learner_group_args, spawn
from services.common.stats import Metrics
from services.planner.backend import ROLES, ApplyResult, Replica, RoleState

log = logging.getLogger(__name__)
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
STOP_TIMEOUT_S = 45.0


class LocalBackend:
    name = "local"
    leader = True

    def __init__(self, cfg: ExperimentConfig, *, config_path: Path, run_dir: Path, buffer: str,
                 actor_port: int = 50053, metrics: Metrics | None = None):
        self.cfg, self.config_path, self.run_dir, self.buffer = cfg, Path(config_path), Path(run_dir), buffer
        self.actor_port = actor_port
        self.external = cfg.env.mode == "external"
        self.metrics = metrics or Metrics("planner")
        self.procs: dict[str, dict[int, ServiceProcess]] = {r: {} for r in ROLES}  # role -> index -> process
        self.restarts: dict[str, int] = {}
        self.next_restart: dict[str, float] = {}
        self.draining: set[asyncio.Task] = set()
        self.exit_codes: dict[str, int] = {}
        # Rank 0 listens on a port picked here, so actors can be told its address before it serves.
        self.learner_address = f"127.0.0.1:{free_port()}"
        self.group_restart: tuple[int, float] | None = None  # a broken group's (size, when to form it again)
        self.group_restarts = 0
        (self.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.metrics.inc("planner/replica_restarts_total", 0)
        self.metrics.inc("planner/replicas_drained_total", 0)

    # -- processes -------------------------------------------------------------------------------
    def _start(self, role: str, index: int, world_size: int = 1, group: str = "") -> ServiceProcess:
        name = f"{role}-{index}"
        if role == "learner":
            listen = self.learner_address if index == 0 else "127.0.0.1:0"
            proc = spawn("learner", name, self.run_dir, self.config_path, listen,
                         ["--buffer", self.buffer, "--checkpoint-dir", str(self.run_dir / "checkpoints"),
                          "--learner-id", f"{name}-{self.run_dir.name}", *learner_group_args(world_size, index, group)])
        else:
            # Actors start with the learner and retry its address until it serves.
            listen = f"127.0.0.1:{self.actor_port + index}" if self.external else "127.0.0.1:0"
            proc = spawn("actor", name, self.run_dir, self.config_path, listen, [
                "--buffer", self.buffer, "--learner", self.learner_address,
                "--actor-id", f"{name}-{self.run_dir.name}", "--actor-index", str(index)])
        self.procs[role][index] = proc
        log.info("started %s (pid %d, log %s)", name, proc.popen.pid, proc.log_path)
        return proc

    def _form_group(self, n: int) -> None:
        """Start n learners as one group (a fresh rendezvous port each time)."""
        group = f"127.0.0.1:{free_port()}" if n > 1 else ""
        for rank in range(n):
            self._start("learner", rank, n, group)
        self.metrics.set("planner/learner_group_size", n)

    async def _stop_group(self) -> None:
        """Stop every learner together (they agree on a round to stop at; rank 0 checkpoints)."""
        group = list(self.procs["learner"].values())
        self.procs["learner"].clear()
        for p in group:
            self.next_restart.pop(p.name, None)
            p.terminate()
        for p in group:
            self.exit_codes[p.name] = await self._wait_or_kill(p, STOP_TIMEOUT_S)

    async def _wait_or_kill(self, p: ServiceProcess, timeout: float) -> int:
        try:
            return await asyncio.wait_for(asyncio.to_thread(p.popen.wait), timeout)
        except TimeoutError:
            log.warning("%s did not stop within %.0f s; killing it", p.name, timeout)
            p.popen.kill()
            return await asyncio.to_thread(p.popen.wait)

    async def start(self) -> None:
        """Start the learners and topology.actors actors at once (nobody waits for another's imports)."""
        self._form_group(self.cfg.topology.learners)
        for i in range(self.cfg.topology.actors):
            self._start("actor", i)

    async def _supervise(self) -> None:
        """Restart processes that exited on their own (not the ones being drained). A learner that exits
        breaks its group: the group is stopped and formed again, with the same backoff."""
        now = time.monotonic()
        learners = self.procs["learner"]
        dead = [p for p in learners.values() if not p.alive]
        if dead and len(learners) > 1:
            delay = RESTART_BACKOFF_S[min(self.group_restarts, len(RESTART_BACKOFF_S) - 1)]
            for p in dead:
                self.exit_codes[p.name] = p.popen.returncode
                log.error("%s exited unexpectedly with code %s; re-forming its group of %d in %.0f s:\n%s", p.name,
                          p.popen.returncode, len(learners), delay, p.log_tail())
            self.group_restart = (len(learners), now + delay)
            await self._stop_group()
        if self.group_restart is not None and now >= self.group_restart[1]:
            size, self.group_restart = self.group_restart[0], None
            self.group_restarts += 1
            self.metrics.inc("planner/replica_restarts_total")
            self._form_group(size)
        for role in ROLES:
            for index, proc in list(self.procs[role].items()):
                if proc.alive:
                    continue
                if proc.name not in self.next_restart:
                    n = self.restarts.get(proc.name, 0)
                    delay = RESTART_BACKOFF_S[min(n, len(RESTART_BACKOFF_S) - 1)]
                    self.next_restart[proc.name] = now + delay
                    self.exit_codes[proc.name] = proc.popen.returncode
                    log.error("%s exited unexpectedly with code %s; restarting in %.0f s:\n%s", proc.name,
                              proc.popen.returncode, delay, proc.log_tail())
                elif now >= self.next_restart[proc.name]:
                    del self.next_restart[proc.name]
                    self.restarts[proc.name] = self.restarts.get(proc.name, 0) + 1
                    self.metrics.inc("planner/replica_restarts_total")
                    self._start(role, index)

    def _desired(self, role: str) -> int:
        if role == "learner" and self.group_restart is not None:
            return self.group_restart[0]
        return len(self.procs[role])

    async def observe(self) -> dict[str, RoleState]:
        await self._supervise()
        states = {}
        for role in ROLES:
            replicas = []
            for proc in self.procs[role].values():
                ready = proc.alive and proc.poll_ready()
                replicas.append(Replica(proc.name, proc.address if ready else "", ready))
            states[role] = RoleState(desired=self._desired(role), replicas=replicas)
        return states

    async def buffers(self) -> list[Replica]:
        return [Replica("buffer-0", self.buffer)]

    async def apply(self, targets: dict[str, int], *, dry_run: bool = False) -> ApplyResult:
        for role, n in targets.items():
            if role not in ROLES or n < 0 or (role == "learner" and n < 1):
                raise ValueError(f"cannot set {role} to {n}")
        if dry_run:
            return ApplyResult(dict(targets), dry_run=True, detail="local backend: nothing started or stopped")
        detail = []
        n = targets.get("learner", self._desired("learner"))
        if n != self._desired("learner"):
            old = self._desired("learner")
            await self._stop_group()
            self.group_restart = None
            self._form_group(n)
            detail.append(f"re-formed the learner group: {old} -> {n} (resumes from the latest checkpoint)")
            log.info(detail[-1])
        actors = self.procs["actor"]
        n = targets.get("actor", len(actors))
        while len(actors) < n:  # the lowest free index: external simulators find actor i at actor_port + i
            index = next(i for i in range(len(actors) + 1) if i not in actors)
            self._start("actor", index)
            detail.append(f"started actor-{index}")
        while len(actors) > n:
            index = max(actors)
            proc = actors.pop(index)
            self.next_restart.pop(proc.name, None)
            task = asyncio.create_task(self._drain(proc), name=f"drain {proc.name}")
            self.draining.add(task)
            task.add_done_callback(self.draining.discard)
            detail.append(f"draining actor-{index}")
        return ApplyResult({r: len(self.procs[r]) for r in ROLES}, detail=", ".join(detail))

    async def _drain(self, proc: ServiceProcess) -> None:
        """Stop one actor: SIGTERM, then wait while it flushes its fragments to the buffer."""
        proc.terminate()
        timeout = self.cfg.planner.drain_timeout_s
        try:
            code = await asyncio.wait_for(asyncio.to_thread(proc.popen.wait), timeout)
        except TimeoutError:
            log.warning("%s did not drain within %.0f s; killing it (its unsent fragments are lost and "
                        "counted in its log)", proc.name, timeout)
            proc.popen.kill()
            code = await asyncio.to_thread(proc.popen.wait)
        self.exit_codes[proc.name] = code
        self.metrics.inc("planner/replicas_drained_total")
        log.info("%s drained and exited with code %s", proc.name, code)

    async def close(self) -> None:
        """Actors first (they flush to the buffer), then the learners (final checkpoint)."""
        self.next_restart.clear()
        self.group_restart = None
        for role in ROLES:
            group = list(self.procs[role].values())
            self.procs[role].clear()
            for p in group:
                p.terminate()
            for p in group:
                self.exit_codes[p.name] = await self._wait_or_kill(p, STOP_TIMEOUT_S)
            if role == "actor" and self.draining:
                await asyncio.gather(*self.draining, return_exceptions=True)
        # `kuberl up` reports these in its summary.
        (self.run_dir / "planner-exit-codes.json").write_text(json.dumps(self.exit_codes))
