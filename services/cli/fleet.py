"""The processes of one `kuberl up` run (services/cli/up.py): started, followed, restarted, stopped.

`kuberl up` starts the buffer shards and the planner itself (every role when the planner is off,
`planner.enabled: false`) under one Supervisor (services/common/local/supervise.py): a process that
dies is started again on the same address, and the event is printed. With the planner on, its local
backend runs the learners and actors; the fleet follows them through the planner's status. A
`Member` is one process of the run with a channel to it; `kuberl up` reads their stats
(`LocalRun.poll`), nothing here does."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc, planner_pb2_grpc
from kuberl.v1 import planner_pb2 as ppb
from services.common.atomic import write_atomically
from services.common.local.procs import PortPicker, ServiceProcess
from services.common.local.supervise import (LEARNERS, STOP_TIMEOUT_S, Spec, Supervisor, actor_args, buffer_args,
                                             format_event, learner_specs)
from services.common.net.policy import learner_flag
from services.common.net.tls import open_channel
from services.common.net.tokens import read_client_token, with_token
from services.config import ConfigError, ExperimentConfig

log = logging.getLogger("kuberl.up")
READY_TIMEOUT_S = 120.0
# Prometheus file-based service discovery (file_sd_configs) of the run's metrics endpoints: point a
# local Prometheus at it (docs/metrics.md); rewritten as processes come, go and restart.
TARGETS_FILE = "prometheus-targets.json"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


PLANNER_PORT = 50054  # where `kuberl scale`/`kuberl decisions` look by default, when it is free


def _claim(port: int):
    """An exclusive lock on `port` among this user's `kuberl up` runs, held while the returned file
    stays open, or None when another run holds it. Between checking that the port is free and its
    planner binding it, a second `kuberl up` started at the same moment would see it free too: both
    planners would take it, one would fail to bind on every restart, and its run would end failed."""
    path = Path(tempfile.gettempdir()) / f"kuberl-{os.getuid()}" / f"port-{port}.lock"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    f = open(path, "a")  # noqa: SIM115 (held open: the lock lasts as long as the file)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


@dataclass
class Member:
    """A process of the run: one `kuberl up` started itself (buffer, planner; every role when the
    planner is off), or an actor/learner the planner's local backend runs (found through its status)."""
    role: str
    name: str
    proc: ServiceProcess | None = None
    address: str = ""
    channel: grpc.Channel | None = None
    stub: object = None
    stats: dict = field(default_factory=dict)

    def connect(self, address: str, cfg: ExperimentConfig) -> None:
        """A channel to `address` with the run's TLS settings and, where the roles protect their reads
        (auth.protect_reads), the run's client token (auth.client_token_file, read at each connect)."""
        if self.channel is not None:
            self.channel.close()
        self.address = address
        token_file = cfg.auth.client_token_file
        token = read_client_token(token_file, "auth.client_token_file") if token_file else None
        self.channel = with_token(open_channel(address, cfg.tls), token, cfg.tls.enabled)
        self.stub = STUBS[self.role](self.channel)


STUBS = {"actor": actor_pb2_grpc.ActorStub, "buffer": buffer_pb2_grpc.BufferStub,
         "learner": learner_pb2_grpc.LearnerStub, "planner": planner_pb2_grpc.PlannerStub}


def actor_ports(cfg: ExperimentConfig, actor_port: int) -> range:
    """The ports external simulators find actors on (actor i at actor_port + i); empty otherwise."""
    if cfg.env.mode != "external":
        return range(0)
    n = cfg.planner.actor.max if cfg.planner.enabled else cfg.topology.actors
    return range(actor_port, actor_port + n)


def check_ports(cfg: ExperimentConfig, actor_port: int, planner_port: int | None) -> None:
    """ConfigError when --planner-port is one of the external actors' ports."""
    ports = actor_ports(cfg, actor_port)
    if planner_port is not None and planner_port in ports:
        raise ConfigError(f"--planner-port {planner_port} is one of the external actors' ports "
                          f"{ports.start}..{ports.stop - 1} (--actor-port + i): pick another")


