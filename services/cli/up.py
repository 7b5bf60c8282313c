"""`kuberl up [CONFIG]`: a whole training run on this machine, every role a local process.

Starts a buffer and the planner on free loopback ports; the planner's local backend starts the learner
and `topology.actors` actors and rescales the actors as it measures their rates (with `planner.enabled:
false`, `kuberl up` starts a fixed topology itself). It polls every process's stats, shows progress and
the planner's decisions, and stops at the target return, the step budget or Ctrl-C. The run directory
holds the resolved config, metrics.csv (one row per poll), episodes.csv (one row per finished episode:
the learning curve), TensorBoard scalars (tb/), checkpoints/, one log per process (logs/), the
planner's decisions.jsonl and summary.json. When training ends (target return, step or time budget), the
final checkpoint is evaluated deterministically (config `evaluation`, `kuberl eval`) and the result goes
into summary.json as `evaluation`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import json
import logging
import os
import re
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc, planner_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from kuberl.v1 import planner_pb2 as ppb
from services.cli.progress import CSV_COLUMNS, EPISODE_COLUMNS, HeldShare, progress_line
from services.cli.tally import Tally, fmt_losses, fmt_return
from services.config import ConfigError, ExperimentConfig, check_algorithm_takes, dump_config, load_config
from services.common.tokens import AuthError, read_client_token, with_token
from services.common.procs import ServiceProcess, free_port
from services.common.runtime import add_tls_arguments, with_tls_flags
from services.common.shards import combined_samples_per_insert
from services.common.supervise import (LEARNERS, STOP_TIMEOUT_S, Spec, Supervisor, actor_args, buffer_args,
                                       format_event, learner_specs)
from services.common.tls import TlsError, check_role, open_channel

log = logging.getLogger("kuberl.up")
READY_TIMEOUT_S = 120.0


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


def _new_dir(root: Path, name: str) -> Path:
    """`root/name`, or `root/name-2`, `-3`... if taken: runs started in the same second never share a
    directory (their logs, ready files and checkpoints would mix)."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(1, 1000):
        path = root / (name if i == 1 else f"{name}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory name like {root / name}")


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


