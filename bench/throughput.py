"""End-to-end throughput on Pong, each next to the same work without transport, in the same run.

    .venv/bin/python -m bench.throughput [--seconds 20] [--warmup 5] [--part actor|learner|all]

(1) Actor: env frames/s of one actor process (`python -m services.actor`, configs/pong_ppo.yaml:
    8 envs, Nature-CNN policy, fragments of 128 steps pushed to a buffer process) against a bare loop
    in this process doing the same env steps and the same inference, with nothing cut, encoded or
    sent. The learner behind the actor only serves its initial weights (its batch is never complete),
    so it takes no CPU from the actor; the buffer receives on the other core. Frames are env steps
    times the frameskip (4), the Atari convention.
(2) Learner: DQN updates/s of a learner process (`python -m services.learner`, configs/pong_dqn.yaml
    with batch 32, replay unpaced) fed over gRPC by a buffer process that a producer filled with Pong
    transitions, against the same Trainer in this process on batches cut beforehand by the same
    buffer core (a pre-filled local batch source). Both publish weights every `--publish-every`
    updates, so the comparison is the data feed alone.

Prints both rates and their ratios (goals: actor >= 0.8, learner >= 0.9) and writes
docs/throughput.json. Timings on a shared 2-core machine move by 10-20% from run to run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / name).read_text())


def _stats(address: str, stub: str) -> dict[str, float]:
    from kuberl.v1 import actor_pb2_grpc, learner_pb2_grpc
    from tests.helpers import stats

    return stats(address, {"actor": actor_pb2_grpc.ActorStub, "learner": learner_pb2_grpc.LearnerStub}[stub])


def _rate(address: str, stub: str, counter: str, warmup: float, seconds: float) -> float:
    """Increase of `counter` per second over `seconds`, after `warmup`."""
    time.sleep(warmup)
    c0, t0 = _stats(address, stub)[counter], time.perf_counter()
    time.sleep(seconds)
    c1, t1 = _stats(address, stub)[counter], time.perf_counter()
    return (c1 - c0) / (t1 - t0)


# --- (1) actor ---------------------------------------------------------------------------------------

def bare_actor_loop(cfg_dict: dict, warmup: float, seconds: float) -> float:
    """Env steps/s of the actor's env and policy in a plain loop: no fragments, no transport."""
    import torch

    from services.actor.policy import Policy
    from services.config import config_from_dict
    from services.common.envs import make_vector_env, spec_of
    from services.common.stats import Metrics

    torch.set_num_threads(1)
    cfg = config_from_dict(cfg_dict)
    envs = make_vector_env(cfg.env)
    policy = Policy(cfg, spec_of(cfg.env), cfg.env.seed, Metrics("actor"))
    obs, _ = envs.reset(seed=cfg.env.seed)
    steps, start = 0, time.perf_counter()
    t_measure, counted = start + warmup, None
    while True:
        now = time.perf_counter()
        if counted is None and now >= t_measure:
            counted, t0 = steps, now
        if counted is not None and now >= t0 + seconds:
            break
        actions, _, _ = policy.act(obs, steps)
        obs, *_ = envs.step(actions)
        steps += cfg.env.num_envs
    envs.close()
    return (steps - counted) / (now - t0)


