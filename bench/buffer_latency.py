"""Latency of a buffer process's pushes and batches while both go on at once (docs/benchmarks.md,
"Buffer event loop").

    .venv/bin/python -m bench.buffer_latency [--seconds 5] [--pushers 4] [--learners 2] [--json PATH]
    .venv/bin/python -m bench.buffer_latency --cases dqn-atari --store-thread off,on --pushers 1,2,4,8 \
        --client-procs 8 --repeats 2      # one shard's ingest, the Store on the loop and on its thread

One `python -m services.buffer` per case (the same process starter as the tests), loaded by client
processes on loopback:
- pushers (`--pushers`, one asyncio process): each sends one fragment per PushTrajectories call
  (raw bytes, as the actor's Pusher writes them), waits for its PushAck, and sends the next: a
  closed loop. Push latency is the call's write-to-ack time as the client sees it (the fragment is
  serialized beforehand: only the buffer's read, insert and ack are in it).
- learners (`--learners`, another process):
  ppo-cartpole: a PPO buffer (CartPole: 4 float32 obs, fragments of 128 steps x 8 envs, batches of
    `--ppo-batch-fragments` fragments), each learner holds one StreamBatches stream open and
    reports its progress after every batch, as the learner does. Batch latency is the gap between
    consecutive batches on a stream (the FIFO serves only what was pushed, so this also moves with
    the push rate: compare it with the fragments per second).
  dqn-atari: a DQN buffer (Pong's frames: uint8 [4, 84, 84] stacks that shift, so the compact
    replay compares every new stack with the one before; fragments of 16 steps x `--atari-envs`,
    POOL of them cut before the run and cycled,
    replay unpaced, batches of 32), each learner asks for one batch at a time (StreamBatches with
    max_batches 1). Batch latency is request to batch received.

Phases per case, each `--seconds` long after a half-second warm-up whose samples are dropped:
pushers alone, learners alone (dqn-atari only: the PPO FIFO holds nothing without pushers), then
both together (`mixed`). The alone phases are the baseline measured in the same run; the ratios
mixed / alone say how much each side waits on the other's work in the buffer process. Also reported:
fragments and batches per second and the buffer process's CPU seconds per second.

`--store-thread off,on` runs every case with `buffer.store_thread` false and true (services/buffer/owner.py),
interleaved `--repeats` times; `--pushers 1,2,4,8` runs the push phase once per count (the other
phases at the largest), spread over `--client-procs` client processes so that the clients are not
the limit where cores allow. Ingest is reported as fragments/s, MB/s of fragment payload and the
buffer's CPU seconds per GB received.

Prints a table and writes `--json` (default: none). Timings on a shared 2-core machine move by
10-20% from run to run: compare runs made back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.transport import BufferProcess, process_cpu_s

ROOT = Path(__file__).resolve().parents[1]
WARMUP_S = 0.5
STACK, SCREEN = 4, 84
PPO_T, PPO_N = 128, 8
ATARI_T = 16
POOL = 8  # Atari fragments cut per pusher before the run


def case_config(case: str, args, store_thread: str = "off") -> dict:
    if case == "ppo-cartpole":
        return {"algorithm": "ppo", "env": {"id": "CartPole-v1", "num_envs": PPO_N},
                "ppo": {"rollout_steps": PPO_T, "batch_steps": PPO_T * args.ppo_batch_fragments},
                "buffer": {"fifo_capacity_steps": 64 * PPO_T, "store_thread": store_thread == "on"}}
    return {"algorithm": "dqn", "env": {"id": "ALE/Pong-v5", "num_envs": args.atari_envs},
            "dqn": {"buffer_size": 20_000, "rollout_steps": ATARI_T, "batch_size": 32, "learning_starts": 1000,
                    "replay_ratio": 0.0},
            "buffer": {"max_message_mb": 64, "store_thread": store_thread == "on"}}


class Fragments:
    """Serialized fragments of one actor of `case`, cut as an actor's rollout thread would."""

    def __init__(self, case: str, actor_id: str, atari_envs: int, seed: int):
        self.case, self.actor_id, self.seq = case, actor_id, 0
        self.rng = np.random.default_rng(seed)
        if case == "ppo-cartpole":
            self.obs = self.rng.standard_normal((PPO_T + 1, PPO_N, 4)).astype(np.float32)
        else:  # a pool of consecutive fragments, cycled: cutting frames is the actor's cost, not the buffer's
            self.n = atari_envs
            stacks = self.rng.integers(0, 256, (self.n, STACK, SCREEN, SCREEN), dtype=np.uint8)
            self.pool = []
            for k in range(POOL):
                obs = np.empty((ATARI_T + 1, self.n, STACK, SCREEN, SCREEN), np.uint8)
                obs[0] = stacks
                for t in range(ATARI_T):  # each step shifts in one new frame per env (they only need to differ)
                    frame = np.full((self.n, 1, SCREEN, SCREEN), (k * ATARI_T + t) % 251, np.uint8)
                    stacks = np.concatenate([stacks[:, 1:], frame], axis=1)
                    obs[t + 1] = stacks
                self.pool.append(obs)

    def next(self) -> bytes:
        from kuberl.v1 import common_pb2 as pb
        from services.common.protocol.fragments import encode_fragment

        seq, self.seq = self.seq, self.seq + 1
        if self.case == "ppo-cartpole":
            T, N = PPO_T, PPO_N
            return encode_fragment(
                actor_id=self.actor_id, seq=seq, policy_version=0, algorithm=pb.ALGORITHM_PPO, env_ids=range(N),
                obs=self.obs, actions=np.zeros((T, N), np.int64), rewards=np.ones((T, N), np.float32),
                terminated=np.zeros((T, N), bool), truncated=np.zeros((T, N), bool),
                final_obs=np.empty((0, 4), np.float32), final_index=np.empty(0, np.int64),
                extras={"behaviour_logprob": np.full((T, N), -0.7, np.float32)}).payload
        T, N = ATARI_T, self.n
        return encode_fragment(
            actor_id=self.actor_id, seq=seq, policy_version=seq, algorithm=pb.ALGORITHM_DQN, env_ids=range(N),
            obs=self.pool[seq % POOL], actions=self.rng.integers(0, 6, (T, N)), rewards=np.zeros((T, N), np.float32),
            terminated=np.zeros((T, N), bool), truncated=np.zeros((T, N), bool),
            final_obs=np.empty((0, STACK, SCREEN, SCREEN), np.uint8), final_index=np.empty(0, np.int64)).payload