class LocalRun:
    def __init__(self, cfg: ExperimentConfig, root: str | Path, name: str | None = None, progress: bool = True,
                 actor_port: int = 50053, planner_port: int | None = None):
        self.cfg, self.progress, self.actor_port = cfg, progress, actor_port
        self.external = cfg.env.mode == "external"
        self.planned = cfg.planner.enabled
        if planner_port is not None and planner_port in self.actor_ports:
            raise ConfigError(f"--planner-port {planner_port} is one of the external actors' ports "
                              f"{self.actor_ports.start}..{self.actor_ports.stop - 1} (--actor-port + i): pick another")
        self.planner_port = planner_port
        env = re.sub(r"[^A-Za-z0-9]+", "-", cfg.env.id).strip("-").lower()
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.algorithm}-{env}"
        self.dir = Path(root) / name if name else _new_dir(Path(root), stamp)
        self._planner_claim = None   # the lock that keeps PLANNER_PORT this run's while it lasts
        for sub in ("logs", "checkpoints", "tb", "ready"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        dump_config(cfg, self.dir / "config.yaml")
        # Every process `kuberl up` starts itself is supervised: one that dies is started again on the
        # same address (peers reconnect to it) and the event is printed (see services/common/supervise.py).
        self.sup = Supervisor(self.dir, self.dir / "config.yaml", log_events=False)
        self.events_read = 0  # bytes of events.jsonl already printed (the planner's backend appends too)
        self.restarts: Counter[str] = Counter()  # process or group -> restarts, as events.jsonl records them
        self.members: list[Member] = []   # live
        self.retired: list[Member] = []   # actors the planner stopped: their counters still count
        self.tally = Tally(cfg.run.return_window)  # run totals across processes and their restarts
        self.returns = self.tally.returns
        self.episodes = 0
        self.env_steps = 0
        self.started = time.monotonic()
        self.held = HeldShare()
        self.reached: dict | None = None
        self.last_decision_id = 0
        self.episode_rows: csv.writer | None = None  # episodes.csv, while `run` has it open

    # -- processes -------------------------------------------------------------------------------
    @property
    def actor_ports(self) -> range:
        """The ports external simulators find actors on (actor i at actor_port + i); empty otherwise."""
        if not self.external:
            return range(0)
        n = self.cfg.planner.actor.max if self.planned else self.cfg.topology.actors
        return range(self.actor_port, self.actor_port + n)

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
        learner = f"127.0.0.1:{self._free_port()}"  # rank 0: the learner actors take weights from
        n = self.cfg.topology.learners
        # A group is re-formed as a whole when one of its learners dies, as the planner's backend does.
        for proc in self.sup.start_group(LEARNERS, n, learner_specs(self.dir, n, buffer=buffer, listen=learner),
                                         port=self._free_port):
            self.members.append(Member("learner", proc.name, proc))
        for i in range(self.cfg.topology.actors):
            # External simulators need a known address: actor i listens on actor_port + i.
            listen = f"127.0.0.1:{self.actor_port + i}" if self.external else "127.0.0.1:0"
            self._spawn("actor", f"actor-{i}", listen,
                        actor_args(f"actor-{i}", self.dir.name, buffer=buffer, learner=learner, index=i))

    def _free_port(self) -> int:
        while (port := free_port()) in self.actor_ports:
            pass
        return port

    def _wait_all_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for m in self.members:
            self._wait_ready(m, deadline)
        if self.planned:  # wait until the planner's learner and actors serve too
            while True:
                self._sync_planned()
                if all(self._role(r) for r in ("learner", "actor")):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the planner's learner and actors did not start serving within "
                                       f"{READY_TIMEOUT_S:.0f} s; see {self.dir / 'logs'}")
                self.supervise()
                time.sleep(0.05)

    def _sync_planned(self) -> None:
        """Follow the replicas the planner runs: add new ones, retire the ones it stopped."""
        planner = self._role("planner")[0]
        if planner.stub is None:  # restarted, not serving yet
            return
        try:
            status = planner.stub.GetStatus(ppb.GetStatusRequest(), timeout=5.0)
        except grpc.RpcError as err:
            log.debug("planner status failed: %s", err.code().name)
            return
        live = {(r.role, r.name): r.address for r in status.replicas if r.ready and r.address}
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

    def stop_all(self) -> None:
        """Actors first (they flush fragments to the buffer), then the learner (final checkpoint), then
        the buffer. With the planner on, stopping the planner stops its actors and learner in that order."""
        for role in ("planner", "actor", "learner", "buffer"):
            if role == "buffer":  # every actor has flushed to it: its counters are final now
                self._final_stats("buffer")
            names = [m.name for m in self.members if m.role == role and m.proc is not None]
            self.sup.stop(names, STOP_TIMEOUT_S + (60 if role == "planner" else 0))
        self.print_events()
        for m in self.members + self.retired:
            if m.channel is not None:
                m.channel.close()
        if self._planner_claim is not None:   # the planner has stopped: another run may take its port
            self._planner_claim.close()
            self._planner_claim = None

    # -- monitoring ------------------------------------------------------------------------------
    def poll(self) -> None:
        """Read every process's stats and every episode finished since the last poll (page by page),
        and update the run totals: summed over all processes the run had, across their restarts
        (services/cli/tally.py)."""
        if self.planned:
            self._sync_planned()
        new_eps: list[pb.Episode] = []
        for p in self.members:
            if p.stub is None:  # not connected yet
                continue

            def fetch(after: int, p: Member = p) -> pb.GetStatsResponse:
                return p.stub.GetStats(pb.GetStatsRequest(episodes_after=after), timeout=5.0)
            try:
                resp = self.tally.read(p.name, fetch, new_eps)
            except grpc.RpcError as err:
                log.debug("stats from %s failed: %s", p.name, err.code().name)
                # Nothing vouches for a silent process's production: its rates count as 0.
                p.stats = {k: 0.0 if k.endswith("_per_s") else v for k, v in p.stats.items()}
                continue
            p.stats = dict(resp.metrics)
        self.env_steps = int(self.tally.total("actor/env_steps_total"))
        self.episodes = int(self.tally.total("actor/episodes_total"))  # exact, whether or not every return was read
        wall = round(time.monotonic() - self.started, 3)
        for ep in self.tally.record(new_eps):
            self.tb.add_scalar("charts/episodic_return", ep.episode_return, self.env_steps)
            self.tb.add_scalar("charts/episodic_length", ep.length, self.env_steps)
            if self.episode_rows is not None:  # env_steps and wall_s: the run's when the episode was read
                self.episode_rows.writerow([wall, self.env_steps, ep.episode_return, ep.length, ep.policy_version])

    def _role(self, role: str) -> list[Member]:
        return [p for p in self.members if p.role == role]

    def _sum(self, role: str, name: str) -> float:
        return float(sum(p.stats.get(name, 0.0) for p in self._role(role)))

    @property
    def mean_return(self) -> float | None:
        return sum(self.returns) / len(self.returns) if self.returns else None

    def row(self) -> dict:
        learner = self._role("learner")[0].stats if self._role("learner") else {}
        buffers = [m.stats for m in self._role("buffer")]
        buffer = buffers[0] if buffers else {}
        planner = self._role("planner")[0].stats if self._role("planner") else {}
        tally = self.tally
        losses = tally.losses()
        return {
            "wall_s": round(time.monotonic() - self.started, 3), "env_steps": self.env_steps,
            "episodes": self.episodes, "episodes_skipped": tally.episodes_skipped, "return_mean": self.mean_return,
            "actor_env_steps_per_s": self._sum("actor", "actor/env_steps_per_s"),
            "actor_fragments_dropped_total": tally.total("actor/fragments_dropped_total"),
            "actor_fragments_rejected_total": tally.total("actor/fragments_rejected_total"),
            "samples_lost_total": sum(losses.values()),
            **{f"samples_lost_{r}": v for r, v in losses.items()},
            "buffer_size_samples": self._sum("buffer", "buffer/size_samples") if buffers else None,
            "buffer_samples_per_insert": combined_samples_per_insert(buffers),
            "learner_updates_per_s": learner.get("learner/updates_per_s"),
            "learner_samples_per_s": self._sum("learner", "learner/samples_per_s") if self._role("learner") else None,
            "learner_policy_version": learner.get("learner/policy_version"),
            "learner_policy_lag_mean": learner.get("learner/policy_lag_mean"),
            "replay_ratio_target": buffer.get("buffer/replay_ratio_target"),
            "actors_held_share": self.held.update(time.monotonic(), self.tally.total("actor/pace_wait_seconds_total"),
                                                  len(self._role("actor"))),
            "actors": len(self._role("actor")),
            "learners": len(self._role("learner")),
            "planner_ratio": planner.get("planner/production_consumption_ratio"),
            "process_restarts": sum(self.restarts.values()),
        }

    def _final_stats(self, role: str) -> None:
        """Read `role`'s counters once more, into the run totals too (they are final now)."""
        for m in self._role(role):
            try:
                resp = m.stub.GetStats(pb.GetStatsRequest(episodes_after=self.tally.cursor(m.name)), timeout=5.0)
                m.stats = dict(resp.metrics)
                self.tally.observe_response(m.name, resp)
            except (grpc.RpcError, AttributeError) as err:  # AttributeError: never connected
                log.warning("final stats of %s could not be read: %s", m.name, err)

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

    def stop_reason(self) -> str | None:
        run = self.cfg.run
        if (run.target_return is not None and len(self.returns) == run.return_window
                and self.mean_return >= run.target_return):
            return "target_return"
        if self.env_steps >= run.max_env_steps:
            return "max_env_steps"
        if run.max_seconds is not None and time.monotonic() - self.started >= run.max_seconds:
            return "max_seconds"
        return None

    def exit_codes(self) -> dict[str, int | None]:
        codes = dict(self.sup.exit_codes)
        path = self.dir / "planner-exit-codes.json"  # written by the planner's local backend as it stops
        if self.planned and path.exists():
            codes.update(json.loads(path.read_text()))
        return codes

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

    def evaluate(self, reason: str) -> dict | None:
        """The final checkpoint's deterministic evaluation (config `evaluation`, services/cli/evaluate.py),
        printed and returned for summary.json; None when it is off or training did not end normally
        (interrupted or failed: no one waits for it then)."""
        if not self.cfg.evaluation.after_training or reason in ("interrupted", "failed"):
            return None
        if self.cfg.env.mode == "external":  # (evaluate_after_training skips it too)
            print("not evaluated: the env is the external simulators' (env.mode: external); evaluate the policy "
                  "with `kuberl serve` and your simulator, or `kuberl eval --env ENV_ID` (docs/after-training.md)",
                  flush=True)
            return None
        from services.cli.evaluate import describe, evaluate_after_training

        e = self.cfg.evaluation
        print(f"evaluating the final checkpoint: {e.episodes} episodes, deterministic actions "
              f"(evaluation.after_training: false turns this off)", flush=True)
        try:
            result = evaluate_after_training(self.cfg, self.dir)
        except KeyboardInterrupt:  # the run itself is over: its summary is still written
            print("evaluation interrupted", flush=True)
            return {"error": "interrupted"}
        if result is not None and "error" in result:
            print(f"evaluation failed: {result['error']}", flush=True)
        elif result is not None:
            partial = (f" (stopped at evaluation.max_seconds: {result['episodes']} of {e.episodes} episodes)"
                       if result["episodes"] < e.episodes else "")
            print(f"evaluation of {Path(result['checkpoint']).name}{partial}:\n{describe(result)}", flush=True)
        return result

    def run(self) -> dict:
        reason, error = "interrupted", None
        self.tb = None
        files = contextlib.ExitStack()  # closed whatever happens, after every process has stopped
        try:
            csv_file = files.enter_context(open(self.dir / "metrics.csv", "w", newline=""))
            writer = csv.DictWriter(csv_file, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            episodes_file = files.enter_context(open(self.dir / "episodes.csv", "w", newline=""))
            self.episode_rows = csv.writer(episodes_file)
            self.episode_rows.writerow(EPISODE_COLUMNS)
            self.start_all()
            from tensorboardX import SummaryWriter  # a 1 s import: paid while the services start

            self.tb = SummaryWriter(str(self.dir / "tb"))
            self._wait_all_ready()
            self.started = time.monotonic()
            if self.planned:
                planner = self._role("planner")[0].address
                if self.cfg.tls.enabled:  # the run's config holds the TLS files to dial with
                    planner += f" --config {self.dir / 'config.yaml'}"
                print(f"planner API on {planner} ({self.cfg.planner.backend} backend): e.g. "
                      f"`kuberl decisions -f --planner {planner}`, `kuberl scale actor 2 --planner {planner}`",
                      flush=True)
            if self.external:
                print("waiting for simulators: connect them over EnvSession to "
                      + ", ".join(p.address for p in self._role("actor")) + " (see docs/external-simulators.md"
                      + (", over TLS: docs/security.md" if self.cfg.tls.enabled else "") + ")", flush=True)
            while True:
                time.sleep(self.cfg.run.poll_interval_s)
                self.supervise()
                self.poll()
                row = self.row()
                writer.writerow(row)
                csv_file.flush()
                episodes_file.flush()
                for k, v in row.items():
                    if k not in ("wall_s", "env_steps") and v is not None:
                        self.tb.add_scalar(k.replace("_", "/", 1), v, self.env_steps)
                if self.progress:
                    print(progress_line(row, len(self.returns)), flush=True)
                if (reason := self.stop_reason()) is not None:
                    break
        except KeyboardInterrupt:
            reason = "interrupted"
            print("\ninterrupted: stopping every process", flush=True)
        except (RuntimeError, TlsError, AuthError) as err:   # the last two: files broken mid-run (rotation)
            reason, error = "failed", str(err)
            print(f"kuberl up: {err}", file=sys.stderr, flush=True)
        finally:
            wall = time.monotonic() - self.started
            with files:
                self.stop_all()
                if self.tb is not None:
                    self.tb.close()
            self.episode_rows = None
        learner = self._role("learner")[0].stats if self._role("learner") else {}
        tally = self.tally
        losses = tally.losses()
        evaluation = self.evaluate(reason)
        summary = {"reason": reason, "error": error, "env_steps": self.env_steps, "episodes": self.episodes,
                   "episodes_read": tally.episodes_read, "episodes_skipped": tally.episodes_skipped,
                   "mean_return": self.mean_return, "return_window": len(self.returns), "wall_s": round(wall, 3),
                   "samples_lost": {"total": sum(losses.values()), **losses},
                   "process_restarts": dict(self.restarts),
                   "policy_version": learner.get("learner/policy_version"),
                   "exit_codes": self.exit_codes(), "run_dir": str(self.dir),
                   "last_stats": {p.name: p.stats for p in self.members + self.retired if p.role != "planner"},
                   "decisions": self.decisions(), "evaluation": evaluation}
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        skipped = f" ({tally.episodes_skipped:,} skipped)" if tally.episodes_skipped else ""
        print(f"{reason}: {self.env_steps:,} env steps, {self.episodes:,} episodes{skipped}, mean return "
              f"{fmt_return(self.mean_return)} over the last {len(self.returns)}, samples lost {fmt_losses(losses)}, "
              f"{wall:.1f} s. Run directory: {self.dir}", flush=True)
        return summary



def checked_spec(cfg: ExperimentConfig):
    """The run's env spec, refused unless the config's algorithm can train on it: what `kuberl up` asks
    before it starts any process. Declared spaces were checked when the config was built; an env id's
    are read by making the env once. Blocking. ConfigError naming `algorithm` and the env, or naming
    `env.id` when the env cannot be made here."""
    from services.common.envs import made_spec   # gymnasium: imported when a run starts, not by `kuberl --help`

    spec = made_spec(cfg.env)
    if cfg.env.declared_spec is None:
        check_algorithm_takes(cfg, spec, f"env.id {cfg.env.id}'s action space", f"env.id {cfg.env.id}'s observations")
    return spec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kuberl up", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=None, help="experiment YAML (default: CartPole-v1 with PPO)")
    p.add_argument("--run-dir", default=None, help="parent directory for the run (default: run.run_dir)")
    p.add_argument("--name", default=None, help="run directory name (default: <time>-<algorithm>-<env>)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--actor-port", type=int, default=50053,
                   help="env.mode external: actor i listens on 127.0.0.1:(this + i) for simulators (default 50053)")
    p.add_argument("--planner-port", type=int, default=None,
                   help=f"the planner's API listens on 127.0.0.1:(this) (default {PLANNER_PORT} when it is free and no "
                        "external actor's port, else a free port; the address is printed)")
    add_tls_arguments(p)  # written into the run's config.yaml, which every process reads
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s up: %(message)s")
    try:
        cfg = load_config(args.config)
        # The algorithm must be able to train on the env's spaces (declared ones were checked on load;
        # an env id's are read by making the env once): refused here, not by processes crash-looping.
        checked_spec(cfg)
    except (ConfigError, OSError) as err:
        print(f"kuberl up: {args.config}: {err}", file=sys.stderr)
        return 2
    try:
        cfg = with_tls_flags(cfg, args)
        check_role(cfg.tls)  # every process serves with these files: refused here, before any starts
    except TlsError as err:
        print(f"kuberl up: {err}", file=sys.stderr)
        return 2
    try:
        run = LocalRun(cfg, args.run_dir or cfg.run.run_dir, args.name, progress=not args.quiet,
                       actor_port=args.actor_port, planner_port=args.planner_port)
    except ConfigError as err:
        print(f"kuberl up: {err}", file=sys.stderr)
        return 2
    summary = run.run()
    return 1 if summary["reason"] == "failed" else 0
