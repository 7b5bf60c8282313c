"""Bytes per transition of the DQN replay for Pong's layout, before (ReplayRing: obs and next_obs of
every transition) and after (CompactReplay: each frame once; docs/architecture.md section 2,
"Replay storage"), and what 1M transitions take.

    .venv/bin/python -m bench.replay_memory [--transitions 20000] [--json docs/replay_memory.json]

Each layout gets a Store of `--transitions` (configs/pong_dqn.yaml's env and fragments: uint8
[4, 84, 84] stacks, 16 steps x 8 envs, `buffer.compact_replay` never / auto), filled through
`Store.insert` to capacity and then once more round by 4 actors whose envs each play a stream of
random frames (random: no frame equals another by chance) with episodes of about 900 steps (a Pong
game at frameskip 4 lasts 800 to 4,000). Measured per layout:
  allocated_bytes  the storage arrays the ring allocated (np.empty: pages are taken when written);
  rss_bytes        what the process's resident set grew by while the ring filled (the pages written);
  bytes_per_transition  allocated_bytes / capacity, and times 1M (`gb_at_1m`);
  allocated_at_1m  the same storage for a ring of 1M (CompactReplay's frame ring is sized from the
                   capacity: frame_ring_size), computed, not allocated;
  frames_per_transition, evicted_early  (compact) frames written per transition, transitions that
                   left before `capacity` newer ones pushed them out;
  insert_ms, sample_ms  per fragment of 128 transitions and per batch of 32 (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kuberl.v1 import common_pb2 as pb
from services.buffer.compact import CompactReplay, frame_ring_size
from services.buffer.store import Outcome, Store
from services.config import config_from_dict
from services.common.protocol.fragments import build_fragment
from services.common.stats import Metrics

ROOT = Path(__file__).resolve().parents[1]
ACTORS, T, N, STACK, SCREEN = 4, 16, 8, 4, 84
EPISODE_STEPS = 900


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Actor:
    """N envs playing streams of random frames, stacked as configs/pong_dqn.yaml's observations."""

    def __init__(self, index: int, seed: int):
        self.index, self.seq, self.rng = index, 0, np.random.default_rng(seed)
        self.stacks = self.rng.integers(0, 256, (N, STACK, SCREEN, SCREEN), dtype=np.uint8)

    def fragment(self) -> pb.TrajectoryFragment:
        obs = np.empty((T + 1, N, STACK, SCREEN, SCREEN), np.uint8)
        obs[0] = self.stacks
        ended = self.rng.random((T, N)) < 1 / EPISODE_STEPS
        finals = []
        for t in range(T):
            frames = self.rng.integers(0, 256, (N, 1, SCREEN, SCREEN), dtype=np.uint8)
            self.stacks = np.concatenate([self.stacks[:, 1:], frames], axis=1)
            for n in np.flatnonzero(ended[t]):  # the episode ends: its last stack, then a new game's
                finals.append(self.stacks[n].copy())
                self.stacks[n] = self.rng.integers(0, 256, (STACK, SCREEN, SCREEN), dtype=np.uint8)
            obs[t + 1] = self.stacks
        msg = build_fragment(actor_id=f"actor-{self.index}", seq=self.seq, policy_version=self.seq,
                             algorithm=pb.ALGORITHM_DQN, env_ids=range(N), incarnation=1 + self.index, obs=obs,
                             actions=self.rng.integers(0, 6, (T, N)), rewards=np.zeros((T, N), np.float32),
                             terminated=ended, truncated=np.zeros((T, N), bool),
                             final_obs=np.array(finals, np.uint8).reshape(-1, STACK, SCREEN, SCREEN),
                             final_index=np.flatnonzero(ended.reshape(-1)).astype(np.int64))
        self.seq += 1
        return msg


def measure(layout: str, transitions: int) -> dict:
    cfg = config_from_dict({"algorithm": "dqn", "env": {"id": "ALE/Pong-v5", "num_envs": N},
                            "dqn": {"buffer_size": transitions, "rollout_steps": T, "batch_size": 32,
                                    "learning_starts": 1000},
                            "buffer": {"compact_replay": layout}})
    store = Store(cfg, Metrics("buffer"))
    actors = [Actor(a, seed=a) for a in range(ACTORS)]
    before, insert_s, inserted = rss_bytes(), [], 0
    while inserted < 2 * transitions:  # full, and once more round
        for actor in actors:
            msg = actor.fragment()
            started = time.perf_counter()
            assert store.insert(msg) is Outcome.ACCEPTED
            insert_s.append(time.perf_counter() - started)
            inserted += T * N
    grown = rss_bytes() - before
    sample_s = []
    for _ in range(200):
        started = time.perf_counter()
        store.replay.sample(32)
        sample_s.append(time.perf_counter() - started)
    ring = store.replay
    allocated = ring.nbytes()
    row_bytes = (allocated - (ring.data["frames"].nbytes if "frames" in ring.data else 0)) / ring.capacity
    if isinstance(ring, CompactReplay):
        at_1m = frame_ring_size(1_000_000, STACK)[0] * ring.data["frames"][0].nbytes + 1_000_000 * row_bytes
        extra = {"frames_held": ring.num_frames, "frames_per_transition": ring.frames_written / inserted,
                 "evicted_early": ring.evicted_early}
    else:
        at_1m, extra = 1_000_000 * row_bytes, {}
    return {"layout": type(ring).__name__, "compact_replay": layout, "transitions": ring.size,
            "inserted": inserted, "allocated_bytes": allocated, "rss_bytes": grown,
            "bytes_per_transition": allocated / ring.capacity, "gb_at_1m": allocated / ring.capacity * 1e6 / 1e9,
            "allocated_at_1m_gb": at_1m / 1e9, **extra,
            "insert_ms": statistics.median(insert_s) * 1e3, "sample_ms": statistics.median(sample_s) * 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transitions", type=int, default=20_000, help="capacity of each ring measured")
    p.add_argument("--json", default=str(ROOT / "docs" / "replay_memory.json"), help="write the results here")
    args = p.parse_args(argv)
    results = []
    for layout in ("never", "auto"):
        results.append(measure(layout, args.transitions))
        print(f"{layout}: done", file=sys.stderr)
    print(f"{'layout':14} {'B/transition':>12} {'RSS B/tr.':>10} {'1M (GB)':>8} {'alloc. 1M':>9} "
          f"{'insert ms':>9} {'sample ms':>9}")
    for r in results:
        print(f"{r['layout']:14} {r['bytes_per_transition']:>12,.0f} {r['rss_bytes'] / r['transitions']:>10,.0f} "
              f"{r['gb_at_1m']:>8.2f} {r['allocated_at_1m_gb']:>9.2f} {r['insert_ms']:>9.2f} {r['sample_ms']:>9.3f}")
    before, after = results
    print(f"compact / plain: {after['bytes_per_transition'] / before['bytes_per_transition']:.3f}; frames per "
          f"transition {after.get('frames_per_transition', 0):.4f}, evicted early {after.get('evicted_early', 0)}")
    Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