def actor_process(cfg_dict: dict, tmp: Path, warmup: float, seconds: float) -> dict:
    """Env steps/s of `python -m services.actor` pushing to a buffer process."""
    from kuberl.v1 import buffer_pb2_grpc
    from tests.helpers import Service, stats, write_config

    cfg = copy.deepcopy(cfg_dict)
    # The learner never gets a batch: it serves its initial weights and otherwise sleeps.
    cfg["ppo"]["batch_steps"] = 1_000_000  # more than the buffer ever holds (fifo_capacity_steps)
    config = write_config(tmp / "actor-bench.yaml", cfg)
    services = []
    try:
        buffer = Service("buffer", tmp, config)
        services.append(buffer)
        buffer.wait_ready()
        learner = Service("learner", tmp, config, "--buffer", buffer.address, "--checkpoint-dir", str(tmp / "ck-ppo"))
        services.append(learner)
        learner.wait_ready(120)
        actor = Service("actor", tmp, config, "--buffer", buffer.address, "--learner", learner.address)
        services.append(actor)
        actor.wait_ready(120)
        steps_per_s = _rate(actor.address, "actor", "actor/env_steps_total", warmup, seconds)
        a, b = _stats(actor.address, "actor"), stats(buffer.address, buffer_pb2_grpc.BufferStub)
        return {"steps_per_s": steps_per_s, "fragments_pushed": a["actor/fragments_pushed_total"],
                "fragments_dropped": a["actor/fragments_dropped_total"],
                "buffer_fragments_received": b["buffer/fragments_received_total"],
                "mb_pushed_per_s": a.get("actor/bytes_pushed_per_s", 0.0) / 1e6}
    finally:
        for s in reversed(services):
            s.terminate()


def part_actor(warmup: float, seconds: float, tmp: Path) -> dict:
    cfg = load("pong_ppo.yaml")
    frameskip = cfg["env"]["atari"]["frameskip"]
    bare = bare_actor_loop(cfg, warmup, seconds)
    served = actor_process(cfg, tmp, warmup, seconds)
    row = {"bare_steps_per_s": bare, "actor_steps_per_s": served["steps_per_s"],
           "bare_frames_per_s": bare * frameskip, "actor_frames_per_s": served["steps_per_s"] * frameskip,
           "ratio": served["steps_per_s"] / bare, "actor": served}
    print(f"(1) Pong actor, {cfg['env']['num_envs']} envs, PPO Nature-CNN policy, 1 torch thread")
    print(f"    bare loop (env + inference)      {row['bare_frames_per_s']:8.0f} frames/s")
    print(f"    actor process (+ fragments, push) {row['actor_frames_per_s']:8.0f} frames/s   "
          f"ratio {row['ratio']:.2f} (goal >= 0.8); {served['mb_pushed_per_s']:.0f} MB/s pushed, "
          f"{served['fragments_dropped']:.0f} fragments dropped", flush=True)
    return row


# --- (2) learner -------------------------------------------------------------------------------------

def learner_config(publish_every: int) -> dict:
    cfg = load("pong_dqn.yaml")
    cfg["dqn"].update(buffer_size=4096, learning_starts=1024, replay_ratio=0.0)  # unpaced: as fast as it trains
    cfg["learner"].update(device="cpu", publish_interval_updates=publish_every, checkpoint_interval_s=3600)
    return cfg


def pong_fragments(cfg_dict: dict, count: int) -> list:
    """`count` serialized DQN fragments of real Pong frames from the actor's rollout (random policy)."""
    from services.actor.rollout import Rollout
    from services.config import config_from_dict
    from services.common.stats import Metrics

    cfg = config_from_dict(cfg_dict)
    rollout = Rollout(cfg, "producer", 0, Metrics("actor"))
    try:
        return [rollout.collect() for _ in range(count)]
    finally:
        rollout.close()


def local_learner(cfg_dict: dict, frags: list, warmup: float, seconds: float, tmp: Path) -> float:
    """Updates/s of the Trainer on batches cut beforehand by the buffer's Store (no transport)."""
    import torch

    from services.buffer.store import Store
    from services.config import config_from_dict
    from services.common.protocol.fragments import RawFragment
    from services.common.stats import Metrics
    from services.learner.trainer import Trainer

    torch.set_num_threads(1)
    cfg = config_from_dict(cfg_dict)
    store = Store(cfg, Metrics("buffer"))
    for f in frags:
        store.insert(RawFragment(f.payload))
    batches = [store.next_batch(cfg.section("dqn").batch_size, "local") for _ in range(64)]
    trainer = Trainer(cfg, Metrics("learner"), tmp / "ck-local")
    every = cfg.learner.publish_interval_updates
    i, start = 0, time.perf_counter()
    t_measure, counted = start + warmup, None
    while True:
        now = time.perf_counter()
        if counted is None and now >= t_measure:
            counted, t0 = trainer.version, now
        if counted is not None and now >= t0 + seconds:
            break
        trainer.train(batches[i % len(batches)])
        i += 1
        if trainer.version % every == 0:
            trainer.weights()  # what the learner process publishes at this cadence
    return (trainer.version - counted) / (now - t0)


