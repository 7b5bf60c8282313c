"""External simulators over Actor.EnvSession: per-step round trip and env steps/s with 1, 16 and 64
concurrent sessions, against the same CartPole env stepped in-process with the same policy inference,
measured in the same run.

    .venv/bin/python -m bench.env_session [--sessions 1 16 64] [--seconds 10] [--warmup 2]

EnvSession: buffer, learner and an actor (env.mode external) run as subprocesses on 127.0.0.1; this
process runs one thread per session, each stepping its own CartPole-v1 (gymnasium, num_envs=1) with
a kuberl_client.EnvSessionClient. The round trip is the time of one `client.step` (send the step,
the actor's batched inference, receive the actions). Measured twice: with the learner idle (its
batches never fill, so only the session path is measured) and with it training PPO on the data.

In-process baseline: N copies of the same env in one gymnasium SyncVectorEnv, one forward pass of the
same network (ActorCritic(env_spec("CartPole-v1"), (64, 64)), action sampled as the actor
does) per vector step, torch on one thread like the actor. Its "round trip" is that forward pass:
what the EnvSession round trip replaces. Throughput is env steps (all copies) per second of wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from tests.helpers import Service  # the same process starter the integration tests use

HIDDEN = (64, 64)


def _config(train: bool) -> dict:
    return {
        "algorithm": "ppo",
        "env": {"id": "CartPole-v1", "mode": "external"},
        # learner idle: no batch is ever complete (the FIFO evicts first), so it never trains.
        "ppo": {"rollout_steps": 64, "batch_steps": 512 if train else 1_000_000, "num_epochs": 4,
                "num_minibatches": 4, "hidden_sizes": list(HIDDEN)},
        "actor": {"queue_fragments": 4096, "max_sessions": 256},
        "learner": {"checkpoint_interval_s": 3600},
    }


class Stack:
    def __init__(self, tmp: Path, cfg: dict):
        config = tmp / "config.yaml"
        config.write_text(yaml.safe_dump(cfg))
        self.services: list[Service] = []
        quiet = ("--log-level", "WARNING")
        try:
            self.buffer = self._start(Service("buffer", tmp, config, *quiet))
            self.learner = self._start(Service("learner", tmp, config, *quiet, "--buffer", self.buffer,
                                               "--checkpoint-dir", str(tmp / "ck")))
            self.actor = self._start(Service("actor", tmp, config, *quiet, "--buffer", self.buffer,
                                             "--learner", self.learner))
        except BaseException:
            self.stop()
            raise

    def _start(self, s: Service) -> str:
        self.services.append(s)
        return s.wait_ready(timeout=120.0)

    def updates(self) -> float:
        import grpc

        from kuberl.v1 import common_pb2 as pb
        from kuberl.v1 import learner_pb2_grpc
        with grpc.insecure_channel(self.learner) as ch:
            return learner_pb2_grpc.LearnerStub(ch).GetStats(pb.GetStatsRequest(), timeout=10).metrics.get(
                "learner/updates_total", 0.0)

    def stop(self) -> None:
        for s in reversed(self.services):  # actor, learner, buffer: the order `kuberl up` uses
            s.terminate(timeout=30.0)


def _summary(rtts: list[np.ndarray], steps: int, seconds: float) -> dict:
    lat = np.concatenate(rtts) if rtts else np.empty(0)
    return {"steps_per_s": steps / seconds, "p50_ms": float(np.percentile(lat, 50)) * 1e3,
            "p99_ms": float(np.percentile(lat, 99)) * 1e3, "samples": int(lat.size)}


def in_process(n: int, seconds: float, warmup: float) -> dict:
    """N CartPoles in one SyncVectorEnv, one forward pass per vector step."""
    import gymnasium as gym
    import torch

    from services.algorithms.ppo.networks import ActorCritic
    from services.common.models.nets import env_spec

    torch.set_num_threads(1)
    net = ActorCritic(env_spec("CartPole-v1"), HIDDEN)
    net.eval()
    envs = gym.make_vec("CartPole-v1", num_envs=n, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    obs, _ = envs.reset(seed=0)
    rtts, steps = [], 0
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + seconds
    while True:
        t0 = time.perf_counter()
        if t0 >= t_end:
            break
        with torch.inference_mode():
            dist = net.dist(torch.from_numpy(obs))
            action = dist.sample()
            dist.log_prob(action)
        actions = action.numpy()
        t1 = time.perf_counter()
        obs, _, _, _, _ = envs.step(actions)
        if t0 >= t_measure:
            rtts.append(t1 - t0)
            steps += n
    envs.close()
    return _summary([np.array(rtts)], steps, seconds)


def env_session(address: str, n: int, seconds: float, warmup: float) -> dict:
    """N threads, each a CartPole-v1 (num_envs=1) driven through its own EnvSessionClient."""
    import gymnasium as gym

    from kuberl_client import EnvSessionClient

    measuring, stop = threading.Event(), threading.Event()
    ready = threading.Barrier(n + 1, timeout=120)
    rtts: list[np.ndarray] = [np.empty(0)] * n
    counts = [0] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        env = gym.make("CartPole-v1")
        mine: list[float] = []
        try:
            with EnvSessionClient(address, session_id=f"bench-{n}-{i}", obs_shape=(4,), obs_dtype="float32",
                                  num_actions=2, num_envs=1, simulator="bench", timeout_s=120) as client:
                obs, _ = env.reset(seed=i)
                action = client.reset(obs)
                ready.wait()
                while not stop.is_set():
                    obs, r, term, trunc, _ = env.step(int(action[0]))
                    final = None
                    if term or trunc:
                        final, (obs, _) = obs[None], env.reset()
                    t0 = time.perf_counter()
                    action = client.step(obs, r, term, trunc, final)
                    if measuring.is_set():
                        mine.append(time.perf_counter() - t0)
                        counts[i] += 1
        except BaseException as e:  # reported below
            errors.append(e)
            ready.abort()
        finally:
            rtts[i] = np.array(mine)
            env.close()

    threads = [threading.Thread(target=run, args=(i,), name=f"session-{i}") for i in range(n)]
    for t in threads:
        t.start()
    ready.wait()
    time.sleep(warmup)
    measuring.set()
    t0 = time.perf_counter()
    time.sleep(seconds)
    measuring.clear()
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join(150)
    if errors:
        raise RuntimeError(f"{len(errors)} sessions failed, e.g. {errors[0]!r}")
    return _summary(rtts, sum(counts), elapsed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--seconds", type=float, default=10.0, help="measured window per row")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    rows = []
    for n in args.sessions:
        rows.append({"mode": "in-process (SyncVectorEnv + forward)", "n": n,
                     **in_process(n, args.seconds, args.warmup)})
        print(f"  measured in-process x{n}", file=sys.stderr, flush=True)
    for train in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            stack = Stack(Path(tmp), _config(train))
            try:
                for n in args.sessions:
                    before = stack.updates()
                    res = env_session(stack.actor, n, args.seconds, args.warmup)
                    res["updates"] = stack.updates() - before
                    rows.append({"mode": f"EnvSession, learner {'training' if train else 'idle'}", "n": n, **res})
                    print(f"  measured EnvSession x{n} (learner {'training' if train else 'idle'})",
                          file=sys.stderr, flush=True)
            finally:
                stack.stop()

    import grpc
    print(f"\nEnvSession vs in-process, CartPole-v1, PPO MLP {HIDDEN}; {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, grpcio {grpc.__version__}; {args.seconds:g} s per row "
          f"after {args.warmup:g} s warm-up\n")
    base = {r["n"]: r for r in rows if r["mode"].startswith("in-process")}
    head = f"{'mode':<38} {'sessions':>8} {'env steps/s':>12} {'vs in-proc':>10} {'p50 ms':>8} {'p99 ms':>8}"
    print(head)
    print("-" * len(head))
    for n in args.sessions:
        for r in (r for r in rows if r["n"] == n):
            ratio = r["steps_per_s"] / base[n]["steps_per_s"]
            extra = f"  ({int(r['updates'])} learner updates)" if "updates" in r and r["updates"] else ""
            print(f"{r['mode']:<38} {n:>8} {r['steps_per_s']:>12,.0f} {ratio:>10.3f} "
                  f"{r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f}{extra}")
    print("\nround trip: EnvSession = one client.step (send, batched inference in the actor, receive);\n"
          "in-process = the forward pass it replaces. Everything shares this machine's CPUs.")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
