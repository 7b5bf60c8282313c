"""Memory through the whole stack (`kuberl up`: actor, buffer and learner processes over gRPC):
CartPole-v1 with the velocities hidden (kuberl_envs' CartPoleNoVelocity-v1, observations [x, theta]).

Balancing needs the pole's angular velocity, which one observation does not hold. With PPO's
defaults (one config, only `ppo.recurrent` differs):
- feed-forward PPO never holds a mean return of 100 over 100 episodes: measured 55.9 at best in
  256k env steps (2026-11-26, seed 0), and below 100 throughout this test's budget;
- recurrent PPO (an LSTM core of 64 units) reaches a mean of 200 over 100 episodes, measured at
  47,104 env steps (seed 0; 330 at best by 177k).
The gap is what memory buys: the only difference between the two runs is the recurrent core.
Assertions are on returns and env steps, never on wall time.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import threading

import pytest
import yaml

from tests.helpers import ROOT, up_to_target
from tests.k8s.cluster import free_port

ENV = "kuberl_envs:CartPoleNoVelocity-v1"
TARGET, BUDGET, WINDOW = 200.0, 150_000, 100
FEED_FORWARD_CEILING = 100.0


def config(seed: int, recurrent: str | None) -> dict:
    return {"algorithm": "ppo", "seed": seed, "env": {"id": ENV, "num_envs": 8}, "ppo": {"recurrent": recurrent},
            "topology": {"actors": 1}}


@pytest.mark.learning
@pytest.mark.timeout(900)
def test_recurrent_ppo_reaches_200_where_memory_is_needed(tmp_path):
    summary = up_to_target(tmp_path, "no_velocity_lstm", config(0, "lstm"), target=TARGET, budget=BUDGET,
                           window=WINDOW)
    assert summary["samples_lost"]["total"] == 0
    learner = summary["last_stats"]["learner-0"]
    assert learner["learner/samples_total"] > 0 and learner.get("learner/gradient_steps_skipped_nonfinite_total", 0) == 0


@pytest.mark.learning
@pytest.mark.timeout(900)
def test_feed_forward_ppo_stays_below_100_on_the_same_task(tmp_path):
    cfg = {**config(0, None), "run": {"max_env_steps": BUDGET, "target_return": TARGET, "return_window": WINDOW,
                                      "poll_interval_s": 0.5},
           "evaluation": {"after_training": False}}
    path = tmp_path / "no_velocity_ff.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(path), "--run-dir", str(tmp_path),
                           "--name", "run", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "run" / "episodes.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    returns = [float(r["return"]) for r in rows]
    assert float(rows[-1]["env_steps"]) >= BUDGET * 0.9 and len(returns) >= 2 * WINDOW
    best = max(sum(returns[i - WINDOW:i]) / WINDOW for i in range(WINDOW, len(returns) + 1))
    assert best < FEED_FORWARD_CEILING, f"feed-forward PPO held {best:.1f} over {WINDOW} episodes without memory"


@pytest.mark.learning
@pytest.mark.timeout(900)
def test_recurrent_ppo_learns_from_a_simulator_over_env_session_through_handovers(tmp_path):
    """The same task stepped by an external simulator (kuberl_client.gym.serve_gym_env, 8 env copies,
    in a thread of this process) that hands its stream over every 10 s (same session_id): the actor
    keeps each copy's state across handovers, and recurrent PPO reaches the same target."""
    import gymnasium as gym

    import kuberl_envs  # noqa: F401 - registers CartPoleNoVelocity-v1
    from kuberl_client.gym import serve_gym_env

    cfg = {**config(0, "lstm"), "env": {"id": ENV, "mode": "external"},
           "run": {"max_env_steps": BUDGET, "target_return": TARGET, "return_window": WINDOW, "poll_interval_s": 0.5},
           "evaluation": {"after_training": False}}
    path = tmp_path / "no_velocity_external.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "services.cli.main", "up", str(path), "--run-dir", str(tmp_path),
                           "--name", "run", "--quiet", "--actor-port", str(port)], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop, result = threading.Event(), {}

    def simulate() -> None:
        envs = gym.make_vec(ENV, num_envs=8, vectorization_mode="sync",
                            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
        try:
            result.update(serve_gym_env(envs, f"127.0.0.1:{port}", session_id="memory", stop=stop, seed=0,
                                        timeout_s=120, reconnect_s=10.0))
        except Exception as err:  # noqa: BLE001 - the actor going away at the end is the simulator's stop
            result["error"] = repr(err)
        finally:
            envs.close()
    simulator = threading.Thread(target=simulate, daemon=True)
    simulator.start()
    try:
        out, _ = up.communicate(timeout=880)
    finally:
        stop.set()
        if up.poll() is None:
            up.kill()
    simulator.join(timeout=60)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert up.returncode == 0, out
    assert summary["reason"] == "target_return" and summary["mean_return"] >= TARGET, summary
    assert summary["env_steps"] <= BUDGET and summary["samples_lost"]["total"] == 0
    actor = summary["last_stats"]["actor-0"]
    assert actor["actor/sessions_resumed_total"] >= 2, "the simulator handed its stream over, resuming the session"
