"""`kuberl eval` on untrained policies: exact episode counts over parallel copies, action masks applied,
GIF and Atari videos with one frame per step, `kuberl up`'s switch, one-line refusals (exit 2), and
the policies of external runs: refused with directions, or evaluated on a gymnasium env of their spaces (--env)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.cli import evaluate
from services.cli.trained import load_trained
from services.config import config_from_dict
from services.common.models.heads import Head
from services.common.protocol.spaces import Box, Discrete, MultiDiscrete
from tests.helpers import eval_cli, video_frames
from tests.unit.cli.test_export import unimportable
from tests.policies import untrained

CARTPOLE = {"algorithm": "ppo", "env": {"id": "CartPole-v1"}, "ppo": {"hidden_sizes": [16]}}
MASKED = {"algorithm": "ppo", "env": {"id": "kuberl_envs:MaskedChoice-v0"}, "ppo": {"hidden_sizes": [16]}}


def test_head_mode_is_the_distributions_mode():
    out = torch.randn(6, 7)
    mask = torch.rand(6, 7) < 0.6
    mask[:, 0] = mask[:, 4] = True  # at least one allowed value per choice
    for space, m in ((Discrete(7), mask), (MultiDiscrete((4, 3)), mask), (Box.of((7,), -1.0, 1.0), None)):
        head = Head(space)
        torch.testing.assert_close(head.mode(out, m), head(out, m).mode())


def test_every_asked_episode_runs_over_uneven_copies(tmp_path, capsys):
    untrained(tmp_path / "run", CARTPOLE)
    assert evaluate.main([str(tmp_path / "run"), "--episodes", "7", "--num-envs", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["episodes"] == result["episodes_asked"] == 7 and result["num_envs"] == 3
    assert result["policy_version"] == 0 and result["video"] is None
    assert result["length"]["min"] >= 1 and result["return"]["max"] == max(result["returns"])


def test_eval_applies_the_envs_action_masks(tmp_path, capsys):
    """MaskedChoice ends an episode with -5 at the first disallowed action; masked, even an untrained
    policy never takes one."""
    untrained(tmp_path / "run", MASKED)
    assert evaluate.main([str(tmp_path / "run"), "--episodes", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["lengths"] == [16] * 4 and min(result["returns"]) >= 0


def test_a_gif_video(tmp_path, capsys):
    import imageio.v2 as imageio

    untrained(tmp_path / "run", {**CARTPOLE, "env": {"id": "CartPole-v1", "max_episode_steps": 20}})
    gif = tmp_path / "cartpole.gif"
    assert evaluate.main([str(tmp_path / "run"), "--episodes", "1", "--json", "--video", str(gif),
                          "--video-episodes", "2", "--fps", "50"]) == 0
    video = json.loads(capsys.readouterr().out)["video"]
    assert video["episodes"] == 2 and video["frames"] == sum(video["lengths"]) and video["fps"] == 50
    reader = imageio.get_reader(gif)
    try:
        # Pillow merges identical consecutive frames of a GIF (adding up their durations): at most one a step.
        assert 1 <= len(reader) <= video["frames"] <= 40 and reader.get_data(0).shape[:2] == (400, 600)
    finally:
        reader.close()


def test_an_atari_video_renders_the_game(tmp_path):
    pytest.importorskip("ale_py", reason="ale-py is in the actor extra")
    untrained(tmp_path / "run", {"algorithm": "dqn", "env": {"id": "ALE/Pong-v5", "max_episode_steps": 12}})
    mp4 = tmp_path / "pong.mp4"
    out = eval_cli(str(tmp_path / "run"), "--episodes", "1", "--json", "--video", str(mp4), "--video-episodes", "1")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    video = result["video"]
    assert result["lengths"] == [12] and video["frames"] == sum(video["lengths"]) >= 1
    # The full colour screen, not the 84x84 grey observation.
    assert video_frames(mp4) == (video["frames"], (210, 160, 3))


def test_refusals_are_one_line_with_exit_code_2(tmp_path, capsys):
    untrained(tmp_path / "masked", MASKED)
    untrained(tmp_path / "run", CARTPOLE)
    cases = [([str(tmp_path / "masked"), "--episodes", "1", "--video", str(tmp_path / "m.mp4")],
              "--video: env kuberl_envs:MaskedChoice-v0 does not render rgb_array frames (its render modes: none)"),
             ([str(tmp_path / "run"), "--video", str(tmp_path / "v.avi")],
              "not a video format written here; use .mp4 or .gif"),
             ([str(tmp_path / "nowhere")], "no such run directory or checkpoint file"),
             ([str(tmp_path / "run" / "config.yaml")], "config.yaml: not a kuberl learner checkpoint ("),
             ([str(tmp_path / "run"), "--episodes", "0"], "--episodes 0: must be >= 1"),
             ([str(unimportable(untrained(tmp_path / "gone", CARTPOLE)))],   # (eval steps the env: it must be made)
              "env.id 'kuberl_gone_module:Gone-v0' cannot be made here (ModuleNotFoundError: ")]
    for argv, message in cases:
        assert evaluate.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.startswith("kuberl eval: ") and err.count("\n") == 1, err


EXTERNAL = {"algorithm": "ppo", "env": {"id": "my-sim", "mode": "external", "observation_shape": [4], "num_actions": 2},
            "ppo": {"hidden_sizes": [16]}}


def test_an_external_runs_policy_is_refused_pointing_at_serve_and_env(tmp_path, capsys):
    """Its env is the simulators' (here one gymnasium does not know): say how to evaluate it instead."""
    ckpt = untrained(tmp_path / "run", EXTERNAL)
    assert evaluate.main([str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"kuberl eval: {ckpt}: trained on external simulators (env.mode: external), whose env kuberl eval "
                   f"cannot make: serve the policy with `kuberl serve {tmp_path / 'run'}` and connect your simulator "
                   "to it (docs/after-training.md), or evaluate it here on a gymnasium env with its spaces "
                   "(observations Box[4] float32, actions Discrete(2)) with --env ENV_ID\n")


def test_an_external_run_whose_spaces_came_from_an_env_id_is_refused_suggesting_it(tmp_path, capsys):
    untrained(tmp_path / "run", {**CARTPOLE, "env": {"id": "CartPole-v1", "mode": "external"}})
    assert evaluate.main([str(tmp_path / "run"), "--episodes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kuberl eval: ") and err.count("\n") == 1
    assert err.endswith("with --env ENV_ID (e.g. --env CartPole-v1, the env.id its spaces came from)\n")


def test_env_evaluates_an_external_runs_policy_on_a_gymnasium_env_of_its_spaces(tmp_path, capsys):
    untrained(tmp_path / "run", EXTERNAL)
    assert evaluate.main([str(tmp_path / "run"), "--env", "CartPole-v1", "--episodes", "3", "--num-envs", "2",
                          "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["env_id"] == "CartPole-v1" and result["episodes"] == 3 and len(result["lengths"]) == 3
    assert result["length"]["min"] >= 1  # CartPole's episodes, stepped here


def test_env_is_refused_unless_it_can_be_made_and_has_the_policys_spaces(tmp_path, capsys):
    untrained(tmp_path / "run", EXTERNAL)
    cases = [("Pendulum-v1", "--env Pendulum-v1: its spaces (observations Box[3] float32, actions Box([1], [-2, 2])) "
                             "are not the policy's (observations Box[4] float32, actions Discrete(2))"),
             ("kuberl_envs:MaskedChoice-v0", "--env kuberl_envs:MaskedChoice-v0: its spaces (observations Box[7] "
                                             "float32, actions MultiDiscrete([4, 3])) are not the policy's"),
             ("NoSuchEnv-v0", "--env NoSuchEnv-v0: cannot be made here (NameNotFound: "),
             ("ALE/x", "--env ALE/x: 'ALE/x' is invalid: Atari ids are ALE/<Game>-v5")]
    for env_id, message in cases:
        assert evaluate.main([str(tmp_path / "run"), "--env", env_id]) == 2, env_id
        err = capsys.readouterr().err
        assert err.startswith(f"kuberl eval: {message}") and err.count("\n") == 1, err


def test_env_with_other_box_bounds_is_refused(tmp_path, capsys):
    """The policy's actions are clipped into the bounds it trained with: another env's are not the same space."""
    untrained(tmp_path / "run", {"algorithm": "ppo", "ppo": {"hidden_sizes": [16]}, "env": {
        "mode": "external", "observation_shape": [3], "action_space": {"type": "box", "shape": [1], "low": [-1.0],
                                                                        "high": [1.0]}}})
    assert evaluate.main([str(tmp_path / "run"), "--env", "Pendulum-v1"]) == 2
    assert "actions Box([1], [-2, 2])) are not the policy's (observations Box[3] float32, actions Box([1], [-1, 1]))" \
        in capsys.readouterr().err


def test_up_evaluates_unless_the_config_says_not_to(tmp_path):
    untrained(tmp_path / "run", CARTPOLE)
    off = config_from_dict({**CARTPOLE, "evaluation": {"after_training": False}})
    assert evaluate.evaluate_after_training(off, tmp_path / "run") is None
    external = config_from_dict({**CARTPOLE, "env": {**CARTPOLE.get("env", {}), "mode": "external"}})
    assert evaluate.evaluate_after_training(external, tmp_path / "run") is None  # the simulators' env, not ours
    on = config_from_dict({**CARTPOLE, "evaluation": {"episodes": 2, "num_envs": 2, "max_seconds": 0}})
    result = evaluate.evaluate_after_training(on, tmp_path / "run")
    assert result["episodes"] == result["episodes_asked"] == 2 and result["num_envs"] == 2
    assert result["deterministic"] and "wall_s" in result   # the time it took: recorded for the summary, not judged
    assert evaluate.evaluate_after_training(on, tmp_path / "nowhere") == {
        "error": f"{tmp_path / 'nowhere'}: no such run directory or checkpoint file"}


def test_trained_policy_holds_the_checkpoints_weights(tmp_path):
    ckpt = untrained(tmp_path / "run", CARTPOLE)
    state = torch.load(ckpt, weights_only=True)
    trained = load_trained(ckpt)
    for name, value in trained.policy.acting.net.state_dict().items():
        torch.testing.assert_close(value, state["algo"]["net"][name])
    assert trained.greedy()(torch.zeros(1, 4)).shape == (1,)


def test_tally_counts_each_slots_share_of_episodes_in_the_order_they_end():
    """`kuberl eval`'s bookkeeping (run_episodes, evaluate_policies): slot i finishes its share, lengths
    count the steps it acted, and an episode past a slot's share is not counted."""
    from services.cli.evaluate import Tally

    assert Tally.shares(7, 3).tolist() == [2, 2, 3] and Tally.shares(2, 4).tolist() == [0, 0, 1, 1]
    seen = []
    tally = Tally(np.array([1, 2]), seen.append)
    tally.step(np.array([1.0, 2.0]), np.array([True, False]), np.array([False, True]))   # slot 1: 2.0 in 0 acting steps
    tally.step(np.array([3.0, 4.0]), True, np.array([True, False]))                      # slot 0: 4.0 in 2
    assert not tally.finished
    tally.step(np.array([5.0, 6.0]), True, np.array([True, True]))   # slot 1: 10.0 in 2; slot 0 past its share
    assert tally.finished and tally.returns == [2.0, 4.0, 10.0] == seen and tally.lengths == [0, 2, 2]


def test_an_external_run_of_several_policies_is_refused_pointing_at_serve(tmp_path, capsys):
    """A run of several policies trained on external simulators: its env is the simulators' too, so it is
    refused in one line naming what to do (it used to crash making an env gymnasium does not know)."""
    import torch

    from services.common.stats import Metrics
    from services.config import config_from_dict, dump_config
    from services.learner.trainer import Trainer

    torch.set_num_threads(1)
    cfg = config_from_dict({**EXTERNAL, "env": {"id": "teams-split", "mode": "external"},
                            "planner": {"enabled": False},
                            "policies": {"hunters": {"agents": ["h*"], "observation_shape": [4], "num_actions": 2},
                                         "prey": {"agents": ["p*"], "observation_shape": [3], "num_actions": 4}}})
    run = tmp_path / "run"
    run.mkdir()
    dump_config(cfg, run / "config.yaml")
    for name in cfg.policy_names:
        Trainer(cfg, Metrics("learner"), run / "checkpoints" / name, policy=name).checkpoint()
    assert evaluate.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err == (f"kuberl eval: {run}: a run of several policies (hunters, prey) trained on external simulators "
                   f"(env.mode: external), whose env kuberl eval cannot make: serve the policies with `kuberl serve "
                   f"{run}` and connect your simulator's sessions to them, one per policy (docs/after-training.md)\n")


def test_the_printed_mean_says_how_many_episodes_it_is_over():
    """`kuberl eval` and `kuberl up`'s evaluation after training print the mean with its episode count
    (a 10-episode mean read as a long run's was a newcomer's mistake)."""
    from services.cli.evaluate import describe

    stats = {"mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0}
    assert describe({"episodes": 10, "return": stats, "length": stats}).splitlines()[0].endswith("over 10 episodes")
    assert describe({"episodes": 1, "return": stats, "length": stats}).splitlines()[0].endswith("over 1 episode")


def test_a_discrete_observation_policy_fits_only_an_env_of_as_many_values():
    """`kuberl eval --env`: a policy one-hotting Discrete(16) observations takes no Discrete(64) env's
    (the same int64 [] on the wire), and its spaces are named as spaces, not as a Box[] of int64."""
    from services.cli.evaluate import _fits, describe_spec
    from services.common.protocol.spaces import Discrete, discrete_spec

    policy, act = discrete_spec(Discrete(16), Discrete(4)), Discrete(4)
    assert _fits(discrete_spec(Discrete(16), act), policy)
    assert not _fits(discrete_spec(Discrete(64), act), policy)
    assert describe_spec(policy).startswith("observations Discrete(16), actions")
