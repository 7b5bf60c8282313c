"""Receive throughput of buffer shards: K actor processes pushing into S buffer processes.

    .venv/bin/python -m bench.shards [--shards 1,2] [--actors 4] [--mb-per-actor 256] [--size-kb 1024]

Each actor process is the real push path of bench/transport.py (a thread cuts fragments with
`encode_fragment`, the actor's `Pusher` streams them, nothing dropped); actor i pushes to shard
i % S, as `shard_of` places a local run's actor-i. Each buffer is `python -m services.buffer` with a
PPO FIFO that evicts what no learner takes, so what is measured is what the buffers receive, store
and validate, not what learners consume (TianJi's "receive throughput", Fig. 6). One point: the
observation bytes of every fragment over the time from `go` until the last actor's last fragment is
acknowledged. Shard counts are interleaved `--repeats` times and the median kept; the ratio to one
shard is measured in the same run. On a machine with fewer cores than actors + shards the actors
and the buffers share the cores, which bounds what a second shard can add.

Writes docs/shards.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.transport import PUSH_N, PUSH_T, BufferProcess, buffer_config, process_cpu_s, start_actors

ROOT = Path(__file__).resolve().parents[1]
KB, MB = 1024, 1024 * 1024


def point(tmp: Path, shards: int, actors: int, size: int, per_actor: int) -> dict:
    """One measurement: `actors` processes, each pushing `per_actor` bytes in fragments of about
    `size` bytes, into `shards` fresh buffer processes."""
    fifo_steps = 4 * PUSH_T * PUSH_N   # a few fragments held per shard: memory stays bounded
    buffers = [BufferProcess(tmp, buffer_config(fifo_steps)) for _ in range(shards)]
    try:
        shape = (PUSH_T, PUSH_N, max(1, size // ((PUSH_T + 1) * PUSH_N)))
        count = max(4, per_actor // size)
        groups = [start_actors(buffers[s].address, shape, [count] * len(range(s, actors, shards)), 0.0)
                  for s in range(shards)]
        cpu = [process_cpu_s(b.pid) for b in buffers]
        for _, go, _ in groups:
            go.set()
        seconds = []
        for procs, _, result_q in groups:
            for _ in procs:
                _, s, _ = result_q.get(timeout=1200)
                seconds.append(s)
            for p in procs:
                p.join()
        cpu = [None if c is None else process_cpu_s(b.pid) - c for b, c in zip(buffers, cpu)]
        final = [b.stats() for b in buffers]
        received = [int(f["buffer/fragments_received_total"] + f.get("buffer/fragments_duplicate_total", 0))
                    for f in final]
        want = [count * len(range(s, actors, shards)) for s in range(shards)]
        if received != want:
            raise RuntimeError(f"the shards received {received} fragments, expected {want}: "
                               f"{[{k: v for k, v in f.items() if 'fragments' in k} for f in final]}")
    finally:
        for b in buffers:
            b.stop()
    T, N, D = shape
    nbytes = actors * count * (T + 1) * N * D
    wall = max(seconds)
    return {"shards": shards, "actors": actors, "fragment_bytes": (T + 1) * N * D, "fragments": actors * count,
            "seconds": wall, "bytes_per_s": nbytes / wall, "fragments_per_shard": received,
            "buffer_cpu_s": cpu}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", default="1,2", help="shard counts to compare (the first is the baseline)")
    p.add_argument("--actors", type=int, default=4, help="actor processes in every point")
    p.add_argument("--size-kb", type=int, default=1024, help="fragment size (observation bytes)")
    p.add_argument("--mb-per-actor", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per shard count; the median is kept")
    p.add_argument("--out", default=str(ROOT / "docs" / "shards.json"))
    args = p.parse_args(argv)
    counts = [int(s) for s in args.shards.split(",")]
    runs: dict[int, list[dict]] = {s: [] for s in counts}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for s in counts:
                res = point(Path(tmp), s, args.actors, args.size_kb * KB, args.mb_per_actor * MB)
                runs[s].append(res)
                print(f"repeat {r}: {s} shard(s), {args.actors} actors: {res['bytes_per_s'] / 1e6:,.0f} MB/s "
                      f"({res['seconds']:.1f} s; buffer CPU s {res['buffer_cpu_s']})", flush=True)
    base = statistics.median(x["bytes_per_s"] for x in runs[counts[0]])
    rows = []
    for s in counts:
        med = statistics.median(x["bytes_per_s"] for x in runs[s])
        rows.append({"shards": s, "median_bytes_per_s": med, "ratio_to_first": med / base, "runs": runs[s]})
        print(f"{s} shard(s): median {med / 1e6:,.0f} MB/s, {med / base:.2f}x {counts[0]} shard(s)")
    out = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "actors": args.actors,
           "size_kb": args.size_kb, "mb_per_actor": args.mb_per_actor, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
