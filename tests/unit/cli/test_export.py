"""`kuberl export`: the written ONNX file, loaded with onnxruntime, gives the torch policy's actions
(Discrete and Box, observation normalisation folded in; a masked MultiDiscrete policy with its
`action_mask` input); TorchScript likewise with torch.jit.load; and refusals are one line with exit
code 2."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnxruntime
import pytest
import torch

from services.cli import export
from services.cli.trained import load_trained
from tests.policies import untrained

CARTPOLE_PPO = {"algorithm": "ppo", "env": {"id": "CartPole-v1"}, "ppo": {"hidden_sizes": [16]}}
CARTPOLE_DQN = {"algorithm": "dqn", "env": {"id": "CartPole-v1"}, "dqn": {"hidden_sizes": [16]}}
PENDULUM_PPO = {"algorithm": "ppo", "env": {"id": "Pendulum-v1"},
                "ppo": {"hidden_sizes": [16], "normalize_observations": True}}
PENDULUM_SAC = {"algorithm": "sac", "env": {"id": "Pendulum-v1"}, "sac": {"hidden_sizes": [16]}}
MASKED = {"algorithm": "ppo", "env": {"id": "kuberl_envs:MaskedChoice-v0"}, "ppo": {"hidden_sizes": [16]}}


def _moved_statistics(algo):
    """Observation statistics far from the initial (0, 1) and a policy whose mean is not ~0 (the output
    layer's std is 0.01), so an export that dropped the normalisation gives other actions."""
    net = algo.net
    with torch.no_grad():
        net.obs_norm.mean.copy_(torch.tensor([0.5, -0.5, 2.0], dtype=torch.float64))
        net.obs_norm.var.copy_(torch.tensor([0.1, 4.0, 9.0], dtype=torch.float64))
        net.obs_norm.count.fill_(1000.0)
        net.actor[-1].weight.mul_(100.0)


def _onnx_actions(path, obs: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["obs"] and [o.name for o in session.get_outputs()] == ["action"]
    return session.run(None, {"obs": obs})[0]


@pytest.mark.parametrize("cfg,edit", [(CARTPOLE_PPO, None), (CARTPOLE_DQN, None), (PENDULUM_PPO, _moved_statistics),
                                      (PENDULUM_SAC, None)], ids=["ppo-discrete", "dqn-discrete", "ppo-box-normalised",
                                                                  "sac-box"])
def test_onnx_gives_the_torch_policys_actions(tmp_path, cfg, edit):
    untrained(tmp_path / "run", cfg, edit)
    trained = load_trained(tmp_path / "run")
    path = export.export(trained, "onnx", tmp_path / "policy.onnx")
    obs = export.sample_observations(trained.spec, 100, seed=7)
    with torch.inference_mode():
        want = trained.greedy()(torch.from_numpy(obs)).numpy()
    got = _onnx_actions(path, obs)
    assert got.dtype == want.dtype == trained.spec.action.dtype and got.shape == want.shape
    if np.issubdtype(want.dtype, np.integer):
        assert set(np.unique(want)) == {0, 1}, "random observations should reach both actions"
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert (np.abs(got) <= 2.0 + 1e-6).all()  # Pendulum's torque bounds, clipped in the graph
    if edit is not None:  # the normalisation is in the graph: without it the actions differ
        with torch.inference_mode():
            net = trained.policy.acting.net
            raw = net.head.mode(net.actor(torch.from_numpy(obs))).clamp(-2.0, 2.0).numpy()
        assert not np.allclose(raw, got, atol=1e-3)
    assert export.check(trained, path, "onnx") < 1e-4


def test_sample_masks_allow_a_value_of_every_choice():
    from services.common.protocol.spaces import Discrete, MultiDiscrete, check_mask

    for space in (Discrete(5), MultiDiscrete((4, 3, 1))):
        mask = export.sample_masks(space, 200, seed=2)
        check_mask(space, mask, (200,))   # raises if some row allows no value of a choice
        assert 0.4 < mask[:, :4].mean() < 0.8 and not mask[:, :4].all()


def test_a_masked_policy_takes_its_masks_as_a_second_input(tmp_path, capsys):
    """MaskedChoice (MultiDiscrete [4, 3], masks in info): the ONNX graph's `action_mask` input is
    applied as the torch policy applies it, and a program stepping the env with the file alone never
    takes a disallowed action (each would end the episode with -5)."""
    import gymnasium as gym

    import kuberl_envs  # (registers MaskedChoice-v0)

    untrained(tmp_path / "run", MASKED)
    out = tmp_path / "masked.onnx"
    assert export.main([str(tmp_path / "run"), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "input  action_mask  bool [batch, 7]  (True: allowed)" in captured.out and "checked: onnxruntime" in captured.out
    assert captured.err == ""
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["obs", "action_mask"]
    trained = load_trained(tmp_path / "run")
    obs = export.sample_observations(trained.spec, 300, seed=5)
    mask = export.sample_masks(trained.spec.action, 300, seed=6)
    got = session.run(["action"], {"obs": obs, "action_mask": mask})[0]
    with torch.inference_mode():
        want = trained.greedy()(torch.from_numpy(obs), torch.from_numpy(mask)).numpy()
        unmasked = trained.greedy()(torch.from_numpy(obs)).numpy()
    np.testing.assert_array_equal(got, want)
    assert got.shape == (300, 2) and (got != unmasked).any(), "the masks should change some choices"
    rows = np.arange(300)
    assert mask[rows, got[:, 0]].all() and mask[rows, 4 + got[:, 1]].all()
    env = gym.make("kuberl_envs:MaskedChoice-v0")
    o, info = env.reset(seed=11)
    steps, terminated, truncated = 0, False, False
    while not (terminated or truncated):
        action = session.run(["action"], {"obs": o[None], "action_mask": info["action_mask"][None]})[0][0]
        o, r, terminated, truncated, info = env.step(action)
        steps += 1
    # A disallowed action ends the episode at once, terminated (with -5): this one ran to the time limit.
    assert (steps, terminated, truncated) == (kuberl_envs.MaskedChoice.LENGTH, False, True), f"step {steps}"
    env.close()
    ts = tmp_path / "masked.pt"
    assert export.main([str(tmp_path / "run"), "--format", "torchscript", "-o", str(ts)]) == 0
    assert "checked: torch.jit.load" in capsys.readouterr().out
    assert export.main([str(tmp_path / "run"), "--action-mask", "no", "-o", str(tmp_path / "plain.onnx")]) == 0
    assert "action_mask" not in capsys.readouterr().out
    assert [i.name for i in onnxruntime.InferenceSession(
        str(tmp_path / "plain.onnx"), providers=["CPUExecutionProvider"]).get_inputs()] == ["obs"]


def test_action_mask_auto_follows_the_env_and_yes_adds_the_input(tmp_path, capsys):
    """CartPole reports no masks, so auto gives one input; `yes` adds action_mask to a PPO policy."""
    untrained(tmp_path / "run", CARTPOLE_PPO)
    trained = load_trained(tmp_path / "run")
    assert export.mask_input(trained, "auto") == (False, None)
    assert export.main([str(tmp_path / "run"), "--action-mask", "yes", "-o", str(tmp_path / "p.onnx")]) == 0
    assert "input  action_mask  bool [batch, 2]" in capsys.readouterr().out
    external = dataclasses.replace(trained, cfg=dataclasses.replace(
        trained.cfg, env=dataclasses.replace(trained.cfg.env, mode="external")))
    masked, note = export.mask_input(external, "auto")
    assert not masked and "cannot be made here" in note and "--action-mask yes" in note


def test_torchscript_round_trip_and_cli(tmp_path, capsys):
    untrained(tmp_path / "run", PENDULUM_PPO, _moved_statistics)
    out = tmp_path / "policy.pt"
    assert export.main([str(tmp_path / "run"), "--format", "torchscript", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out} (" in text and "input  obs     float32 [batch, 3]" in text
    assert "output action  float32 [batch, 1]" in text and "checked: torch.jit.load" in text
    extra = {"kuberl.json": ""}
    with pytest.warns(DeprecationWarning, match="torch.jit.load"):  # torch's notice; the format still loads
        module = torch.jit.load(str(out), _extra_files=extra)
    assert json.loads(extra["kuberl.json"])["kuberl.env_id"] == "Pendulum-v1"
    trained = load_trained(out.parent / "run")
    obs = torch.from_numpy(export.sample_observations(trained.spec, 5, seed=3))
    with torch.inference_mode():
        torch.testing.assert_close(module(obs), trained.greedy()(obs))


def test_cli_onnx_default_name_and_metadata(tmp_path, capsys, monkeypatch):
    ckpt = untrained(tmp_path / "run", CARTPOLE_PPO)
    monkeypatch.chdir(tmp_path)
    assert export.main([str(ckpt)]) == 0
    text = capsys.readouterr().out
    assert "wrote policy-v0.onnx" in text and "output action  int64 [batch]  (Discrete(2))" in text
    assert "checked: onnxruntime gives the torch policy's actions on 64 random observations" in text
    import onnx

    props = {p.key: p.value for p in onnx.load(str(tmp_path / "policy-v0.onnx")).metadata_props}
    assert props["kuberl.env_id"] == "CartPole-v1" and props["kuberl.policy_version"] == "0"
    assert json.loads(props["kuberl.inputs"]) == ["obs"]


def test_refusals_are_one_line_with_exit_code_2(tmp_path, capsys):
    ckpt = untrained(tmp_path / "run", CARTPOLE_PPO)
    dqn = untrained(tmp_path / "dqn", CARTPOLE_DQN)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [([str(ckpt), "--format", "tflite"], "--format 'tflite': not a format written here; use onnx or torchscript"),
             ([str(tmp_path / "missing")], "no such run directory or checkpoint file"),
             ([str(empty)], "not a run directory with checkpoints"),
             ([str(junk)], "junk.pt: not a kuberl learner checkpoint ("),
             ([str(ckpt), "--action-mask", "maybe"], "--action-mask 'maybe': use auto, yes or no"),
             ([str(dqn), "--action-mask", "yes"], "--action-mask yes: dqn on Discrete(2) takes no action masks")]
    for argv, message in cases:
        assert export.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.startswith("kuberl export: ") and err.count("\n") == 1, err


def unimportable(ckpt, env_id: str = "kuberl_gone_module:Gone-v0"):
    """`ckpt` rewritten as if trained on an env whose module this machine lacks (a user's `module:EnvId`):
    only the config's env.id changes; the spaces and weights are the checkpoint's own."""
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    state["config"]["env"]["id"] = env_id
    torch.save(state, ckpt)
    return ckpt


def test_a_policy_whose_env_cannot_be_imported_here_is_exported_from_the_checkpoint(tmp_path, capsys):
    """The checkpoint holds its policy's spaces: export builds the policy without making the env, and
    only --action-mask auto, which asks the env, says it could not (a note, not a failure)."""
    ckpt = unimportable(untrained(tmp_path / "run", PENDULUM_SAC))
    trained = load_trained(ckpt)
    assert trained.cfg.env.id == "kuberl_gone_module:Gone-v0" and str(trained.spec.action) == "Box([1], [-2, 2])"
    out = tmp_path / "gone.onnx"
    assert export.main([str(ckpt), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "input  obs     float32 [batch, 3]" in captured.out and "checked: onnxruntime" in captured.out
    assert captured.err == ""    # SAC on a Box takes no masks: nothing asked of the env
    masked = unimportable(untrained(tmp_path / "masked", CARTPOLE_PPO))
    assert export.main([str(masked), "-o", str(tmp_path / "masked.onnx"), "--no-check"]) == 0
    captured = capsys.readouterr()
    assert "output action  int64 [batch]  (Discrete(2))" in captured.out
    assert "'kuberl_gone_module:Gone-v0' cannot be made here" in captured.err and "--action-mask yes" in captured.err


def test_the_spaces_a_checkpoint_holds_read_back_as_the_policys():
    from services.common.protocol.spaces import (Box, Discrete, EnvSpec, MultiDiscrete, dict_layout, spec_from_dict,
                                                 spec_to_dict)

    specs = [EnvSpec((4,), np.dtype(np.float32), Discrete(2)),
             EnvSpec((4, 84, 84), np.dtype(np.uint8), MultiDiscrete((4, 3))),
             EnvSpec((5,), np.dtype(np.float32), Box.of((2,), [-1.0, -np.inf], [1.0, np.inf]),
                     dict_layout({"b": (3,), "a": (2,)}))]
    for spec in specs:
        assert spec_from_dict(spec_to_dict(spec)) == spec
    with pytest.raises(ValueError, match="not the spaces of a policy"):
        spec_from_dict({"observation_shape": [4], "action": {"box": {"shape": [1]}}})
