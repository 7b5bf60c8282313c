"""Learner throughput on cpu against cuda: samples trained per second by the learner's Trainer, on
the same batches, in the same process.

    .venv/bin/python -m bench.learner_device [--seconds 15] [--cpu-threads 16] [--quick] [--out PATH]

Cases (each from its config in configs/, replay unpaced, no staleness bound):
  ppo  configs/pong_ppo.yaml: Nature CNN on 4x84x84 uint8 Pong frames, a batch = one fragment of
       128 steps x 8 envs (1,024 samples), 4 epochs x 4 minibatches of 256;
  dqn  configs/pong_dqn.yaml: Nature CNN Q-network, batches of 32 transitions (frames as above);
  sac  configs/pendulum_sac.yaml: 64x64 MLP actor and twin critics on Pendulum-v1, batches of 128.
For each case one buffer Store is filled by the actor's Rollout (real env steps, the initial
policy) and batches are cut from it once, before any timing; a Trainer is then built on each
device (the same seeded initialisation) and trains on those batches in turn. Each Trainer warms up
(`--warmup-updates` and `--warmup` seconds, whichever takes longer: cuDNN's first calls, the
allocator), then trains until both `--seconds` have passed and `--min-updates` updates are done,
or `--max-seconds` have (the row then says capped). The clock is read after torch.cuda.synchronize() on cuda; Trainer.train() also reads its loss
(.item()) every update, so no update is left queued on the GPU when it returns.

Threads: the learner process calls torch.set_num_threads(learner.torch_threads) whatever its device
(services/learner/main.py; 1 by default), and so does each row here: cpu and cuda for every
algorithm first, then a cpu row per other `--cpu-threads` value (what more CPU threads would give),
so that a run cut off by a time limit keeps the learner's own comparison.

Prints samples trained per second per (algorithm, device, threads) and cuda / cpu at the learner's
thread setting, and writes them as JSON to `--out` ($OUT/learner_device.json where OUT is set, else
docs/learner_device.json). Without a CUDA device the cuda rows are reported as unavailable.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml

from services import algorithms
from services.actor.rollout import Rollout
from services.buffer.store import Store
from services.config import ExperimentConfig, config_from_dict
from services.common.protocol.fragments import RawFragment
from services.common.stats import Metrics
from services.learner.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ("ppo", "dqn", "sac")


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / name).read_text())


def case_config(algorithm: str, quick: bool) -> dict:
    """The case's config as a dict (device set per Trainer): the shipped config, with the replay
    unpaced (batches are cut beforehand) and no policy-lag bound (every batch is trained on as fresh)."""
    if algorithm == "ppo":
        cfg = load("pong_ppo.yaml")
        cfg["ppo"]["max_policy_lag"] = None
        if quick:  # a fragment of 16 x 8 steps: the same network, an eighth of the batch
            cfg["ppo"].update(rollout_steps=16, batch_steps=128)
    elif algorithm == "dqn":
        cfg = load("pong_dqn.yaml")
        cfg["dqn"].update(buffer_size=4096, learning_starts=256 if quick else 1024, replay_ratio=0.0)
    else:
        cfg = load("pendulum_sac.yaml")
        cfg["env"]["num_envs"] = 4
        cfg["sac"].update(rollout_steps=64, learning_starts=256 if quick else 1024, replay_ratio=0.0)
    cfg["learner"] = {**cfg.get("learner", {}), "checkpoint_interval_s": 3600}
    cfg.pop("planner", None)
    cfg.pop("topology", None)
    return cfg


def with_device(cfg: dict, device: str) -> ExperimentConfig:
    return config_from_dict({**cfg, "learner": {**cfg["learner"], "device": device}})


def cut_batches(cfg: ExperimentConfig, count: int) -> list:
    """`count` TrainingBatches cut by the buffer's Store from fragments the actor's Rollout stepped.
    PPO's FIFO hands each fragment out once: one fragment per batch. Replay batches are sampled
    (uniformly, with replacement) from one fill of `learning_starts` transitions."""
    store = Store(cfg, Metrics("buffer"))
    size = algorithms.get(cfg.algorithm).batch_size(cfg)
    rollout = Rollout(cfg, "bench", 0, Metrics("actor"))
    batches: list = []
    try:
        if cfg.algorithm == "ppo":
            while len(batches) < count:
                store.insert(RawFragment(rollout.collect().payload))
                if (b := store.next_batch(size, "bench")) is not None:
                    batches.append(b)
        else:
            while (b := store.next_batch(size, "bench")) is None:
                store.insert(RawFragment(rollout.collect().payload))
            batches = [b] + [store.next_batch(size, "bench") for _ in range(count - 1)]
    finally:
        rollout.close()
    return batches


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(cfg: ExperimentConfig, batches: list, threads: int, args, ckpt: Path) -> dict:
    """Samples and updates per second of a Trainer on cfg.learner.device over `batches` in turn."""
    device = cfg.learner.device
    torch.set_num_threads(threads)
    trainer = Trainer(cfg, Metrics("learner"), ckpt)
    counters = trainer.metrics.counters
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    i = 0

    def step() -> None:
        nonlocal i
        trainer.train(batches[i % len(batches)])
        i += 1

    sync(device)
    started = time.perf_counter()
    while i < args.warmup_updates or time.perf_counter() - started < args.warmup:
        step()
    sync(device)
    warmup_s = time.perf_counter() - started
    u0, s0, g0 = trainer.version, counters["learner/samples_total"], trainer.algo.gradient_steps
    t0 = time.perf_counter()
    while True:
        step()
        sync(device)
        elapsed = time.perf_counter() - t0
        if (elapsed >= args.seconds and trainer.version - u0 >= args.min_updates) or elapsed >= args.max_seconds:
            break
    updates, samples = trainer.version - u0, counters["learner/samples_total"] - s0
    if updates == 0 or counters["learner/batches_skipped_total"] or counters["learner/batches_invalid_total"]:
        raise RuntimeError(f"{cfg.algorithm} on {device}: {updates} updates, "
                           f"{counters['learner/batches_skipped_total']:.0f} batches skipped, "
                           f"{counters['learner/batches_invalid_total']:.0f} invalid")
    row = {"algorithm": cfg.algorithm, "device": device, "available": True, "threads": threads,
           "updates": updates, "samples": samples, "gradient_steps": trainer.algo.gradient_steps - g0,
           "seconds": elapsed, "warmup_seconds": warmup_s, "warmup_updates": i - updates,
           "samples_per_s": samples / elapsed, "updates_per_s": updates / elapsed,
           "ms_per_update": elapsed / updates * 1e3, "capped": trainer.version - u0 < args.min_updates}
    if device.startswith("cuda"):
        row["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return row


def unavailable(algorithm: str) -> dict:
    print(f"    {algorithm:4s} cuda     unavailable (torch sees no CUDA device)", flush=True)
    return {"algorithm": algorithm, "device": "cuda", "available": False}


def report(row: dict) -> None:
    mem = f"   peak {row['peak_memory_mb']:.0f} MiB" if "peak_memory_mb" in row else ""
    print(f"    {row['algorithm']:4s} {row['device']:4s} x{row['threads']:<3d} {row['samples_per_s']:10.0f} samples/s "
          f"{row['updates_per_s']:8.2f} updates/s {row['ms_per_update']:8.1f} ms/update "
          f"({row['updates']} updates in {row['seconds']:.1f} s){mem}", flush=True)


def ratios(rows: list[dict], learner_threads: dict[str, int]) -> dict:
    """cuda / cpu samples per second per algorithm, the cpu row at the learner's own thread setting."""
    out = {}
    for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
        cpu = next((r for r in rows if r["algorithm"] == algorithm and r["device"] == "cpu" and "samples_per_s" in r
                    and r["threads"] == learner_threads[algorithm]), None)
        gpu = next((r for r in rows if r["algorithm"] == algorithm and r["device"] == "cuda" and "samples_per_s" in r), None)
        out[algorithm] = gpu["samples_per_s"] / cpu["samples_per_s"] if cpu and gpu else None
    return out