# --- client processes -------------------------------------------------------------------------------

def _pushers(address: str, case: str, ids: list[int], tag: str, seconds: float, atari_envs: int, result_q) -> None:
    """Closed-loop pushers numbered `ids`; puts (push latencies in s after the warm-up, fragments acked then)."""
    import grpc
    import uvloop

    from kuberl.v1 import buffer_pb2

    async def main():
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            push = ch.stream_unary("/kuberl.v1.Buffer/PushTrajectories", request_serializer=None,
                                   response_deserializer=buffer_pb2.PushAck.FromString)
            latencies: list[float] = []
            counted = time.perf_counter() + WARMUP_S
            ends = counted + seconds

            async def pusher(i: int):
                frags = Fragments(case, f"bench-{tag}-{i}", atari_envs, seed=i)
                while time.perf_counter() < ends:
                    data = frags.next()
                    started = time.perf_counter()
                    call = push(timeout=60)
                    await call.write(data)
                    await call.done_writing()
                    ack = await call
                    done = time.perf_counter()
                    assert ack.accepted == 1, ack
                    if started >= counted and done <= ends:
                        latencies.append(done - started)

            await asyncio.gather(*(pusher(i) for i in ids))
            return latencies

    latencies = uvloop.run(main())
    result_q.put(("push", latencies))


