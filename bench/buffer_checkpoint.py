"""What a buffer checkpoint (services/buffer/checkpoint.py) costs: seconds and bytes to save and to
restore a full DQN replay ring, and how long the buffer's event loop stalls while one is taken.

    .venv/bin/python -m bench.buffer_checkpoint [--repeats 3] [--dir /tmp/x] [--json docs/buffer_checkpoint.json]

Two rings, filled to capacity through `Store.insert` with fragments as actors send them (4 actors):
  cartpole: 100,000 transitions, obs float32[4]          (fragments of 16 steps x 4 envs, cartpole_dqn.yaml)
  atari:     10,000 transitions, obs uint8[4, 84, 84]     (fragments of 16 steps x 8 envs, pong_dqn.yaml)
For each, median of `--repeats`:
  copy_s     the rows copied in a thread (the event loop goes on);
  pause_s    the event loop held to patch the rows inserted meanwhile and read the rest (no inserts);
  write_s    npz written to a temp file, fsync'd, renamed, directory fsync'd (in a thread);
  save_s     snapshot (copy, pause, thread hand-offs) + write: what `BufferCheckpointer.save` takes;
  restore_s  read, CRC-checked, validated and applied into a new Store (the file is in the page cache,
             as after a process restart on the same node; a cold read adds size / disk bandwidth);
  bytes      the checkpoint file.
Then one save while the loop inserts fragments (cartpole: one every 10 ms, atari: every 50 ms, or
`--insert-interval-ms`) and a 1 ms ticker measures the loop's worst stall (`stall_ms`, next to
`stall_idle_ms`: the same load for as long, without a save).

Timings on a shared 2-core machine move by 10-20%; bytes are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kuberl.v1 import common_pb2 as pb
from services.buffer import checkpoint
from services.buffer.checkpoint import BufferCheckpointer
from services.buffer.store import Outcome, Store
from services.config import config_from_dict
from services.common.protocol.fragments import build_fragment
from services.common.stats import Metrics

ROOT = Path(__file__).resolve().parents[1]
ACTORS = 4
CASES = {
    # insert_interval_ms: one fragment per this long during the stall measurement (6,400 and 2,560
    # transitions/s: a fast CartPole actor fleet; Pong actors at ~2,500 env steps/s in all).
    "cartpole": {"env": {"id": "CartPole-v1", "num_envs": 4}, "transitions": 100_000, "T": 16,
                 "obs_shape": (4,), "obs_dtype": np.float32, "insert_interval_ms": 10.0},
    "atari": {"env": {"id": "ALE/Pong-v5", "num_envs": 8}, "transitions": 10_000, "T": 16,
              "obs_shape": (4, 84, 84), "obs_dtype": np.uint8, "insert_interval_ms": 50.0},
}


def make_config(case: dict):
    return config_from_dict({"algorithm": "dqn", "env": case["env"],
                             "dqn": {"buffer_size": case["transitions"], "rollout_steps": case["T"],
                                     "batch_size": 32, "learning_starts": 1000}})


def fragment_maker(case: dict, seed: int = 0):
    """fragment(seq, actor) -> a TrajectoryFragment with random observations (a few distinct bodies,
    reused: what the ring stores does not depend on them, and building 3.8 MB Atari ones is slow)."""
    rng = np.random.default_rng(seed)
    T, N, shape, dtype = case["T"], case["env"]["num_envs"], case["obs_shape"], case["obs_dtype"]
    bodies = []
    for _ in range(4):
        obs = (rng.integers(0, 256, (T + 1, N, *shape), dtype=np.uint8) if dtype == np.uint8
               else rng.standard_normal((T + 1, N, *shape)).astype(dtype))
        term = rng.random((T, N)) < 0.02
        bodies.append(dict(obs=obs, actions=rng.integers(0, 2, (T, N)).astype(np.int64),
                           rewards=np.ones((T, N), np.float32), terminated=term, truncated=np.zeros((T, N), bool),
                           final_index=np.flatnonzero(term.reshape(-1)).astype(np.int64),
                           final_obs=np.zeros((int(term.sum()), *shape), dtype)))

    def fragment(seq: int, actor: int) -> pb.TrajectoryFragment:
        return build_fragment(actor_id=f"actor-{actor}", seq=seq, policy_version=seq, algorithm=pb.ALGORITHM_DQN,
                              env_ids=range(N), incarnation=1000 + actor, **bodies[seq % len(bodies)])
    return fragment


def filled_store(cfg, case: dict, fragment) -> tuple[Store, int]:
    """A store whose ring is full; returns it and the next seq to send."""
    store = Store(cfg, Metrics("buffer"))
    seq = 0
    while store.size < case["transitions"]:
        for actor in range(ACTORS):
            assert store.insert(fragment(seq, actor)) is Outcome.ACCEPTED
        seq += 1
    return store, seq


async def measure_once(store: Store, cfg, directory: Path) -> dict:
    real_copy, copy_s = checkpoint._copy_rows, []

    def timed_copy(live, rows):
        started = time.perf_counter()
        out = real_copy(live, rows)
        copy_s.append(time.perf_counter() - started)
        return out

    checkpoint._copy_rows = timed_copy
    try:
        started = time.perf_counter()
        snap = await checkpoint.take_snapshot(store, cfg)
        snapshot_s = time.perf_counter() - started
    finally:
        checkpoint._copy_rows = real_copy
    pause_s = snap.pause_s
    started = time.perf_counter()
    path = await asyncio.to_thread(checkpoint._write_and_release, directory, snap, 1)
    write_s = time.perf_counter() - started
    again = Store(cfg, Metrics("buffer"))
    started = time.perf_counter()
    assert await BufferCheckpointer(again, cfg, directory, again.metrics).restore()
    restore_s = time.perf_counter() - started
    assert again.size == store.size
    return {"copy_s": copy_s[0], "pause_s": pause_s, "write_s": write_s,
            "save_s": snapshot_s + write_s, "restore_s": restore_s, "bytes": path.stat().st_size}


async def stall_under_inserts(store: Store, cfg, directory: Path, fragment, seq: int, interval_s: float,
                              with_save: bool) -> tuple[float, float, int]:
    """Insert a fragment every `interval_s` and tick every 1 ms; with `with_save`, save meanwhile (else
    for as long as a save took before). Returns (worst stall in ms, the patch pause in s, fragments)."""
    stop, worst, inserted = asyncio.Event(), [0.0], [0]

    async def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst[0] = max(worst[0], now - last - 0.001)
            last = now

    async def inserter():
        nonlocal seq
        while not stop.is_set():
            for actor in range(ACTORS):
                store.insert(fragment(seq, actor))
                inserted[0] += 1
            seq += 1
            await asyncio.sleep(interval_s * ACTORS)

    tasks = [asyncio.ensure_future(ticker()), asyncio.ensure_future(inserter())]
    await asyncio.sleep(0.2)
    worst[0] = 0.0
    pause = 0.0
    if with_save:
        ck = BufferCheckpointer(store, cfg, directory, store.metrics)
        await ck.save()
        pause = store.metrics.gauges["buffer/checkpoint_pause_seconds"]
    else:
        await asyncio.sleep(float(store.metrics.gauges.get("buffer/checkpoint_seconds", 1.0)))
    stop.set()
    await asyncio.gather(*tasks)
    return worst[0] * 1e3, pause, inserted[0]


async def run_case(name: str, case: dict, repeats: int, directory: Path, insert_interval_s: float) -> dict:
    cfg = make_config(case)
    fragment = fragment_maker(case)
    store, seq = filled_store(cfg, case, fragment)
    ring_bytes = sum(a.nbytes for a in store.replay.data.values())
    runs = [await measure_once(store, cfg, directory) for _ in range(repeats)]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["bytes"] = int(out["bytes"])
    stall, pause, inserted = await stall_under_inserts(store, cfg, directory, fragment, seq, insert_interval_s, True)
    idle, _, _ = await stall_under_inserts(store, cfg, directory, fragment, seq + 10_000, insert_interval_s, False)
    obs = f"{np.dtype(case['obs_dtype']).name}{list(case['obs_shape'])}"
    return {"case": name, "transitions": store.size, "obs": obs, "ring_bytes": ring_bytes,
            "bytes_per_transition": out["bytes"] / store.size, **out, "repeats": runs,
            "insert_interval_ms": insert_interval_s * 1e3, "fragments_inserted_during_save": inserted,
            "pause_under_inserts_s": pause, "stall_ms": stall, "stall_idle_ms": idle}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir under /tmp)")
    p.add_argument("--insert-interval-ms", type=float, default=None,
                   help="during the stall measurement, one fragment per this many ms (default: per case)")
    p.add_argument("--json", default=str(ROOT / "docs" / "buffer_checkpoint.json"), help="write the results here")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name in args.cases.split(","):
            interval_ms = args.insert_interval_ms or CASES[name]["insert_interval_ms"]
            result = asyncio.run(run_case(name, CASES[name], args.repeats, Path(tmp) / name, interval_ms / 1e3))
            results.append(result)
            print(f"{name}: done", file=sys.stderr)
    head = (f"{'case':9} {'transitions':>11} {'obs':>20} {'MB':>8} {'copy s':>7} {'pause ms':>8} {'write s':>7} "
            f"{'save s':>7} {'restore s':>9} {'stall ms':>8} {'(idle)':>7}")
    print(head)
    for r in results:
        print(f"{r['case']:9} {r['transitions']:>11,} {r['obs']:>20} {r['bytes'] / 1e6:>8.1f} {r['copy_s']:>7.3f} "
              f"{r['pause_s'] * 1e3:>8.2f} {r['write_s']:>7.3f} {r['save_s']:>7.3f} {r['restore_s']:>9.3f} "
              f"{r['stall_ms']:>8.1f} {r['stall_idle_ms']:>7.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
