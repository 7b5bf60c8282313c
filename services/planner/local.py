"""The local backend: a supervisor that runs actors and learners as processes on this machine.

Scale-up starts processes at once (each picks a free loopback port, or `actor_port + index` for
external simulators). Scale-down stops the newest actors with SIGTERM: an actor's shutdown stops
stepping, flushes its partial fragment and waits until the buffer has acknowledged everything queued
(see services/actor/main.py), so its in-flight fragments reach the buffer before it exits. A process
that dies on its own is restarted with backoff on the same command line, like a Deployment's pod, and
counted: services/common/local/supervise.py does it, for `kuberl up`'s own processes too.

Buffer shards: `kuberl up` starts the first `topology.buffers`; the planner may add more
(services/planner/shards.py), which this backend starts as processes on free ports (checkpointing under
`shard-<i>`) and stops once drained. A drained shard of `kuberl up`'s own is left running, idle and
out of the shard list, until `kuberl up` stops it; a later scale-up takes it back first.

A run of several policies (config `policies`) runs a learner group per policy, each of
`topology.learners` at first. Each policy's group is the role `learner/<policy>`, sized by the
decisions with the actors they share (services/planner/balance.py, `plan`, from each policy's learner rate and
share of the samples) or by hand (`kuberl scale learner/<policy> N`); a new size re-forms that group
alone. The learner role as a whole is not scaled (reported blocked, saying why).

Learners run as one group (services/learner/distributed.py): n processes, ranks 0..n-1, averaging
gradients. A group cannot change size in place, so a new learner count stops the whole group (rank 0
writes a checkpoint as it stops) and starts a new one of the new size, which resumes from that
checkpoint. Rank 0 always listens on the same address, the one actors subscribe to for weights. A
learner that dies breaks its group: the supervisor stops the others and forms the group again, with
backoff, and counts it as one restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from services.config import ExperimentConfig
from services.common.local.procs import PortPicker, ServiceProcess
from services.common.stats import Metrics
from services.common.local.supervise import (LEARNERS, STOP_TIMEOUT_S, Spec, Supervisor, actor_args, buffer_args,
                                       learner_specs, stop_procs, wait_or_kill)
from services.common.net.policy import learner_flag
from services.common.net.shards import buffer_addresses
from services.planner.backend import ROLES, ApplyResult, Refused, Replica, RoleState

log = logging.getLogger(__name__)
SEVERAL_POLICIES = ("several policies (config `policies`): the learners are scaled per policy, each policy's group "
                    "as the role learner/<policy> (the decisions size them with the actors; `kuberl scale "
                    "learner/<policy> N` sets one)")


class LocalBackend:
    name = "local"
    leader = True
    scales_buffers = True   # (services/planner/shards.py)

    def __init__(self, cfg: ExperimentConfig, *, config_path: Path, run_dir: Path, buffer: str,
                 actor_port: int = 50053, metrics: Metrics | None = None):
        self.cfg, self.config_path, self.run_dir, self.buffer = cfg, Path(config_path), Path(run_dir), buffer
        self.actor_port = actor_port
        self.shards = buffer_addresses(buffer)   # ValueError naming a malformed address; in shard order
        self.shard_names = {address: f"buffer-{i}" for i, address in enumerate(self.shards)}
        self.own_shards: set[str] = set()        # the shards this backend started (the others are kuberl up's)
        self.idle_shards: list[str] = []         # kuberl up's shards drained out of the list
        self.next_shard = len(self.shards)
        self.external = cfg.env.mode == "external"
        self.metrics = metrics or Metrics("planner")
        # Restarts of single processes and re-forms of the learner group alike.
        self.sup = Supervisor(self.run_dir, self.config_path,
                              on_restart=lambda name: self.metrics.inc("planner/replica_restarts_total"))
        self.names: dict[str, dict[int, str]] = {r: {} for r in ROLES}  # role -> index -> process name
        self.draining: set[asyncio.Task] = set()
        self._free_port = PortPicker(avoid={int(a.rsplit(":", 1)[1]) for a in self.shards})
        # Rank 0 listens on a port picked here, so actors can be told its address before it serves. Each
        # policy (config `policies`; one, `default`, where it names none) has a learner group, each with its
        # rank 0, scaled as its learner role (`learner`, or `learner/<policy>` for each of several).
        self.learner_addresses = {name: f"127.0.0.1:{self._free_port()}" for name in cfg.policy_names}
        self.learner_address = learner_flag(self.learner_addresses)   # (an actor's --learner)
        self.learner_roles = cfg.learner_roles                  # role -> the policy its group trains
        self.learner_policy: dict[str, str] = {}   # learner process name -> its policy's tag
        self.groups: dict[str, list[str]] = {}     # policy -> its learner group's process names, in rank order
        (self.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.metrics.inc("planner/replica_restarts_total", 0)
        self.metrics.inc("planner/replicas_drained_total", 0)

    @property
    def procs(self) -> dict[str, dict[int, ServiceProcess]]:
        """role -> index -> the process running now (restarts replace it; a group being re-formed has none)."""
        return {r: {i: self.sup.procs[n] for i, n in names.items() if n in self.sup.procs}
                for r, names in self.names.items()}

    # -- processes -------------------------------------------------------------------------------
    def _start_actor(self, index: int) -> None:
        name = f"actor-{index}"
        # Actors start with the learner and retry its address until it serves.
        listen = f"127.0.0.1:{self.actor_port + index}" if self.external else "127.0.0.1:0"
        self.names["actor"][index] = name
        self.sup.start(Spec("actor", name, listen, tuple(actor_args(name, self.run_dir.name, buffer=self.buffer,
                                                                    learner=self.learner_address, index=index))))

    def _form_group(self, n: int, policy: str | None = None) -> None:
        """Start n learners as one group (one learner alone is restarted alone) for each policy (`policy`:
        that one's alone)."""
        for name, address in self.learner_addresses.items():
            if policy is not None and name != policy:
                continue
            tag = self.cfg.tag(name)
            group = self.sup.start_group(f"{tag} {LEARNERS}".lstrip(), n, learner_specs(
                self.run_dir, n, buffer=self.buffer, listen=address, policy=tag), port=self._free_port)
            self.learner_policy.update({p.name: tag for p in group})
            self.groups[name] = [p.name for p in group]
            self.metrics.scoped(tag).set("planner/learner_group_size", n)
        self._index_learners()

    async def _stop(self, names) -> None:
        """SIGTERM the named processes together and wait for each (SIGKILL after STOP_TIMEOUT_S)."""
        procs = self.sup.release(names)
        self.sup.exit_codes.update(await asyncio.to_thread(stop_procs, procs, STOP_TIMEOUT_S))

    async def _stop_group(self, policy: str | None = None) -> None:
        """Stop every learner of a group together (they agree on a round to stop at; rank 0 checkpoints):
        every group, or `policy`'s."""
        names = [n for p, group in self.groups.items() if policy is None or p == policy for n in group]
        for p in [p for p in self.groups if policy is None or p == policy]:
            del self.groups[p]
        self._index_learners()
        await self._stop(names)

    def _index_learners(self) -> None:
        """The learner role's processes, by index: every group's, in policy order then rank order."""
        self.names["learner"] = dict(enumerate(n for group in self.groups.values() for n in group))

    async def start(self) -> None:
        """Start the learners and topology.actors actors at once (nobody waits for another's imports)."""
        self._form_group(self.cfg.topology.learners)
        for i in range(self.cfg.topology.actors):
            self._start_actor(i)

    async def observe(self) -> dict[str, RoleState]:
        # Restarts what died (not the actors being drained), with backoff; never blocks.
        self.sup.check()
        states = {}
        for role in ROLES:
            replicas = []
            for proc in self.procs[role].values():
                ready = proc.alive and proc.poll_ready()
                replicas.append(Replica(proc.name, proc.address if ready else "", ready,
                                        policy=self.learner_policy.get(proc.name, "")))
            states[role] = RoleState(desired=len(self.names[role]), replicas=replicas,
                                     blocked=SEVERAL_POLICIES if role not in (*self.learner_roles, "actor") else "")
        for role, policy in self.learner_roles.items():   # each policy's group, as its role
            tag = self.cfg.tag(policy)
            states[role] = RoleState(desired=len(self.groups.get(policy, ())), replicas=[
                r for r in states["learner"].replicas if r.policy == tag])
        return states

    async def buffers(self) -> list[Replica]:
        out = []
        for address in self.shards:
            name = self.shard_names[address]
            if address in self.own_shards:
                proc = self.sup.procs.get(name)
                ready = proc is not None and proc.alive and proc.poll_ready()
                out.append(Replica(name, address if ready else "", ready))
            else:
                out.append(Replica(name, address))
        return out

    async def buffer_list(self) -> list[str]:
        """Every shard's address, in shard order (serving or not)."""
        return list(self.shards)

    async def add_buffer(self) -> str:
        """Start one more buffer shard (or take back an idle one of kuberl up's); returns its address
        at once: it serves once `buffers()` says it is ready."""
        if self.idle_shards:
            address = self.idle_shards.pop()
        else:
            index, self.next_shard = self.next_shard, self.next_shard + 1
            address, name = f"127.0.0.1:{self._free_port()}", f"buffer-{index}"
            self.shard_names[address] = name
            self.own_shards.add(address)
            self.sup.start(Spec("buffer", name, address, tuple(buffer_args(self.cfg, self.run_dir, shard=index))))
        self.shards.append(address)
        return address

    async def remove_buffer(self, address: str) -> None:
        """A drained shard leaves: stopped if this backend started it, else left idle (see the module)."""
        self.shards.remove(address)
        if address in self.own_shards:
            await self._stop([self.shard_names[address]])
        else:
            self.idle_shards.append(address)

    def follow_topology(self, active: list[str]) -> None:
        """The planner's active shards: what actors and learners started from now on are given."""
        self.buffer = ",".join(active)

    async def apply(self, targets: dict[str, int], *, dry_run: bool = False) -> ApplyResult:
        """Set the actors, or a policy's learner group by its learner role (`learner`, or `learner/<policy>`
        for each of several: `learner`, all of them, is then not set)."""
        roles = ("actor", *self.learner_roles)
        for role, n in targets.items():
            if role not in ROLES and role not in roles:
                raise ValueError(f"unknown role {role!r}: the local backend scales {', '.join(roles)}")
            if n < 0 or (role.startswith("learner") and n < 1):
                raise ValueError(f"cannot set {role} to {n}")
        if "learner" not in roles and targets.get("learner", len(self.names["learner"])) != len(self.names["learner"]):
            raise Refused(SEVERAL_POLICIES)
        if dry_run:
            return ApplyResult(dict(targets), dry_run=True, detail="local backend: nothing started or stopped")
        detail = []
        for role in [r for r in self.learner_roles if r in targets]:
            policy = self.learner_roles[role]
            old, n = len(self.groups[policy]), targets[role]
            if n != old:
                await self._stop_group(policy)
                self._form_group(n, policy)
                detail.append(f"re-formed the learner group of policy {policy}: {old} -> {n} (resumes from its "
                              f"latest checkpoint)")
                log.info(detail[-1])
        actors = self.names["actor"]
        n = targets.get("actor", len(actors))
        while len(actors) < n:  # the lowest free index: external simulators find actor i at actor_port + i
            index = next(i for i in range(len(actors) + 1) if i not in actors)
            self._start_actor(index)
            detail.append(f"started actor-{index}")
        while len(actors) > n:
            index = max(actors)
            for proc in self.sup.release([actors.pop(index)]):
                task = asyncio.create_task(self._drain(proc), name=f"drain {proc.name}")
                self.draining.add(task)
                task.add_done_callback(self.draining.discard)
            detail.append(f"draining actor-{index}")
        applied = {r: len(self.names[r]) for r in ROLES}
        applied.update({role: len(self.groups[policy]) for role, policy in self.learner_roles.items()})
        return ApplyResult(applied, detail=", ".join(detail))

    async def _drain(self, proc: ServiceProcess) -> None:
        """Stop one actor: SIGTERM, then wait while it flushes its fragments to the buffer."""
        proc.terminate()
        timeout = self.cfg.planner.drain_timeout_s
        code = self.sup.exit_codes[proc.name] = await asyncio.to_thread(
            wait_or_kill, proc, timeout, f"did not drain within {timeout:.0f} s; killing it (its unsent fragments "
                                         "are lost and counted in its log)")
        self.metrics.inc("planner/replicas_drained_total")
        log.info("%s drained and exited with code %s", proc.name, code)

    async def close(self) -> None:
        """Actors first (they flush to the buffer), then the learners (final checkpoint), then the buffer
        shards this backend started (their final checkpoints)."""
        for role in ROLES:
            names = list(self.names[role].values())
            self.names[role].clear()
            await self._stop(names)
            if role == "actor" and self.draining:
                await asyncio.gather(*self.draining, return_exceptions=True)
        await self._stop([self.shard_names[a] for a in self.own_shards if self.shard_names[a] in self.sup.procs])
        # `kuberl up` reports these in its summary: the last code of every process that ever ran.
        (self.run_dir / "planner-exit-codes.json").write_text(json.dumps(self.sup.exit_codes))