class Fleet:
    """Every process of one local run, in run directory `dir` (its config.yaml written already)."""

    def __init__(self, cfg: ExperimentConfig, dir: Path, actor_port: int = 50053, planner_port: int | None = None):
        check_ports(cfg, actor_port, planner_port)
        self.cfg, self.dir, self.actor_port, self.planner_port = cfg, Path(dir), actor_port, planner_port
        self.external = cfg.env.mode == "external"
        self.planned = cfg.planner.enabled
        self.actor_ports = actor_ports(cfg, actor_port)
        self._free_port = PortPicker(avoid=self.actor_ports)   # ports for this run's own processes
        self._planner_claim = None   # the lock that keeps PLANNER_PORT this run's while it lasts
        self.sup = Supervisor(self.dir, self.dir / "config.yaml", log_events=False)
        self.events_read = 0  # bytes of events.jsonl already printed (the planner's backend appends too)
        self.restarts: Counter[str] = Counter()  # process or group -> restarts, as events.jsonl records them
        self.members: list[Member] = []   # live
        self.retired: list[Member] = []   # actors the planner stopped: their counters still count
        self.last_decision_id = 0
        self.targets_path = self.dir / TARGETS_FILE
        self._targets: list[dict] | None = None   # as last written
        self._decisions_read = 0   # bytes of decisions.jsonl read by new_decisions

    def role(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]

    def last_stats(self) -> dict[str, tuple[str, dict]]:
        """Every process's last stats by name, as (role, stats): a live process's over a retired one of
        the same name (a learner group the planner re-formed runs under the names of the one it
        stopped), a later retired one's over an earlier."""
        return {m.name: (m.role, m.stats) for m in self.retired + self.members}

    # -- starting and stopping -------------------------------------------------------------------
    def _spawn(self, role: str, name: str, listen: str, extra: list[str]) -> Member:
        m = Member(role, name, self.sup.start(Spec(role, name, listen, tuple(extra))))
        self.members.append(m)
        return m

    def _wait_ready(self, m: Member, deadline: float) -> None:
        while not m.proc.poll_ready():
            self.supervise()  # a process that cannot start is reported at once, and tried again
            if time.monotonic() > deadline:
                raise RuntimeError(f"{m.name} did not start serving within {READY_TIMEOUT_S:.0f} s:\n"
                                   f"{m.proc.log_tail()}")
            time.sleep(0.02)
        m.connect(m.proc.address, self.cfg)
        log.info("%s serving on %s, metrics on http://%s/metrics (pid %d, log %s)", m.name, m.address,
                 m.proc.metrics, m.proc.popen.pid, m.proc.log_path)

    def start_all(self) -> None:
        """Start every process at once: start order does not matter (peers wait for each other), so
        the buffer and learner listen on ports picked here and nobody waits for another's imports.
        With the planner on, its local backend starts (and later rescales) the learner and actors."""
        # Fixed addresses (a restarted process comes back where its peers look), below the ephemeral
        # range and outside the external actors' ports.
        ports: set[int] = set()
        while len(ports) < self.cfg.topology.buffers:
            ports.add(self._free_port())
        shards = [f"127.0.0.1:{port}" for port in sorted(ports)]
        for i, address in enumerate(shards):
            self._spawn("buffer", f"buffer-{i}", address, buffer_args(self.cfg, self.dir, shard=i))
        buffer = ",".join(shards)   # every shard, in order: each actor picks its own, learners read all
        if self.planned:
            port = self.planner_port
            if port is None:
                self._planner_claim = None if PLANNER_PORT in self.actor_ports else _claim(PLANNER_PORT)
                port = PLANNER_PORT if self._planner_claim is not None and _port_free(PLANNER_PORT) \
                    else self._free_port()
            self._spawn("planner", "planner-0", f"127.0.0.1:{port}", [
                "--backend", self.cfg.planner.backend if self.cfg.planner.backend != "kubernetes" else "local",
                "--buffer", buffer, "--run-dir", str(self.dir), "--actor-port", str(self.actor_port)])
            return
        # Each policy's learners (one policy: `learner-<rank>`); rank 0 serves the weights actors take.
        learners = {name: f"127.0.0.1:{self._free_port()}" for name in self.cfg.policy_names}
        n = self.cfg.topology.learners
        for name, address in learners.items():
            # A group is re-formed as a whole when one of its learners dies, as the planner's backend does.
            tag = self.cfg.tag(name)
            for proc in self.sup.start_group(f"{tag} {LEARNERS}".lstrip(), n, learner_specs(
                    self.dir, n, buffer=buffer, listen=address, policy=tag), port=self._free_port):
                self.members.append(Member("learner", proc.name, proc))
        learner = learner_flag(learners)
        for i in range(self.cfg.topology.actors):
            # External simulators need a known address: actor i listens on actor_port + i.
            listen = f"127.0.0.1:{self.actor_port + i}" if self.external else "127.0.0.1:0"
            self._spawn("actor", f"actor-{i}", listen,
                        actor_args(f"actor-{i}", self.dir.name, buffer=buffer, learner=learner, index=i))

    def wait_all_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for m in self.members:
            self._wait_ready(m, deadline)
        if self.planned:  # wait until the planner's learner and actors serve too
            while True:
                self.sync_planned()
                if all(self.role(r) for r in ("learner", "actor")):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the planner's learner and actors did not start serving within "
                                       f"{READY_TIMEOUT_S:.0f} s; see {self.dir / 'logs'}")
                self.supervise()
                time.sleep(0.05)

    def sync_planned(self) -> None:
        """Follow the replicas the planner runs: add new ones, retire the ones it stopped."""
        planner = self.role("planner")[0]
        if planner.stub is None:  # restarted, not serving yet
            return
        try:
            status = planner.stub.GetStatus(ppb.GetStatusRequest(), timeout=5.0)
        except grpc.RpcError as err:
            log.debug("planner status failed: %s", err.code().name)
            return
        own = {(m.role, m.name) for m in self.members if m.proc is not None}   # (its buffer shards are listed too)
        live = {(r.role, r.name): r.address for r in status.replicas
                if r.ready and r.address and (r.role, r.name) not in own}
        for m in [m for m in self.members if m.proc is None]:
            address = live.pop((m.role, m.name), None)
            if address is None:
                self.members.remove(m)
                self.retired.append(m)
            elif address != m.address:  # restarted by the planner
                m.connect(address, self.cfg)
        for (role, name), address in live.items():
            m = Member(role, name)
            m.connect(address, self.cfg)
            self.members.append(m)
        d = status.last_decision
        if d.id > self.last_decision_id:
            self.last_decision_id = d.id
            if d.action == ppb.DECISION_ACTION_SCALE or d.error:
                print(f"planner: {'applied' if d.applied else 'not applied'}: {d.reason}"
                      + (f" (error: {d.error})" if d.error else ""), flush=True)

    def stop_all(self, before_buffers: Callable[[], object] = lambda: None) -> None:
        """Actors first (they flush fragments to the buffer), then the learner (final checkpoint), then
        the buffers, `before_buffers` called just before them (every actor has flushed: the buffers'
        counters are final then). With the planner on, stopping the planner stops its actors and
        learner in that order."""
        for role in ("planner", "actor", "learner", "buffer"):
            if role == "buffer":
                before_buffers()
            names = [m.name for m in self.members if m.role == role and m.proc is not None]
            self.sup.stop(names, STOP_TIMEOUT_S + (60 if role == "planner" else 0))
        self.print_events()
        for m in self.members + self.retired:
            if m.channel is not None:
                m.channel.close()
        if self._planner_claim is not None:   # the planner has stopped: another run may take its port
            self._planner_claim.close()
            self._planner_claim = None

    # -- metrics endpoints ----------------------------------------------------------------------
    def scrape_targets(self) -> list[dict]:
        """Every live process's metrics endpoint as Prometheus file_sd target groups, labelled with its
        role, its name and the run. Members the planner runs are found through the ready file each
        writes into the run directory."""
        groups = []
        for m in sorted(self.members, key=lambda m: m.name):
            address = m.proc.metrics if m.proc is not None and m.proc.poll_ready() else None
            if m.proc is None:
                try:
                    address = json.loads((self.dir / "ready" / f"{m.name}.json").read_text()).get("metrics")
                except (OSError, ValueError):
                    address = None
            if address:
                groups.append({"targets": [address], "labels": {"role": m.role, "name": m.name, "run": self.dir.name}})
        return groups

    def write_targets(self) -> None:
        """(Re)write TARGETS_FILE when the endpoints changed, atomically (Prometheus may read it any time)."""
        targets = self.scrape_targets()
        if targets != self._targets:
            data = json.dumps(targets, indent=1).encode()
            write_atomically(self.targets_path, lambda f: f.write(data))
            self._targets = targets

    # -- supervision ----------------------------------------------------------------------------
    def supervise(self) -> None:
        """Restart the processes `kuberl up` runs that died (the planner restarts the ones it runs),
        follow them to their new process, and print every supervision event of the run. Never blocks
        for long: a broken learner group is stopped and formed again over the following calls."""
        died = self.sup.check()
        for m in self.members:
            if m.proc is not None and (proc := self.sup.procs.get(m.name)) is not None and proc is not m.proc:
                m.proc = proc  # restarted: a new process (on port 0 a new address: connect again once it serves)
                if m.channel is not None:
                    m.channel.close()
                m.channel, m.stub, m.address = None, None, ""
            if m.proc is not None and m.channel is None and m.proc.poll_ready():
                m.connect(m.proc.address, self.cfg)
        self.print_events()
        for p in died:
            if p.name in self.sup.given_up:  # the run cannot go on
                raise RuntimeError(f"{p.name} exited with code {p.popen.returncode} and is not restarted: "
                                   f"{self.sup.given_up[p.name]}; see {p.log_path}")

    def print_events(self) -> None:
        """Print the events.jsonl records not printed yet (from this supervisor and the planner's), and
        count the restarts and group re-forms among them."""
        try:
            with open(self.sup.events_path, "rb") as f:
                f.seek(self.events_read)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.events_read += end
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") in ("restarted", "re-formed"):
                self.restarts[record.get("name", "?")] += 1
            print(format_event(record), flush=True)

    def exit_codes(self) -> dict[str, int | None]:
        codes = dict(self.sup.exit_codes)
        path = self.dir / "planner-exit-codes.json"  # written by the planner's local backend as it stops
        if self.planned and path.exists():
            codes.update(json.loads(path.read_text()))
        return codes

    def new_decisions(self) -> list[dict]:
        """The planner's decisions recorded since the last call (every one: held, suppressed, applied),
        from its journal."""
        path = self.dir / "decisions.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self._decisions_read)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1   # a line still being written waits for the next call
        self._decisions_read += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def decisions(self) -> list[dict]:
        """The planner's applied decisions (and failed applies), from its journal."""
        path = self.dir / "decisions.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            d = json.loads(line)
            if d.get("applied") or d.get("error"):
                out.append(d)
        return out