def served_learner(cfg_dict: dict, frags: list, warmup: float, seconds: float, tmp: Path) -> dict:
    """Updates/s of `python -m services.learner` fed by a buffer process holding the same transitions."""
    import asyncio

    import grpc

    from kuberl.v1 import buffer_pb2_grpc
    from services.actor.push import Pusher
    from services.common.net.grpcutil import MiB, make_channel
    from services.common.stats import Metrics
    from tests.helpers import Service, stats, write_config

    config = write_config(tmp / "learner-bench.yaml", cfg_dict)
    services = []
    try:
        buffer = Service("buffer", tmp, config)
        services.append(buffer)
        buffer.wait_ready()

        async def fill() -> None:  # the producer: what an actor pushes, once
            channel = make_channel(buffer.address, 64 * MiB)
            pusher = Pusher(channel, len(frags), 0.5, Metrics("actor", instance_id="producer"))
            for f in frags:
                pusher.enqueue(f)
            stopping = asyncio.Event()
            stopping.set()
            await pusher.run(stopping)
            await channel.close()

        asyncio.run(fill())
        learner = Service("learner", tmp, config, "--buffer", buffer.address,
                          "--checkpoint-dir", str(tmp / "ck-dqn"))
        services.append(learner)
        learner.wait_ready(120)
        rate = _rate(learner.address, "learner", "learner/updates_total", warmup, seconds)
        b = stats(buffer.address, buffer_pb2_grpc.BufferStub)
        return {"updates_per_s": rate, "buffer_size_samples": b["buffer/size_samples"],
                "buffer_batches_served": b["buffer/batches_served_total"]}
    except grpc.RpcError as err:
        raise RuntimeError(f"buffer unreachable: {err}") from err
    finally:
        for s in reversed(services):
            s.terminate()


def part_learner(warmup: float, seconds: float, publish_every: int, tmp: Path) -> dict:
    cfg = learner_config(publish_every)
    n = -(-cfg["dqn"]["learning_starts"] * 2 // (cfg["dqn"]["rollout_steps"] * cfg["env"]["num_envs"]))
    frags = pong_fragments(cfg, n)
    local = local_learner(cfg, frags, warmup, seconds, tmp)
    served = served_learner(cfg, frags, warmup, seconds, tmp)
    row = {"local_updates_per_s": local, "served_updates_per_s": served["updates_per_s"],
           "ratio": served["updates_per_s"] / local, "served": served, "publish_every": publish_every,
           "batch_size": cfg["dqn"]["batch_size"]}
    print(f"(2) Pong DQN learner, batch {cfg['dqn']['batch_size']} (2 x 32 frame stacks of 4x84x84), "
          f"weights published every {publish_every} updates, 1 torch thread")
    print(f"    local batch source               {local:8.1f} updates/s")
    print(f"    fed through the buffer over gRPC {served['updates_per_s']:8.1f} updates/s   "
          f"ratio {row['ratio']:.2f} (goal >= 0.9)", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["actor", "learner", "all"], default="all")
    p.add_argument("--seconds", type=float, default=20.0, help="measurement window per configuration")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds run before measuring")
    p.add_argument("--publish-every", type=int, default=20, help="(2): updates between weight publications")
    p.add_argument("--out", default=str(ROOT / "docs" / "throughput.json"))
    args = p.parse_args(argv)
    result: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.part in ("actor", "all"):
            result["actor"] = part_actor(args.warmup, args.seconds, tmp)
        if args.part in ("learner", "all"):
            result["learner"] = part_learner(args.warmup, args.seconds, args.publish_every, tmp)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
