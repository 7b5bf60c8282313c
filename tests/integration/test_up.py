"""`kuberl up` end to end: progress, the run directory, and a clean stop on Ctrl-C."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, TINY_DQN, TINY_PPO, wait_for, write_config


def _up(tmp_path, config) -> tuple[subprocess.Popen, list[str]]:
    """`kuberl up CONFIG` into tmp_path/run, its output read line by line (into the list returned)."""
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.main", "up", str(config), "--run-dir", str(tmp_path),
                             "--name", "run"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, []


def _wait_for_training(proc: subprocess.Popen, lines: list[str], learners: int = 1) -> None:
    """Until a progress line shows env steps and learner updates (from every learner of a group)."""
    def progressing():
        line = proc.stdout.readline()
        lines.append(line)
        return ("steps" in line and " v0 " not in line and "learner v-" not in line and "learners v-" not in line
                and "(0/s)" not in line and (learners == 1 or f"{learners} learners" in line))
    wait_for(progressing, timeout=120, interval=0, what="progress lines:\n" + "".join(lines))


@pytest.mark.parametrize("planner,learners,buffers", [(True, 1, 1), (False, 1, 1), (False, 2, 1), (True, 1, 2)],
                         ids=["planner", "fixed-topology", "fixed-topology-learner-group", "planner-buffer-shards"])
def test_ctrl_c_stops_every_process_cleanly(tmp_path, planner, learners, buffers):
    config = write_config(tmp_path / "c.yaml", {**TINY_PPO, "topology": {"actors": 2, "learners": learners,
                                                                          "buffers": buffers},
                                                "planner": {"enabled": planner},
                                                "run": {"target_return": None, "poll_interval_s": 0.2}})
    proc, lines = _up(tmp_path, config)
    try:
        _wait_for_training(proc, lines, learners)   # then press Ctrl-C
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines) + out
    assert "interrupted" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reason"] == "interrupted"
    names = ([f"buffer-{i}" for i in range(buffers)] + ["actor-0", "actor-1"] + [f"learner-{i}" for i in range(learners)]
             + (["planner-0"] if planner else []))
    assert summary["exit_codes"] == {name: 0 for name in names}
    assert summary["env_steps"] > 0
    if buffers > 1:   # each actor pushed to its own shard, and the learner trained from both
        for i in range(buffers):
            log = (tmp_path / "run" / "logs" / f"actor-{i}.log").read_text()
            assert re.search(rf"buffer \S+ \(shard {i} of {buffers}\)", log), log[-2000:]
        # Each shard stored exactly what the actors on it (actor-j on shard j % buffers) were acknowledged.
        acked = [0] * buffers
        for path in (tmp_path / "run" / "logs").glob("actor-*.log"):
            for m in re.finditer(r"actor \S+ stopped: \d+ fragments cut, (\d+) acknowledged", path.read_text()):
                acked[int(path.stem.split("-")[1]) % buffers] += int(m.group(1))
        last = [summary["last_stats"][f"buffer-{i}"] for i in range(buffers)]
        assert [s["buffer/fragments_received_total"] for s in last] == acked and sum(acked) > 0, (acked, last)
        assert sum(s["buffer/samples_served_total"] for s in last) > 0, last
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt"))  # the learner's shutdown checkpoint
    for name in names:
        assert "stopped cleanly" in (tmp_path / "run" / "logs" / f"{name}.log").read_text()


def test_bad_config_is_refused_before_anything_starts(tmp_path):
    config = write_config(tmp_path / "c.yaml", {"topology": {"actors": 0}})
    out = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(config), "--run-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "topology.actors: 0 is invalid" in out.stderr
    assert not any(tmp_path.glob("*/logs"))  # nothing was started


SAC_TAKES = "algorithm: sac takes Box actions with bounds finite in float32 with low < high"


@pytest.mark.parametrize("config, message", [
    ({"algorithm": "sac", "env": {"id": "my-sim", "mode": "external", "observation_shape": [3],
                                  "action_space": {"type": "discrete", "n": 3}}},
     f"{SAC_TAKES}; env.action_space is Discrete(3)"),
    ({"algorithm": "sac", "env": {"id": "my-sim", "mode": "external", "observation_shape": [3],
                                  "action_space": {"type": "box", "shape": [1]}}},
     f"{SAC_TAKES}; env.action_space is Box([1], [-inf, inf])"),
    ({"algorithm": "sac", "env": {"id": "CartPole-v1"}}, f"{SAC_TAKES}; env.id CartPole-v1's action space is Discrete(2)"),
    ({"algorithm": "dqn", "env": {"id": "Pendulum-v1", "mode": "external"}},
     "algorithm: dqn takes Discrete actions; env.id Pendulum-v1's action space is Box([1], [-2, 2])"),
], ids=["sac-declared-discrete", "sac-declared-unbounded-box", "sac-cartpole", "dqn-external-pendulum"])
def test_spaces_the_algorithm_cannot_train_on_are_refused_before_anything_starts(tmp_path, config, message):
    """Before issue 25 these started every process, which crash-looped on the spaces for minutes."""
    path = write_config(tmp_path / "c.yaml", config)
    out = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(path), "--run-dir", str(tmp_path / "runs")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr == f"kuberl up: {path}: {message}\n"
    assert not (tmp_path / "runs").exists()  # no run directory: no process was started


def test_a_killed_dqn_buffer_comes_back_with_its_replay_and_the_run_goes_on(tmp_path):
    """`buffer.checkpoint_dir` asked for: `kuberl up` restarts a SIGKILLed buffer on the same address
    and it restores the replay from the run directory's last checkpoint."""
    from bench.chaos import kill_and_wait_back, ready, stats
    from bench.chaos import wait_for as wait_while_up
    from kuberl.v1.buffer_pb2_grpc import BufferStub
    config = write_config(tmp_path / "c.yaml", {**TINY_DQN, "planner": {"enabled": False},
                                                "buffer": {"checkpoint_dir": "replay", "checkpoint_interval_s": 1},
                                                "run": {"target_return": None, "poll_interval_s": 0.2}})
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.main", "up", str(config), "--run-dir", str(tmp_path),
                             "--name", "run", "--quiet"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        old = wait_while_up("buffer-0 serving", lambda: ready(run, "buffer-0"), proc, timeout=120)
        held = wait_while_up("transitions held", lambda: (s := stats(old["address"], BufferStub)).get(
            "buffer/size_samples", 0) > 0 and s, proc, timeout=120)
        wait_while_up("a checkpoint taken after that", lambda: stats(old["address"], BufferStub).get(
            "buffer/checkpoints_total", 0) >= held["buffer/checkpoints_total"] + 2, proc, timeout=120)
        new = kill_and_wait_back(run, "buffer-0", proc)
        assert new["address"] == old["address"]
        restored = stats(new["address"], BufferStub)
        assert restored["buffer/checkpoint_restored_samples"] > 0 and restored["buffer/size_samples"] > 0
        wait_while_up("the restarted buffer receiving again", lambda: stats(new["address"], BufferStub).get(
            "buffer/fragments_received_total", 0) > 0, proc, timeout=120)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "buffer-0 exited with code -9 (SIGKILL); restarting it in 1 s" in out
    assert list((run / "replay").glob("*.npz"))
    assert json.loads((run / "summary.json").read_text())["exit_codes"]["buffer-0"] == 0


def test_sigterm_stops_every_process_and_writes_the_run_record(tmp_path):
    """SIGTERM (what timeout, systemd, docker stop and CI runners send) ends `kuberl up` as Ctrl-C does:
    every process stops cleanly, and summary.json (reason "terminated") and events.jsonl are written;
    a second SIGTERM while it stops is only reported."""
    config = write_config(tmp_path / "c.yaml", {**TINY_PPO, "planner": {"enabled": False},
                                                "run": {"target_return": None, "poll_interval_s": 0.2}})
    proc, lines = _up(tmp_path, config)
    try:
        _wait_for_training(proc, lines)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "SIGTERM: stopping every process" in (line := proc.stdout.readline()) or lines.append(line),
                 timeout=60, interval=0, what="the stop:\n" + "".join(lines))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines) + out
    assert "SIGTERM: the run is already stopping" in out, out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reason"] == "terminated" and summary["env_steps"] > 0
    assert summary["exit_codes"] == {"buffer-0": 0, "actor-0": 0, "learner-0": 0}
    assert summary["evaluation"] is None   # (a stopped run is not evaluated, as after Ctrl-C)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["reason"]) for e in events if e["name"] == "run"] == [("ended", "terminated")], events
