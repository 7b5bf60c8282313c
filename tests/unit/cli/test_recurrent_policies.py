"""A recurrent PPO policy (ppo.recurrent) after training: `kuberl export` writes its state as an
explicit input and output (ONNX, TorchScript) and the file steps a real episode as the torch policy
does; `kuberl eval` carries each env copy's state and starts it afresh at each episode's end."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import onnxruntime
import pytest
import torch

import kuberl_envs  # noqa: F401 - registers CartPoleNoVelocity-v1
from services.cli import evaluate, export
from services.cli.trained import load_trained
from tests.policies import untrained

NO_VELOCITY = {"algorithm": "ppo", "env": {"id": "kuberl_envs:CartPoleNoVelocity-v1"},
               "ppo": {"hidden_sizes": [16], "recurrent": "lstm", "recurrent_size": 8}}
PENDULUM = {"algorithm": "ppo", "env": {"id": "Pendulum-v1"},
            "ppo": {"hidden_sizes": [16], "recurrent": "gru", "recurrent_size": 8, "normalize_observations": True,
                    "critic_core": "separate"}}


def _louder(algo):
    """A policy head far from uniform (its output layer's std is 0.01), so actions depend on the state."""
    with torch.no_grad():
        algo.net.actor.weight.mul_(300.0)


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
@pytest.mark.parametrize("cfg", [NO_VELOCITY, PENDULUM], ids=["lstm-discrete", "gru-box-separate-critic"])
def test_the_export_steps_an_episode_as_the_torch_policy_does(tmp_path, cfg, fmt):
    untrained(tmp_path / "run", cfg, _louder)
    trained = load_trained(tmp_path / "run")
    path = export.export(trained, fmt, tmp_path / f"policy{export.FORMATS[fmt]}")
    assert export.check(trained, path, fmt) < 1e-4
    size = trained.policy.state_size
    assert size == 16   # LSTM: h and c of 8; the GRU with a critic core of its own: two h of 8
    if fmt == "onnx":
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == ["obs", "state"]
        assert [o.name for o in session.get_outputs()] == ["action", "next_state"]
        meta = session.get_modelmeta().custom_metadata_map
        assert json.loads(meta["kuberl.outputs"]) == ["action", "next_state"] and meta["kuberl.state_size"] == str(size)

        def step(obs, state):
            return session.run(None, {"obs": obs, "state": state})
    else:
        with export._quiet_exporter():   # (torch marks jit.load deprecated; its warning is silenced as export's is)
            loaded = torch.jit.load(str(path))

        def step(obs, state):
            with torch.inference_mode():
                return [x.numpy() for x in loaded(torch.from_numpy(obs), torch.from_numpy(state))]
    env = gym.make(cfg["env"]["id"])
    obs, _ = env.reset(seed=3)
    state = want_state = np.zeros((1, size), np.float32)
    greedy = trained.greedy()
    states = []
    for _ in range(60):
        x = np.asarray(obs, np.float32)[None]
        action, state = step(x, state)
        with torch.inference_mode():
            want, want_state = (t.numpy() for t in greedy(torch.from_numpy(x), torch.from_numpy(want_state)))
        np.testing.assert_allclose(state, want_state, rtol=1e-4, atol=1e-5)
        if np.issubdtype(want.dtype, np.integer):
            np.testing.assert_array_equal(action, want)
        else:
            np.testing.assert_allclose(action, want, rtol=1e-4, atol=1e-5)
        states.append(state.copy())
        obs, _, term, trunc, _ = env.step(action[0])
        if term or trunc:
            obs, _ = env.reset()
            state = want_state = np.zeros((1, size), np.float32)
    assert not np.allclose(states[0], states[5]), "the state moves from step to step"


def test_eval_carries_each_copys_state_and_starts_it_afresh_at_an_episodes_end(tmp_path):
    untrained(tmp_path / "run", NO_VELOCITY, _louder)
    trained = load_trained(tmp_path / "run")
    act = evaluate.act_fn(trained, True, 3)
    obs = np.random.default_rng(0).normal(size=(3, 2)).astype(np.float32)
    act.act(obs, None, 0)
    moved = act.state.copy()
    assert moved.shape == (3, 16) and np.abs(moved).min(axis=1).all() and np.abs(moved).sum(axis=1).all()
    act.ended(np.array([False, True, False]))
    assert not act.state[1].any() and np.array_equal(act.state[[0, 2]], moved[[0, 2]])
    # Stepping from the zero state again gives the first step's action and state: nothing else is kept.
    fresh = evaluate.act_fn(trained, True, 3)
    np.testing.assert_array_equal(act.act(obs, None, 0)[0][1], fresh.act(obs, None, 0)[0][1])
    np.testing.assert_allclose(act.state[1], fresh.state[1], rtol=1e-6)
    result = evaluate.evaluate(trained, episodes=4, num_envs=2, seed=0)
    assert result["episodes"] == 4 and len(result["returns"]) == 4
    stochastic = evaluate.evaluate(trained, episodes=2, num_envs=2, seed=0, deterministic=False)
    assert stochastic["episodes"] == 2
