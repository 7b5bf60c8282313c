"""bench/zoo.py: how runs are read (steps to target, mean at the budget) and how the zoo's hyper-parameters
become a kuberl config. The translated configs must load: a key kuberl does not have would fail here,
not an hour into the benchmark."""

from __future__ import annotations

import pytest

from bench.zoo import TASKS, Task, outcome, translate
from services.config import config_from_dict

TASK = Task("t", "CartPole-v1", "dqn", target=10.0, window=3)


def test_outcome_is_the_first_full_window_at_the_target_and_the_mean_at_the_end():
    episodes = [(100, 20.0, 1.0), (200, 0.0, 2.0), (300, 10.0, 3.0), (400, 20.0, 4.0), (500, 0.0, 5.0)]
    # windows: [20, 0, 10] = 10 at 300 steps (first full window that reaches 10), then 10, 10
    r = outcome(episodes, TASK, steps=600)
    assert (r["reached"], r["steps_to_target"], r["seconds_to_target"]) == (True, 300, 3.0)
    assert (r["final_mean"], r["episodes"], r["env_steps"]) == (10.0, 5, 600)


def test_a_window_that_is_not_full_never_counts():
    r = outcome([(100, 50.0, 1.0), (200, 50.0, 2.0)], TASK, steps=200)
    assert (r["reached"], r["steps_to_target"], r["final_mean"]) == (False, None, 50.0)


def test_dqn_translation_counts_replay_ratio_and_target_interval_as_kuberl_does():
    zoo = {"n_timesteps": 5e4, "learning_rate": 2.3e-3, "batch_size": 64, "buffer_size": 100000,
           "learning_starts": 1000, "gamma": 0.99, "target_update_interval": 10, "train_freq": 256,
           "gradient_steps": 128, "exploration_fraction": 0.16, "exploration_final_eps": 0.04,
           "policy_kwargs": "dict(net_arch=[256, 256])"}
    dqn = translate(TASK, zoo)["dqn"]
    assert dqn["replay_ratio"] == 64 * 128 / 256  # samples trained per env step
    # SB3 syncs every 10 env steps but trains in bursts of 128 updates every 256 steps: the target is
    # fixed through each burst, 128 updates
    assert dqn["target_update_interval"] == 128
    assert dqn["exploration_steps"] == 8000 and dqn["hidden_sizes"] == [256, 256]
    assert (dqn["n_step"], dqn["double_dqn"]) == (1, False)   # SB3's DQN: one-step, Nature DQN targets
    every_step = translate(TASK, {**zoo, "train_freq": 4, "gradient_steps": -1, "target_update_interval": 250,
                                  "learning_starts": 0})["dqn"]
    assert (every_step["replay_ratio"], every_step["target_update_interval"]) == (64, 250)
    assert every_step["learning_starts"] == 64  # kuberl needs one batch stored before it serves


def test_ppo_translation_keeps_the_batch_and_names_what_it_cannot_translate():
    zoo = {"n_envs": 8, "n_timesteps": 1e5, "n_steps": 32, "batch_size": 256, "gae_lambda": 0.8, "gamma": 0.98,
           "n_epochs": 20, "learning_rate": "lin_0.001", "clip_range": "lin_0.2", "normalize": True}
    out = translate(Task("t", "CartPole-v1", "ppo", 475, 100), zoo)
    ppo = out["ppo"]
    assert (out["env"]["num_envs"], ppo["rollout_steps"], ppo["batch_steps"], ppo["num_minibatches"]) == (8, 32, 256, 1)
    assert (ppo["learning_rate"], ppo["clip_coef"], ppo["normalize_observations"]) == (0.001, 0.2, True)
    # SB3's linear schedules run over n_timesteps env steps: 100,000 / 256 per batch = 391 updates
    assert (ppo["anneal_updates"], ppo["anneal_clip"]) == (391, True)
    assert "learning_rate" not in out["untranslated"] and "clip_range" not in out["untranslated"]
    assert ppo["normalize_rewards"] is True and out["untranslated"] == []   # VecNormalize: both now
    obs_only = translate(Task("t", "CartPole-v1", "ppo", 475, 100), {**zoo, "normalize": "dict(norm_reward=False)"})
    assert (obs_only["ppo"]["normalize_observations"], obs_only["ppo"]["normalize_rewards"]) == (True, False)
    clip_only = translate(Task("t", "CartPole-v1", "ppo", 475, 100), {**zoo, "learning_rate": 3e-4})
    assert "anneal_updates" not in clip_only["ppo"] and clip_only["untranslated"][0] == "clip_range"


def test_ppo_translation_keeps_sb3s_synchronous_loop():
    task = Task("t", "Acrobot-v1", "ppo", -100, 100)
    zoo = {"n_envs": 16, "n_timesteps": 1e6, "n_steps": 256, "gae_lambda": 0.94, "n_epochs": 4, "normalize": True}
    out = translate(task, zoo)
    # SB3: vf_coef x mean((R - V)^2); kuberl: vf_coef x 0.5 mean((R - V)^2), kept as written (measured)
    assert out["ppo"]["vf_coef"] == 0.5 and translate(task, {**zoo, "vf_coef": 0.25})["ppo"]["vf_coef"] == 0.25
    assert (out["ppo"]["num_minibatches"], out["ppo"]["clip_vloss"]) == (16 * 256 // 64, False)
    # SB3 collects n_steps x n_envs with one policy, then trains: one actor of n_envs envs (the planner
    # adds none), held after each fragment (one whole batch) until the learner's next weights
    assert out["actor"] == {"fragments_per_version": 1} and out["planner"] == {"enabled": False}
    assert out["ppo"]["rollout_steps"] * out["env"]["num_envs"] == out["ppo"]["batch_steps"]
    assert "actor" not in translate(TASK, {"n_timesteps": 5e4})   # replay algorithms are paced by their ratio


def test_sac_translation_replay_ratio_is_batch_times_updates_per_step():
    sac = translate(Task("t", "Pendulum-v1", "sac", -200, 10),
                    {"n_timesteps": 2e4, "learning_rate": 1e-3, "train_freq": 8, "gradient_steps": 4})["sac"]
    assert (sac["replay_ratio"], sac["policy_lr"], sac["q_lr"], sac["batch_size"]) == (128, 1e-3, 1e-3, 256)


def test_every_task_translates_to_a_config_kuberl_loads():
    pytest.importorskip("rl_zoo3", reason="the zoo's hyper-parameter files come with the zoo extra (docs/benchmarks.md)")
    from bench.zoo import zoo_hyperparams

    for task in TASKS.values():
        tuned = translate(task, zoo_hyperparams(task))
        sections = {k: v for k, v in tuned.items() if k not in ("env", "untranslated")}
        cfg = config_from_dict({"algorithm": task.algo, "env": {"id": task.env_id, **tuned["env"]}, **sections})
        assert cfg.env.num_envs == tuned["env"]["num_envs"], task.name
        if task.algo == "ppo":
            assert (cfg.actor.fragments_per_version, cfg.planner.enabled) == (1, False), task.name


def test_the_table_reads_rows_without_an_sb3_run():
    """`--runs tuned` alone: no ratio against SB3, but a table (it raised KeyError: 'sb3')."""
    from bench.zoo import table

    run = {"reached": True, "steps_to_target": 1000, "seconds_to_target": 2.0, "env_steps": 1200, "final_mean": 480.0}
    out = table([{"task": "cartpole-ppo", "seed": 0, "budget": 100_000, "tuned": run}])
    assert "| cartpole-ppo | 475 (100) | 100,000 | tuned | 1,000 / 2 s | 480.0 | - |" in out
