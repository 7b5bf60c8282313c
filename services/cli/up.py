"""`kuberl up [CONFIG]`: a whole training run on this machine, every role a local process.

Starts a buffer, a learner and N actors on free loopback ports (each writes its bound address to a
ready file), polls their stats, shows progress, and stops at the target return, the step budget or
Ctrl-C. The run directory holds the resolved config, metrics.csv, TensorBoard scalars (tb/),
checkpoints/, one log per process (logs/) and summary.json.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.common.config import ConfigError, ExperimentConfig, dump_config, load_config

log = logging.getLogger("kuberl.up")
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 45.0
CSV_COLUMNS = ["wall_s", "env_steps", "episodes", "return_mean", "actor_env_steps_per_s",
               "actor_fragments_dropped_total", "buffer_size_samples", "buffer_samples_per_insert",
               "learner_updates_per_s", "learner_samples_per_s", "learner_policy_version",
               "learner_policy_lag_mean"]


def _free_port() -> int:
    """A loopback port free right now. Another process could take it before the service binds it;
    the service then fails to start with a bind error, which `kuberl up` reports."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Proc:
    role: str
    name: str
    popen: subprocess.Popen
    log_path: Path
    address: str = ""
    metrics: str | None = None     # Prometheus endpoint host:port
    channel: grpc.Channel | None = None
    stub: object = None
    cursor: int = 0            # actors: last episode index read
    stats: dict = field(default_factory=dict)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class LocalRun:
    def __init__(self, cfg: ExperimentConfig, root: str | Path, name: str | None = None, progress: bool = True,
                 actor_port: int = 50053):
        self.cfg, self.progress, self.actor_port = cfg, progress, actor_port
        self.external = cfg.env.mode == "external"
        env = re.sub(r"[^A-Za-z0-9]+", "-", cfg.env.id).strip("-").lower()
        self.dir = Path(root) / (name or f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.algorithm}-{env}")
        for sub in ("logs", "checkpoints", "tb", "ready"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        dump_config(cfg, self.dir / "config.yaml")
        self.procs: list[Proc] = []
        self.returns: deque[float] = deque(maxlen=cfg.run.return_window)
        self.episodes = 0
        self.env_steps = 0
        self.started = time.monotonic()
        self.reached: dict | None = None

    # -- processes -------------------------------------------------------------------------------
    def _spawn(self, role: str, name: str, listen: str, extra: list[str]) -> Proc:
        ready = self.dir / "ready" / f"{name}.json"
        ready.unlink(missing_ok=True)
        log_path = self.dir / "logs" / f"{name}.log"
        cmd = [sys.executable, "-m", f"services.{role}", "--config", str(self.dir / "config.yaml"),
               "--listen", listen, "--metrics-listen", "127.0.0.1:0", "--ready-file", str(ready), *extra]
        with open(log_path, "ab") as out:
            popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        proc = Proc(role, name, popen, log_path)
        self.procs.append(proc)
        return proc

    def _wait_ready(self, proc: Proc, deadline: float) -> None:
        ready = self.dir / "ready" / f"{proc.name}.json"
        while not ready.exists():
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with code {proc.popen.returncode} before serving:\n"
                                   f"{proc.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} did not start serving within {READY_TIMEOUT_S:.0f} s:\n"
                                   f"{proc.log_tail()}")
            time.sleep(0.02)
        ready_info = json.loads(ready.read_text())
        proc.address, proc.metrics = ready_info["address"], ready_info.get("metrics")
        proc.channel = grpc.insecure_channel(proc.address)
        stub_cls = {"actor": actor_pb2_grpc.ActorStub, "buffer": buffer_pb2_grpc.BufferStub,
                    "learner": learner_pb2_grpc.LearnerStub}[proc.role]
        proc.stub = stub_cls(proc.channel)
        log.info("%s serving on %s, metrics on http://%s/metrics (pid %d, log %s)", proc.name, proc.address,
                 proc.metrics, proc.popen.pid, proc.log_path)

    def start_all(self) -> None:
        """Start every process at once: start order does not matter (peers wait for each other), so
        the buffer and learner listen on ports picked here and nobody waits for another's imports."""
        buffer, learner = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
        self._spawn("buffer", "buffer-0", buffer, [])
        self._spawn("learner", "learner-0", learner, ["--buffer", buffer, "--checkpoint-dir", str(self.dir / "checkpoints")])
        for i in range(self.cfg.topology.actors):
            # External simulators need a known address: actor i listens on actor_port + i.
            listen = f"127.0.0.1:{self.actor_port + i}" if self.external else "127.0.0.1:0"
            self._spawn("actor", f"actor-{i}", listen, [
                "--buffer", buffer, "--learner", learner, "--actor-id", f"actor-{i}-{self.dir.name}",
                "--actor-index", str(i)])

    def _wait_all_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for proc in self.procs:
            self._wait_ready(proc, deadline)

    def stop_all(self) -> None:
        """Actors first (they flush fragments to the buffer), then the learner (final checkpoint), then the buffer."""
        for role in ("actor", "learner", "buffer"):
            group = [p for p in self.procs if p.role == role and p.popen.poll() is None]
            for p in group:
                p.popen.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    p.popen.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0f s; killing it", p.name, STOP_TIMEOUT_S)
                    p.popen.kill()
                    p.popen.wait()
        for p in self.procs:
            if p.channel is not None:
                p.channel.close()

    # -- monitoring ------------------------------------------------------------------------------
    def poll(self) -> None:
        new_eps: list[pb.Episode] = []
        for p in self.procs:
            try:
                resp = p.stub.GetStats(pb.GetStatsRequest(episodes_after=p.cursor), timeout=5.0)
            except grpc.RpcError as err:
                log.debug("stats from %s failed: %s", p.name, err.code().name)
                continue
            p.stats = dict(resp.metrics)
            if resp.episodes:
                p.cursor = resp.episodes[-1].index
                new_eps.extend(resp.episodes)
        self.env_steps = int(sum(p.stats.get("actor/env_steps_total", 0) for p in self._role("actor")))
        for ep in sorted(new_eps, key=lambda e: e.end_unix_s):
            self.returns.append(ep.episode_return)
            self.episodes += 1
            self.tb.add_scalar("charts/episodic_return", ep.episode_return, self.env_steps)
            self.tb.add_scalar("charts/episodic_length", ep.length, self.env_steps)

    def _role(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role]

    def _sum(self, role: str, name: str) -> float:
        return float(sum(p.stats.get(name, 0.0) for p in self._role(role)))

    @property
    def mean_return(self) -> float | None:
        return sum(self.returns) / len(self.returns) if self.returns else None

    def row(self) -> dict:
        learner = self._role("learner")[0].stats if self._role("learner") else {}
        buffer = self._role("buffer")[0].stats if self._role("buffer") else {}
        return {
            "wall_s": round(time.monotonic() - self.started, 3), "env_steps": self.env_steps,
            "episodes": self.episodes, "return_mean": self.mean_return,
            "actor_env_steps_per_s": self._sum("actor", "actor/env_steps_per_s"),
            "actor_fragments_dropped_total": self._sum("actor", "actor/fragments_dropped_total"),
            "buffer_size_samples": buffer.get("buffer/size_samples"),
            "buffer_samples_per_insert": buffer.get("buffer/samples_per_insert"),
            "learner_updates_per_s": learner.get("learner/updates_per_s"),
            "learner_samples_per_s": learner.get("learner/samples_per_s"),
            "learner_policy_version": learner.get("learner/policy_version"),
            "learner_policy_lag_mean": learner.get("learner/policy_lag_mean"),
        }

    def show(self, row: dict) -> None:
        def f(v, spec=",.0f"):
            return "-" if v is None else format(v, spec)
        line = (f"[{row['wall_s']:7.1f}s] steps {row['env_steps']:>10,} ({f(row['actor_env_steps_per_s'])}/s)"
                f" | episodes {row['episodes']:>6,} | return {f(row['return_mean'], '.1f')}"
                f" (last {len(self.returns)}) | learner v{f(row['learner_policy_version'])}"
                f" {f(row['learner_updates_per_s'], ',.1f')} upd/s {f(row['learner_samples_per_s'])} smp/s"
                f" lag {f(row['learner_policy_lag_mean'], '.1f')} | buffer {f(row['buffer_size_samples'])}"
                f" | dropped {f(row['actor_fragments_dropped_total'])}")
        print(line, flush=True)

    def check_alive(self) -> None:
        for p in self.procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited unexpectedly with code {p.popen.returncode}:\n{p.log_tail()}")

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

    def run(self) -> dict:
        reason, error = "interrupted", None
        self.tb = None
        csv_file = open(self.dir / "metrics.csv", "w", newline="")
        writer = csv.DictWriter(csv_file, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        try:
            self.start_all()
            from tensorboardX import SummaryWriter  # a 1 s import: paid while the services start

            self.tb = SummaryWriter(str(self.dir / "tb"))
            self._wait_all_ready()
            self.started = time.monotonic()
            if self.external:
                print("waiting for simulators: connect them over EnvSession to "
                      + ", ".join(p.address for p in self._role("actor")) + " (see docs/external-simulators.md)",
                      flush=True)
            while True:
                time.sleep(self.cfg.run.poll_interval_s)
                self.check_alive()
                self.poll()
                row = self.row()
                writer.writerow(row)
                csv_file.flush()
                for k, v in row.items():
                    if k not in ("wall_s", "env_steps") and v is not None:
                        self.tb.add_scalar(k.replace("_", "/", 1), v, self.env_steps)
                if self.progress:
                    self.show(row)
                if (reason := self.stop_reason()) is not None:
                    break
        except KeyboardInterrupt:
            reason = "interrupted"
            print("\ninterrupted: stopping every process", flush=True)
        except RuntimeError as err:
            reason, error = "failed", str(err)
            print(f"kuberl up: {err}", file=sys.stderr, flush=True)
        finally:
            wall = time.monotonic() - self.started
            self.stop_all()
            if self.tb is not None:
                self.tb.close()
            csv_file.close()
        learner = self._role("learner")[0].stats if self._role("learner") else {}
        summary = {"reason": reason, "error": error, "env_steps": self.env_steps, "episodes": self.episodes,
                   "mean_return": self.mean_return, "return_window": len(self.returns), "wall_s": round(wall, 3),
                   "policy_version": learner.get("learner/policy_version"),
                   "exit_codes": {p.name: p.popen.returncode for p in self.procs}, "run_dir": str(self.dir),
                   "last_stats": {p.name: p.stats for p in self.procs}}
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"{reason}: {self.env_steps:,} env steps, {self.episodes:,} episodes, mean return "
              f"{'-' if self.mean_return is None else f'{self.mean_return:.1f}'} over the last {len(self.returns)}, "
              f"{wall:.1f} s. Run directory: {self.dir}", flush=True)
        return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kuberl up", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=None, help="experiment YAML (default: CartPole-v1 with PPO)")
    p.add_argument("--run-dir", default=None, help="parent directory for the run (default: run.run_dir)")
    p.add_argument("--name", default=None, help="run directory name (default: <time>-<algorithm>-<env>)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--actor-port", type=int, default=50053,
                   help="env.mode external: actor i listens on 127.0.0.1:(this + i) for simulators (default 50053)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s up: %(message)s")
    try:
        cfg = load_config(args.config)
    except (ConfigError, OSError) as err:
        print(f"kuberl up: {args.config}: {err}", file=sys.stderr)
        return 2
    run = LocalRun(cfg, args.run_dir or cfg.run.run_dir, args.name, progress=not args.quiet, actor_port=args.actor_port)
    summary = run.run()
    return 1 if summary["reason"] == "failed" else 0
