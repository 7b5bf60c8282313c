"""PPO for continuous and masked multi-discrete actions through the whole stack (`kuberl up`: separate
processes, gRPC between them). Assertions are on returns and env steps only, never on wall time.

- Pendulum-v1 (Box [1] in [-2, 2]), configs/pendulum_ppo.yaml: a mean return of -300 or better over the
  last 100 episodes within 400,000 env steps. Measured on the development machine (2 cores): 65,536
  steps (13.3 s), 0 samples lost; 65,392 with another seed. CleanRL's continuous PPO needs roughly
  200-500k steps there. The config paces the actor to the learner (actor.fragments_per_version: 2,
  one batch per policy version), so a busy machine's slower learner still trains on every step
  instead of the FIFO evicting them, which would spend the step budget.
- kuberl_envs:MaskedChoice-v0 (MultiDiscrete [4, 3] with masks), configs/masked_choice_ppo.yaml: a
  mean return of 15 of a possible 16 within 100,000 env steps (measured: 9,728). A uniform policy over
  the allowed actions scores about 7, and one disallowed action costs at least 5, so 15 shows the
  policy reads its observation and that masks were applied at every step (kuberl_envs/__init__.py).
"""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import ROOT, up_to_target

RUNS = {"pendulum_ppo": (-300.0, 400_000, {}),
        "masked_choice_ppo": (15.0, 100_000, {})}


@pytest.mark.learning
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_ppo_learns_every_kind_of_action(tmp_path, name):
    target, budget, actor = RUNS[name]
    cfg = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    cfg["actor"] = {**cfg.get("actor", {}), **actor}
    up_to_target(tmp_path, name, cfg, target=target, budget=budget)
