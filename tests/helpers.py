"""Helpers for tests that start real services: as subprocesses (`Service`) or in-process configs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import yaml

from kuberl.v1 import common_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]

TINY_PPO = {
    "algorithm": "ppo",
    "env": {"id": "CartPole-v1", "num_envs": 2},
    "ppo": {"rollout_steps": 8, "batch_steps": 16, "num_epochs": 1, "num_minibatches": 2, "hidden_sizes": [16]},
    "learner": {"checkpoint_interval_s": 3600},
    "actor": {"push_ack_interval_s": 0.2},
}
TINY_DQN = {
    "algorithm": "dqn",
    "env": {"id": "CartPole-v1", "num_envs": 2},
    "dqn": {"rollout_steps": 8, "buffer_size": 512, "batch_size": 16, "learning_starts": 32, "hidden_sizes": [16]},
    "learner": {"checkpoint_interval_s": 3600},
    "actor": {"push_ack_interval_s": 0.2},
}

# SAC on a Box action, with TINY_DQN's replay settings. Uncapped: the buffer's rate limiter holds the
# actor to the learner past the (tiny) warm-up, so its send queue never fills.
TINY_SAC = {**TINY_DQN, "algorithm": "sac", "env": {"id": "Pendulum-v1", "num_envs": 2}, "sac": TINY_DQN["dqn"]}


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


class Service:
    """A service started as `python -m services.<role>` on 127.0.0.1 with a ready file."""

    def __init__(self, role: str, tmp: Path, config: Path, *args: str, listen: str = "127.0.0.1:0",
                 env: dict | None = None, python_args: tuple[str, ...] = (), module: bool = True):
        self.role = role
        tag = f"{role}-{time.monotonic_ns()}"
        self.ready = tmp / f"{tag}.json"
        self.log = tmp / f"{tag}.log"
        entry = ["-m", f"services.{role}"] if module else []
        cmd = [sys.executable, *python_args, *entry, "--config", str(config), "--listen", listen,
               "--metrics-listen", "127.0.0.1:0", "--ready-file", str(self.ready), *args]
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, **(env or {})})
        self.address = ""
        self.metrics: str | None = None

    def wait_ready(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.role} exited {self.popen.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.role} not ready after {timeout} s:\n{self.output()}")
            time.sleep(0.05)
        info = json.loads(self.ready.read_text())
        self.address, self.metrics = info["address"], info["metrics"]
        return self.address

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(f"{self.role} ignored SIGTERM for {timeout} s:\n{self.output()}") from None

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.1, what="condition"):
    """Poll `predicate` until it returns a truthy value (returned); AssertionError on timeout, saying
    `what` (a string, or a callable that says it as of the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


def http_get(address: str, path: str, timeout: float = 30.0) -> tuple[int, str]:
    """(status, body) of GET http://address/path, error statuses included (the metrics port's probes)."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def eval_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`kuberl eval ARGS` in a process of its own. Videos go through an ffmpeg that imageio forks: forked
    from pytest's process, where earlier tests left gRPC threads, the child can write gRPC's complaints
    into the ffmpeg stderr that imageio parses (seen in a full run). A `kuberl eval` process has none."""
    return subprocess.run([sys.executable, "-m", "services.cli.main", "eval", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def video_frames(path) -> tuple[int, tuple[int, ...]]:
    """(frames, first frame's shape) of a video as imageio reads it back, read in a process of its own
    (see eval_cli)."""
    code = ("import json, sys, imageio.v2 as imageio\n"
            "r = imageio.get_reader(sys.argv[1])\n"
            "print(json.dumps([r.count_frames(), list(r.get_data(0).shape)]))\n"
            "r.close()\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    frames, shape = json.loads(out.stdout)
    return frames, tuple(shape)


def stats(address: str, stub_cls, timeout: float = 5.0) -> dict[str, float]:
    with grpc.insecure_channel(address) as ch:
        return dict(stub_cls(ch).GetStats(pb.GetStatsRequest(), timeout=timeout).metrics)


def run_logs(run_dir: Path, names=None, lines: int = 15) -> str:
    """The last lines of a `kuberl up` run's process logs (all, or those in `names`), for failure messages."""
    out = []
    for path in sorted((Path(run_dir) / "logs").glob("*.log")):
        if names is None or path.stem in names:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(out) or f"(no logs under {run_dir}/logs)"


def stop_up(proc: subprocess.Popen, run_dir: Path) -> str:
    """Interrupt `kuberl up` (started with `--run-dir run_dir --name run`) as Ctrl-C would; it must stop
    every process it (and its planner) started within 150 s. Returns its output."""
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"kuberl up did not stop within 150 s of SIGINT:\n{out}\n{run_logs(run_dir / 'run')}") from None
    return out


def up_to_target(tmp_path: Path, name: str, cfg: dict, *, target: float, budget: int, window: int = 100) -> dict:
    """Run `kuberl up` on `cfg` (configs/<name>.yaml, changed) until `target` mean return over the last
    `window` episodes or `budget` env steps; assert it reached the target within the budget with every
    process exiting cleanly, and that the final checkpoint's evaluation (`kuberl up`'s, without a time
    limit here) ran every episode without an error; return summary.json."""
    cfg = {**cfg, "run": {**cfg.get("run", {}), "target_return": target, "return_window": window,
                          "max_env_steps": budget, "poll_interval_s": 0.5},
           "evaluation": {**cfg.get("evaluation", {}), "after_training": True, "max_seconds": 0}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(path), "--run-dir", str(tmp_path),
                           "--name", "run", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=880)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["reason"] == "target_return", summary
    assert summary["return_window"] == window and summary["mean_return"] >= target
    assert summary["env_steps"] <= budget
    failed = {n: code for n, code in summary["exit_codes"].items() if code != 0}
    assert not failed, f"processes that did not exit cleanly: {failed}\n{run_logs(tmp_path / 'run', failed)}"
    evaluation = summary["evaluation"]
    assert evaluation is not None and "error" not in evaluation, evaluation
    assert evaluation["deterministic"] and evaluation["episodes"] == evaluation["episodes_asked"] >= 1, evaluation
    assert len(evaluation["returns"]) == evaluation["episodes"] and Path(evaluation["checkpoint"]).is_file(), evaluation
    return summary