def machine() -> dict:
    info = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    p.add_argument("--seconds", type=float, default=15.0, help="least measured time per (algorithm, device)")
    p.add_argument("--min-updates", type=int, default=3, help="least measured updates per (algorithm, device)")
    p.add_argument("--warmup", type=float, default=2.0, help="least warm-up seconds before measuring")
    p.add_argument("--warmup-updates", type=int, default=1, help="least warm-up updates before measuring")
    p.add_argument("--max-seconds", type=float, default=45.0,
                   help="most measured time per row, even short of --min-updates (a row that stopped here says capped)")
    p.add_argument("--cpu-threads", type=int, nargs="+", default=None,
                   help="more cpu rows at these torch thread counts, measured after all the learner-setting rows")
    p.add_argument("--quick", action="store_true", help="a check of the code path: small batches, 0.5 s windows")
    default_out = Path(os.environ["OUT"]) / "learner_device.json" if os.environ.get("OUT") else \
        ROOT / "docs" / "learner_device.json"
    p.add_argument("--out", default=str(default_out), help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.min_updates, args.warmup, args.warmup_updates, args.max_seconds = 0.5, 2, 0.0, 1, 10.0
    result: dict = {"machine": machine(), "args": vars(args), "rows": []}
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, "
          f"{result['machine'].get('gpu', 'no CUDA device')}", flush=True)
    cases = {a: case_config(a, args.quick) for a in args.algorithms}
    learner_threads = {a: with_device(c, "cpu").learner.torch_threads for a, c in cases.items()}
    batches = {}
    for algorithm, cfg in cases.items():
        started = time.perf_counter()
        batches[algorithm] = cut_batches(with_device(cfg, "cpu"), 2 if algorithm == "ppo" else 64)
        print(f"{algorithm}: {len(batches[algorithm])} batches cut in {time.perf_counter() - started:.1f} s", flush=True)
    # First the learner's own setting on both devices, then the extra cpu thread counts: a run cut
    # off by its time limit keeps what matters most.
    plan = [(a, d, learner_threads[a]) for a in cases for d in ("cpu", "cuda")]
    plan += [(a, "cpu", n) for n in args.cpu_threads or [] for a in cases if n != learner_threads[a]]
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm, device, threads in plan:
            if device == "cuda" and not torch.cuda.is_available():
                row = unavailable(algorithm)
            else:
                try:
                    row = measure(with_device(cases[algorithm], device), batches[algorithm], threads, args,
                                  Path(tmp) / f"{algorithm}-{device}-{threads}")
                    report(row)
                except Exception as err:  # noqa: BLE001 (a failing device path is a finding: the other rows go on)
                    traceback.print_exc()
                    row = {"algorithm": algorithm, "device": device, "available": True, "threads": threads,
                           "error": f"{type(err).__name__}: {err}"}
                    print(f"    {algorithm:4s} {device:4s} x{threads:<3d} FAILED: {row['error']}", flush=True)
            result["rows"].append(row)
            result["ratios"] = ratios(result["rows"], learner_threads)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))  # after each row: a cut-off run keeps the rest
    print("cuda / cpu samples per second (cpu at the learner's torch_threads):")
    for algorithm, r in result["ratios"].items():
        print(f"    {algorithm:4s} {'unavailable' if r is None else f'{r:.2f}'}")
    print(f"wrote {args.out}")
    return 1 if any("error" in r for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
