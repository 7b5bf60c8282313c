"""What `kuberl tune` reports to the pruner (services/cli/tune.py, Running.follow): at each report point
an episode's env steps pass, the mean of the last `window` returns read before it; a row still being
written waits for the next read."""

from __future__ import annotations

from collections import deque

from services.cli.tune import Running, with_values


def running(tmp_path, window: int, every: int) -> Running:
    return Running(trial=None, values={}, dir=tmp_path, proc=None, log=None, started=0.0, window=window, every=every,
                   next_report=every, returns=deque())


def test_report_points_are_the_running_mean_when_the_steps_pass_them(tmp_path):
    r = running(tmp_path, window=2, every=100)
    csv = tmp_path / "episodes.csv"
    csv.write_text("wall_s,env_steps,return,length,policy_version\n0.1,50,10,50,0\n0.2,90,20,40,0\n0.3,2")
    assert r.follow() == []                       # nothing passed 100 yet; the partial row waits
    with open(csv, "a") as f:
        f.write("10,30,20,1\n0.4,330,40,20,1\n")   # 210 passes 100 and 200; 330 passes 300
    # at 100 and 200: the mean of the two returns before the episode that passed them (10, 20)
    assert r.follow() == [(100, 15.0), (200, 15.0), (300, 25.0)]
    assert r.env_steps == 330 and list(r.returns) == [30.0, 40.0]


def test_trial_values_set_dotted_keys_without_touching_the_base():
    base = {"ppo": {"learning_rate": 0.1, "num_epochs": 4}, "env": {"id": "CartPole-v1"}}
    out = with_values(base, {"ppo.learning_rate": 0.01, "env.id": "Acrobot-v1"})
    assert out == {"ppo": {"learning_rate": 0.01, "num_epochs": 4}, "env": {"id": "Acrobot-v1"}}
    assert base["ppo"]["learning_rate"] == 0.1