def _learners(address: str, case: str, count: int, tag: str, seconds: float, ppo_batch: int, result_q) -> None:
    """`count` learners; puts (batch latencies in s after the warm-up: see the module docstring)."""
    import grpc
    import uvloop

    from kuberl.v1 import buffer_pb2, buffer_pb2_grpc
    from kuberl.v1 import common_pb2 as pb

    async def main():
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
            stub = buffer_pb2_grpc.BufferStub(ch)
            latencies: list[float] = []
            counted = time.perf_counter() + WARMUP_S
            ends = counted + seconds

            async def streaming(i: int):  # ppo: one stream, batches as they come; progress after each
                lid, consumed = f"bench-{tag}-{i}", 0
                while time.perf_counter() < ends:
                    stream = stub.StreamBatches(buffer_pb2.BatchRequest(
                        learner_id=lid, algorithm=pb.ALGORITHM_PPO, batch_size=ppo_batch))
                    last = time.perf_counter()
                    try:
                        async with asyncio.timeout(max(0.1, ends - last)):
                            async for _ in stream:
                                now = time.perf_counter()
                                if last >= counted:
                                    latencies.append(now - last)
                                last = now
                                consumed += 1
                                await stub.ReportProgress(buffer_pb2.LearnerProgress(
                                    learner_id=lid, policy_version=consumed, batches_consumed_total=consumed))
                    except TimeoutError:
                        stream.cancel()

            async def requesting(i: int):  # dqn: one batch per request
                lid = f"bench-{tag}-{i}"
                while time.perf_counter() < ends:
                    started = time.perf_counter()
                    got = [b async for b in stub.StreamBatches(buffer_pb2.BatchRequest(
                        learner_id=lid, algorithm=pb.ALGORITHM_DQN, batch_size=32, max_batches=1), timeout=60)]
                    done = time.perf_counter()
                    assert len(got) == 1
                    if started >= counted and done <= ends:
                        latencies.append(done - started)

            await asyncio.gather(*((streaming if case == "ppo-cartpole" else requesting)(i) for i in range(count)))
            return latencies

    latencies = uvloop.run(main())
    result_q.put(("batch", latencies))


# --- phases ---------------------------------------------------------------------------------------------

def percentiles(latencies: list[float]) -> dict:
    if not latencies:
        return {"n": 0}
    arr = np.asarray(latencies) * 1e3
    p50, p99 = np.percentile(arr, [50, 99])
    return {"n": len(arr), "p50_ms": float(p50), "p99_ms": float(p99), "max_ms": float(arr.max())}


def run_phase(buffer: BufferProcess, case: str, phase: str, args, pushers: int, setting: str) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    tag = f"{phase}-{time.monotonic_ns()}"
    if phase in ("push", "mixed"):
        for k in range(min(pushers, args.client_procs)):
            procs.append(ctx.Process(target=_pushers, args=(buffer.address, case, list(range(k, pushers, args.client_procs)),
                                                            tag, args.seconds, args.atari_envs, q)))
    if phase in ("batch", "mixed"):
        procs.append(ctx.Process(target=_learners, args=(
            buffer.address, case, args.learners, tag, args.seconds,
            PPO_T * PPO_N * args.ppo_batch_fragments, q)))
    before = buffer.stats()
    for p in procs:
        p.start()
    time.sleep(WARMUP_S + 1.0)  # the clients' imports and channels: take the CPU counts once they run
    cpu0, t0 = process_cpu_s(buffer.pid), time.perf_counter()
    results: dict[str, list[float]] = {}
    for _ in procs:
        side, latencies = q.get(timeout=args.seconds + 120)
        results.setdefault(side, []).extend(latencies)
    cpu1, t1 = process_cpu_s(buffer.pid), time.perf_counter()
    for p in procs:
        p.join()
    after = buffer.stats()
    out = {"case": case, "phase": phase, "store_thread": setting, "pushers": pushers if "push" in results else 0,
           "buffer_cpu_per_s": (cpu1 - cpu0) / (t1 - t0) if cpu0 is not None else None}
    if "push" in results:
        out["push"] = percentiles(results["push"])
        out["fragments_per_s"] = len(results["push"]) / args.seconds
        out["mb_per_s"] = out["fragments_per_s"] * fragment_bytes(case, args) / 1e6
        if out["buffer_cpu_per_s"] is not None and out["mb_per_s"]:
            out["cpu_s_per_gb"] = out["buffer_cpu_per_s"] / (out["mb_per_s"] / 1e3)
    if "batch" in results:
        out["batch"] = percentiles(results["batch"])
        out["batches_per_s"] = len(results["batch"]) / args.seconds
    out["batches_unsent"] = after["buffer/batches_unsent_total"] - before["buffer/batches_unsent_total"]
    return out


def fragment_bytes(case: str, args) -> int:
    return len(Fragments(case, "bench-size", args.atari_envs, seed=0).next())


