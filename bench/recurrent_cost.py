"""What a recurrent core costs (docs/recurrent.md): the actor's env steps per second and the learner's
samples per second of PPO with a feed-forward network, an LSTM and a GRU core (ppo.recurrent, 64
units; PPO's defaults otherwise), on the same machine in the same invocation, arms interleaved over
rounds; medians of the rounds and each core's ratio to feed-forward.

- actor: `Rollout.collect` (the actor's own loop: policy, env steps, fragment encoding) of
  CartPoleNoVelocity-v1, 8 envs, 64-step fragments, in this one process (one torch thread);
- learner: `PPO.update` on batches of those fragments (512 samples, 10 epochs x 4 minibatches: for
  a recurrent core, minibatches of whole sequences replayed from their recorded state).

    .venv/bin/python -m bench.recurrent_cost --rounds 5 --json docs/recurrent_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kuberl_envs  # noqa: F401 - registers CartPoleNoVelocity-v1
from services.actor.rollout import Rollout
from services.algorithms.ppo.learner import PPO
from services.common.models.nets import to_numpy
from services.common.protocol.fragments import RawFragment, decode_fragment
from services.common.stats import Metrics
from services.config import config_from_dict

ARMS = {"feed-forward": None, "lstm": "lstm", "gru": "gru"}


def config(core: str | None, env_id: str):
    return config_from_dict({"algorithm": "ppo", "env": {"id": env_id, "num_envs": 8},
                             "ppo": {"recurrent": core}, "actor": {"torch_threads": 1}})


def measure(core: str | None, env_id: str, fragments: int, updates: int) -> dict:
    cfg = config(core, env_id)
    rollout = Rollout(cfg, "bench", 0, Metrics("actor"))
    learner = PPO(cfg.section("ppo"), rollout.spec)
    rollout.policy.offer_weights(0, to_numpy(learner.net))
    start = time.perf_counter()
    try:
        msgs = [rollout.collect() for _ in range(fragments)]
    finally:
        rollout.close()
    actor_s = time.perf_counter() - start
    start_extras = ("core_state",) if core else ()
    frags = [decode_fragment(RawFragment(m.payload), extras=("behaviour_logprob",), start_extras=start_extras)
             for m in msgs]
    per_batch = max(1, cfg.section("ppo").batch_steps // frags[0].num_samples)
    start = time.perf_counter()
    trained = 0
    for i in range(updates):
        batch = [frags[(i * per_batch + k) % len(frags)] for k in range(per_batch)]
        learner.update(batch)
        trained += sum(f.num_samples for f in batch)
    learner_s = time.perf_counter() - start
    return {"actor_env_steps_per_s": sum(m.samples for m in msgs) / actor_s, "learner_samples_per_s": trained / learner_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fragments", type=int, default=40, help="fragments the actor cuts per arm and round")
    p.add_argument("--updates", type=int, default=8, help="learner updates per arm and round")
    p.add_argument("--env", default="kuberl_envs:CartPoleNoVelocity-v1")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm, core in ARMS.items():
            rounds[arm].append(measure(core, args.env, args.fragments, args.updates))
            print(f"round {r} {arm:>12}: " + ", ".join(f"{k} {v:,.0f}" for k, v in rounds[arm][-1].items()), flush=True)
    result: dict = {"env": args.env, "rounds": args.rounds, "fragments": args.fragments, "updates": args.updates,
                    "torch": torch.__version__, "arms": {}}
    base = {k: statistics.median(x[k] for x in rounds["feed-forward"]) for k in rounds["feed-forward"][0]}
    for arm in ARMS:
        med = {k: statistics.median(x[k] for x in rounds[arm]) for k in rounds[arm][0]}
        result["arms"][arm] = {"median": med, "ratio_to_feed_forward": {k: med[k] / base[k] for k in med},
                               "rounds": rounds[arm]}
        print(f"{arm:>12}: " + ", ".join(f"{k} {med[k]:,.0f} ({med[k] / base[k]:.2f}x)" for k in med))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