def run_case(case: str, args, tmp: Path, store_thread: str = "off") -> list[dict]:
    buffer = BufferProcess(tmp, case_config(case, args, store_thread))
    counts = [int(n) for n in str(args.pushers).split(",")]
    try:
        phases = [p for p in args.phases.split(",") if case == "dqn-atari" or p != "batch"]
        results = []
        for phase in phases:
            for n in (counts if phase == "push" else [max(counts)]):
                results.append(run_phase(buffer, case, phase, args, n, store_thread))
    finally:
        buffer.stop()
    alone = {r["phase"]: r for r in results}
    if (mixed := alone.get("mixed")) is None:
        return results
    alone["push"] = next((r for r in results if r["phase"] == "push" and r["pushers"] == max(counts)), {})
    for side in ("push", "batch"):
        base = alone.get(side, {}).get(side)
        if base and base.get("n") and mixed[side].get("n"):
            mixed[f"{side}_p50_ratio"] = mixed[side]["p50_ms"] / base["p50_ms"]
            mixed[f"{side}_p99_ratio"] = mixed[side]["p99_ms"] / base["p99_ms"]
    return results


def write_json(args, results: list[dict]) -> None:
    import os
    Path(args.json).write_text(json.dumps({"label": args.label, "args": vars(args), "cpus": os.cpu_count(),
                                           "results": results}, indent=1) + "\n")


def fmt(r: dict, side: str) -> str:
    s = r.get(side)
    if not s or not s.get("n"):
        return f"{'-':>8} {'-':>8}"
    return f"{s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="ppo-cartpole,dqn-atari")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per phase")
    p.add_argument("--phases", default="push,batch,mixed",
                   help="of push,batch,mixed (batch: dqn-atari only; it needs the push phase's samples)")
    p.add_argument("--pushers", default="4", help="closed-loop pushers; a list (1,2,4,8) runs the push phase per count")
    p.add_argument("--client-procs", type=int, default=1, help="client processes the pushers are spread over")
    p.add_argument("--store-thread", default="off", help="buffer.store_thread settings to compare: off,on")
    p.add_argument("--repeats", type=int, default=1, help="runs of every setting, interleaved")
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--ppo-batch-fragments", type=int, default=4, help="PPO batch size, in fragments")
    p.add_argument("--atari-envs", type=int, default=4, help="envs per Atari fragment (16 steps each)")
    p.add_argument("--label", default="", help="stored in the JSON (e.g. before / after)")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="kuberl-bench-") as tmp:
        for repeat in range(args.repeats):
            settings = args.store_thread.split(",")
            for setting in settings if repeat % 2 == 0 else settings[::-1]:   # (order alternates)
                for case in args.cases.split(","):
                    for r in run_case(case, args, Path(tmp), setting):
                        results.append({**r, "repeat": repeat})
                    print(f"{case}, store_thread {setting}, repeat {repeat}: done", file=sys.stderr)
                    if args.json:   # after every case: a run cut short keeps what it measured
                        write_json(args, results)
    print(f"{'case':13} {'thread':6} {'phase':6} {'n':>2} {'push p50':>8} {'p99 ms':>8} {'batch p50':>9} "
          f"{'p99 ms':>8} {'frag/s':>7} {'MB/s':>6} {'batch/s':>7} {'cpu/s':>5} {'cpu s/GB':>8}  mixed/alone p50, p99")
    for r in results:
        ratios = ", ".join(f"{side} {r[f'{side}_p50_ratio']:.2f}x {r[f'{side}_p99_ratio']:.2f}x"
                           for side in ("push", "batch") if f"{side}_p50_ratio" in r)
        print(f"{r['case']:13} {r['store_thread']:6} {r['phase']:6} {r['pushers']:>2} {fmt(r, 'push')} "
              f"{fmt(r, 'batch'):>18} {r.get('fragments_per_s', 0):>7.1f} {r.get('mb_per_s', 0):>6.0f} "
              f"{r.get('batches_per_s', 0):>7.1f} {r['buffer_cpu_per_s'] or 0:>5.2f} "
              f"{r.get('cpu_s_per_gb', 0):>8.2f}  {ratios}")
    if args.json:
        write_json(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
