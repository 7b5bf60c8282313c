"""Data transfer on loopback next to its physical limit (TianJi, arXiv 2502.20190, Fig. 5).

    .venv/bin/python -m bench.transport [--part a|b|all] [--mb-per-point 256] [--samples 10000]

(a) Push throughput from one actor process to one buffer process for fragment sizes 64 KB..4 MB,
    next to raw TCP between two Python processes measured in the same run (the hardware limit as
    Python sees it: length-prefixed sendall of a ready buffer, recv_into a preallocated one), the
    gRPC floor (ready bytes on one client stream to a server that drops them) and a naive
    grpc.aio client stream (generated messages, parsed and validated by the protobuf runtime).
    The actor side is the real one: a thread cuts fragments with `encode_fragment` (as the rollout
    thread does) and the actor's `Pusher` streams them; the buffer is `python -m services.buffer`.
    Throughput counts fragment payload bytes, from the first fragment cut until the buffer has
    acknowledged the last one.
(b) Time to collect `--samples` samples of 512 KB into one buffer as the number of actor processes
    M grows, each actor taking `t_s` seconds per sample (a sleep, so that the 2-core machine is
    not the limit), at t_s = 0.001 s and 0.01 s, next to the critical path

        T(M) = max(N * t_s / M, N * S / B) + t_s + S / B                    (eq. 1, as derived here)

    with N samples of S bytes and B the raw TCP bandwidth of (a): samples are produced M at a time
    but share one link into the buffer, so collection takes at least the longer of the producing
    and the transfer time, plus one sample's production and transfer to fill the pipeline.

Writes docs/transport.json and docs/transport.png. Timings on a shared machine move by 10-20%;
the ratios to raw TCP are measured in the same run and are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KB = 1024
SIZES = [64 * KB, 128 * KB, 256 * KB, 512 * KB, 1024 * KB, 2048 * KB, 4096 * KB]
HEADER = struct.Struct("<Q")
SWITCH_INTERVAL_S = 0.0001


# --- process CPU ------------------------------------------------------------------------------------

def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _per_gb(cpu_s: float | None, nbytes: float) -> float | None:
    return None if cpu_s is None else cpu_s / (nbytes / 1e9)


# --- raw TCP --------------------------------------------------------------------------------------

def _tcp_receiver(port_q, size: int, count: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(size)
    view = memoryview(buf)
    head = bytearray(HEADER.size)
    for _ in range(count):
        _recv_exact(conn, memoryview(head))
        (n,) = HEADER.unpack(head)
        _recv_exact(conn, view[:n])
    conn.sendall(b"k")
    conn.close()
    srv.close()


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("sender closed early")
        got += n


def raw_tcp(size: int, total_bytes: int) -> dict:
    """Length-prefixed `size`-byte messages from this process to a receiver process over loopback."""
    count = max(4, total_bytes // size)
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    rx = ctx.Process(target=_tcp_receiver, args=(port_q, size, count))
    rx.start()
    port = port_q.get(timeout=60)
    payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    header = HEADER.pack(size)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        rx_cpu, tx_cpu = process_cpu_s(rx.pid), time.process_time()
        started = time.perf_counter()
        for _ in range(count):
            sock.sendall(header)
            sock.sendall(payload)
        if sock.recv(1) != b"k":
            raise RuntimeError("raw TCP receiver did not acknowledge")
        seconds = time.perf_counter() - started
        rx_cpu = None if rx_cpu is None else process_cpu_s(rx.pid) - rx_cpu
        tx_cpu = time.process_time() - tx_cpu
    rx.join()
    nbytes = count * size
    return {"bytes_per_s": nbytes / seconds, "receiver_cpu_s_per_gb": _per_gb(rx_cpu, nbytes),
            "sender_cpu_s_per_gb": _per_gb(tx_cpu, nbytes)}


# --- gRPC push: the actor's Pusher into a buffer process --------------------------------------------

def buffer_config(fifo_steps: int) -> dict:
    # PPO keeps whole fragments in a FIFO (no copy into a replay ring), so what the buffer spends is
    # the transport, the read and the validation; old fragments are evicted (counted) to bound memory.
    return {"algorithm": "ppo", "env": {"mode": "external", "observation_shape": [1], "num_actions": 2},
            "buffer": {"fifo_capacity_steps": fifo_steps, "max_message_mb": 64}}


class BufferProcess:
    """`python -m services.buffer` on 127.0.0.1:0 (the same process starter as the tests)."""

    def __init__(self, tmp: Path, cfg: dict):
        from tests.helpers import Service, write_config

        self.service = Service("buffer", tmp, write_config(tmp / f"buffer-{time.monotonic_ns()}.yaml", cfg))
        self.address = self.service.wait_ready()

    @property
    def pid(self) -> int:
        return self.service.popen.pid

    def stats(self) -> dict[str, float]:
        from kuberl.v1 import buffer_pb2_grpc
        from tests.helpers import stats

        return stats(self.address, buffer_pb2_grpc.BufferStub)

    def received(self) -> float:
        return self.stats()["buffer/fragments_received_total"]

    def stop(self) -> None:
        self.service.terminate()


def fragment_kwargs(actor_id: str, seq: int, obs: np.ndarray) -> dict:
    """The arguments of a PPO fragment around `obs` [T+1, N, D] uint8 (zero actions, rewards, flags)."""
    from kuberl.v1 import common_pb2 as pb

    T, N = obs.shape[0] - 1, obs.shape[1]
    return dict(actor_id=actor_id, seq=seq, policy_version=0, algorithm=pb.ALGORITHM_PPO, env_ids=range(N),
                obs=obs, actions=np.zeros((T, N), np.int64), rewards=np.zeros((T, N), np.float32),
                terminated=np.zeros((T, N), bool), truncated=np.zeros((T, N), bool),
                final_obs=np.empty((0, *obs.shape[2:]), obs.dtype), final_index=np.empty(0, np.int64),
                extras={"behaviour_logprob": np.zeros((T, N), np.float32)})


def make_fragment(actor_id: str, seq: int, obs: np.ndarray):
    """A serialized PPO fragment around `obs`, encoded as the rollout thread does."""
    from services.common.protocol.fragments import encode_fragment

    return encode_fragment(**fragment_kwargs(actor_id, seq, obs))


def _actor(address: str, actor_id: str, shape: tuple[int, int, int], count: int, sample_time_s: float,
           ready, go, result_q) -> None:
    """An actor process: a producer thread cuts `count` fragments of uint8 obs [T+1, N, D] (sleeping
    `sample_time_s` before each, the env time) and serializes them, as the rollout thread does; the
    actor's Pusher streams them to the buffer with the default actor settings. Puts
    (seconds from `go` until every fragment is acknowledged, process CPU seconds) on `result_q`."""
    import uvloop

    from services.actor.push import Pusher
    from services.common.config import ActorConfig
    from services.common.net.grpcutil import MiB, make_channel
    from services.common.stats import Metrics

    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as the actor process does (services/actor/main.py)
    cfg = ActorConfig()
    T, N, D = shape
    obs = np.random.default_rng(abs(hash(actor_id)) % 2**32).integers(0, 256, (T + 1, N, D), dtype=np.uint8)

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        metrics = Metrics("actor", instance_id=actor_id)
        channel = make_channel(address, 64 * MiB)
        await channel.channel_ready()
        pusher = Pusher(channel, cfg.queue_fragments, cfg.push_ack_interval_s, metrics)
        # The bench never lets the pusher drop a fragment: the producer waits while its queue is full
        # (in fragments or in bytes, whichever bound comes first).
        size = len(make_fragment(actor_id, 0, obs).payload)
        room = threading.Semaphore(max(1, min(pusher.capacity, pusher.max_bytes // size - 1)))
        stopping = asyncio.Event()

        def produce() -> None:
            for seq in range(count):
                if sample_time_s:
                    time.sleep(sample_time_s)
                msg = make_fragment(actor_id, seq, obs)
                room.acquire()
                loop.call_soon_threadsafe(pusher.enqueue, msg)
            loop.call_soon_threadsafe(stopping.set)  # as at actor shutdown: push the rest, wait for no more

        ready.set()
        await asyncio.to_thread(go.wait)
        cpu, started = time.process_time(), time.perf_counter()
        threading.Thread(target=produce, daemon=True).start()
        push = asyncio.create_task(pusher.run(stopping))
        released = 0
        while not push.done():
            sent = int(metrics.counters["actor/fragments_pushed_total"])  # left the queue
            for _ in range(sent - released):
                room.release()
            released = sent
            await asyncio.sleep(0.001)
        await push
        seconds = time.perf_counter() - started
        await channel.close()
        return seconds, time.process_time() - cpu

    result_q.put((actor_id, *uvloop.run(main())))


def start_actors(address: str, shape, counts: list[int], sample_time_s: float):
    """Spawn one actor process per entry of `counts`; returns (processes, go event, result queue)
    once every one of them is connected and waiting for `go`."""
    ctx = mp.get_context("spawn")
    go, result_q = ctx.Event(), ctx.Queue()
    procs, readies = [], []
    for i, count in enumerate(counts):
        ready = ctx.Event()
        p = ctx.Process(target=_actor, args=(address, f"bench-{i}-{time.monotonic_ns()}", shape, count,
                                             sample_time_s, ready, go, result_q))
        p.start()
        procs.append(p)
        readies.append(ready)
    for ready in readies:
        if not ready.wait(120):
            raise RuntimeError("an actor process did not start within 120 s")
    return procs, go, result_q


def grpc_push(buffer: BufferProcess, size: int, total_bytes: int) -> dict:
    """Fragments of about `size` bytes from one actor process into the buffer process."""
    shape = (PUSH_T, PUSH_N, max(1, size // ((PUSH_T + 1) * PUSH_N)))
    count = max(4, total_bytes // size)
    before = buffer.received()
    procs, go, result_q = start_actors(buffer.address, shape, [count], 0.0)
    rx_cpu = process_cpu_s(buffer.pid)
    go.set()
    _, seconds, tx_cpu = result_q.get(timeout=600)
    rx_cpu = None if rx_cpu is None else process_cpu_s(buffer.pid) - rx_cpu
    for p in procs:
        p.join()
    got = buffer.received() - before
    if got != count:
        raise RuntimeError(f"the buffer received {got} fragments of {count}")
    T, N, D = shape
    nbytes = count * (T + 1) * N * D  # payload: the observations, as in the TCP messages
    return {"bytes_per_s": nbytes / seconds, "receiver_cpu_s_per_gb": _per_gb(rx_cpu, nbytes),
            "sender_cpu_s_per_gb": _per_gb(tx_cpu, nbytes)}


def _floor_server(port_q, naive: bool = False) -> None:
    """A gRPC server with kuberl's server options whose PushTrajectories takes the bytes and drops them,
    or (`naive`) lets the protobuf runtime parse each message and validates it with decode_fragment."""
    import grpc
    import uvloop

    from kuberl.v1 import buffer_pb2
    from services.common.net.grpcutil import MiB, server_options

    from kuberl.v1 import common_pb2 as pb
    from services.common.protocol.fragments import decode_fragment

    async def push(requests, context):
        n = 0
        async for msg in requests:
            if naive:
                decode_fragment(msg)
            n += 1
        return buffer_pb2.PushAck(accepted=n)

    async def main() -> None:
        server = grpc.aio.server(options=server_options(64 * MiB))
        handler = grpc.stream_unary_rpc_method_handler(push, request_deserializer=(
            pb.TrajectoryFragment.FromString if naive else None),
                                                       response_serializer=buffer_pb2.PushAck.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kuberl.v1.Buffer",
                                                                              {"PushTrajectories": handler}),))
        port_q.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


def grpc_floor(size: int, total_bytes: int, naive: bool = False) -> dict:
    """The same gRPC stack and channel options with no work per message: ready bytes written on one
    client stream from this process to a server process that discards them. What any Python gRPC
    client stream can reach here; kuberl's push adds cutting, tracking and validating fragments.

    `naive`: a plain grpc.aio client stream of generated messages instead (built per message with
    build_fragment, serialized by gRPC on the event loop), parsed by the protobuf runtime and
    validated with decode_fragment on the server: the design before this benchmark existed."""
    import uvloop

    from kuberl.v1 import buffer_pb2
    from kuberl.v1 import common_pb2 as pb
    from services.common.protocol.fragments import build_fragment
    from services.common.net.grpcutil import MiB, make_channel

    count = max(4, total_bytes // size)
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    server = ctx.Process(target=_floor_server, args=(port_q, naive), daemon=True)
    server.start()
    port = port_q.get(timeout=60)
    T, N, D = PUSH_T, PUSH_N, max(1, size // ((PUSH_T + 1) * PUSH_N))
    obs = [np.random.default_rng(i).integers(0, 256, (T + 1, N, D), dtype=np.uint8) for i in range(8)]
    payloads = [o.tobytes() for o in obs]

    def message(i: int):
        if not naive:
            return payloads[i % len(payloads)]
        return build_fragment(**fragment_kwargs("naive", i, obs[i % len(obs)]))

    async def run() -> tuple[float, float, float | None]:
        channel = make_channel(f"127.0.0.1:{port}", 64 * MiB)
        await channel.channel_ready()
        call = channel.stream_unary(
            "/kuberl.v1.Buffer/PushTrajectories",
            request_serializer=pb.TrajectoryFragment.SerializeToString if naive else None,
            response_deserializer=buffer_pb2.PushAck.FromString)()
        rx, tx, started = process_cpu_s(server.pid), time.process_time(), time.perf_counter()
        for i in range(count):
            await call.write(message(i))
        await call.done_writing()
        if (await call).accepted != count:
            raise RuntimeError("the floor server lost messages")
        seconds = time.perf_counter() - started
        rx = None if rx is None else process_cpu_s(server.pid) - rx
        await channel.close()
        return seconds, time.process_time() - tx, rx

    try:
        seconds, tx_cpu, rx_cpu = uvloop.run(run())
    finally:
        server.kill()
        server.join()
    nbytes = count * (T + 1) * N * D
    return {"bytes_per_s": nbytes / seconds, "receiver_cpu_s_per_gb": _per_gb(rx_cpu, nbytes),
            "sender_cpu_s_per_gb": _per_gb(tx_cpu, nbytes)}


PUSH_T, PUSH_N = 16, 4  # fragment layout in (a): 16 steps of 4 envs, obs sized to the message size


def part_a(sizes: list[int], total_bytes: int, repeats: int, tmp: Path) -> list[dict]:
    """Best of `repeats` interleaved runs of raw TCP and push per size (the machine is shared: the
    best run is the one least disturbed)."""
    rows = []
    print("(a) one actor process -> one buffer process, loopback; MB/s, best of the runs")
    print(f"{'size':>8} | {'raw TCP':>8} | {'gRPC floor':>10} | {'naive':>6} | {'push':>6} | {'naive/TCP':>9} | "
          f"{'push/TCP':>8} | {'push/floor':>10} | receiver CPU s/GB: TCP, floor, naive, buffer | sender: same")
    for size in sizes:
        buffer = BufferProcess(tmp, buffer_config(fifo_steps=4096))  # a PPO buffer holds one layout
        runs: dict[str, list[dict]] = {"raw_tcp": [], "grpc_floor": [], "naive": [], "push": []}
        try:
            for _ in range(repeats):
                runs["raw_tcp"].append(raw_tcp(size, total_bytes))
                runs["grpc_floor"].append(grpc_floor(size, total_bytes))
                runs["naive"].append(grpc_floor(size, total_bytes, naive=True))
                runs["push"].append(grpc_push(buffer, size, total_bytes))
        finally:
            buffer.stop()
        best = {k: max(v, key=lambda r: r["bytes_per_s"]) for k, v in runs.items()}
        rate = {k: v["bytes_per_s"] for k, v in best.items()}
        row = {"size_bytes": size, **best, "ratio": rate["push"] / rate["raw_tcp"],
               "ratio_to_floor": rate["push"] / rate["grpc_floor"], "naive_ratio": rate["naive"] / rate["raw_tcp"],
               "runs_bytes_per_s": {k: [r["bytes_per_s"] for r in v] for k, v in runs.items()}}
        rows.append(row)

        def cpu(side: str) -> str:
            return ", ".join("-" if best[k][side] is None else f"{best[k][side]:.2f}"
                             for k in ("raw_tcp", "grpc_floor", "naive", "push"))

        print(f"{size // KB:>5} KB | {rate['raw_tcp'] / 1e6:>8.0f} | {rate['grpc_floor'] / 1e6:>10.0f} | "
              f"{rate['naive'] / 1e6:>6.0f} | {rate['push'] / 1e6:>6.0f} | {row['naive_ratio']:>9.2f} | "
              f"{row['ratio']:>8.2f} | {row['ratio_to_floor']:>10.2f} | "
              f"{cpu('receiver_cpu_s_per_gb')} | {cpu('sender_cpu_s_per_gb')}", flush=True)
    return rows


# --- (b) collection time as actors grow ----------------------------------------------------------

def critical_path_s(n: int, size: int, sample_time_s: float, actors: int, bandwidth: float) -> float:
    """Eq. 1 (as derived in the module docstring): max(N t_s / M, N S / B) + t_s + S / B."""
    return max(n * sample_time_s / actors, n * size / bandwidth) + sample_time_s + size / bandwidth


def collect(buffer: BufferProcess, n: int, size: int, sample_time_s: float, actors: int) -> float:
    """Seconds from go until the buffer holds all `n` samples of `size` bytes from `actors` processes."""
    shape = (1, 1, size // 2)  # one sample per fragment: obs [2, 1, S/2] uint8 = S bytes
    counts = [n // actors + (i < n % actors) for i in range(actors)]
    before = buffer.received()
    procs, go, result_q = start_actors(buffer.address, shape, counts, sample_time_s)
    go.set()
    started = time.perf_counter()
    while buffer.received() - before < n:
        time.sleep(0.01)
    seconds = time.perf_counter() - started
    for _ in procs:
        result_q.get(timeout=120)
    for p in procs:
        p.join()
    return seconds


def part_b(n: int, size: int, sample_times: list[float], actor_counts: list[int], tcp_bandwidth: float,
           push_bandwidth: float, tmp: Path) -> list[dict]:
    rows = []
    print(f"\n(b) time to collect {n:,} samples of {size // KB} KB into one buffer; eq. 1 with B = raw TCP "
          f"{tcp_bandwidth / 1e6:.0f} MB/s and with B = push {push_bandwidth / 1e6:.0f} MB/s (from (a))")
    print(f"{'t_s':>6} | {'actors':>6} | {'measured s':>10} | {'eq.1 B=TCP':>10} | {'eq.1 B=push':>11} | measured / eq.1 (TCP)")
    buffer = BufferProcess(tmp, buffer_config(fifo_steps=64))
    try:
        for t_s in sample_times:
            for m in actor_counts:
                seconds = collect(buffer, n, size, t_s, m)
                ideal = critical_path_s(n, size, t_s, m, tcp_bandwidth)
                ideal_push = critical_path_s(n, size, t_s, m, push_bandwidth)
                rows.append({"sample_time_s": t_s, "actors": m, "seconds": seconds, "eq1_tcp_s": ideal,
                             "eq1_push_s": ideal_push, "ratio_to_eq1_tcp": seconds / ideal})
                print(f"{t_s:>6} | {m:>6} | {seconds:>10.2f} | {ideal:>10.2f} | {ideal_push:>11.2f} | "
                      f"{seconds / ideal:.2f}", flush=True)
    finally:
        buffer.stop()
    return rows


# --- report ------------------------------------------------------------------------------------------

def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("a", "b") if result.get(k)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "a":
            rows = result["a"]
            kb = [r["size_bytes"] / KB for r in rows]
            ax.plot(kb, [r["raw_tcp"]["bytes_per_s"] / 1e6 for r in rows], "o-", label="raw TCP (Python)")
            ax.plot(kb, [r["grpc_floor"]["bytes_per_s"] / 1e6 for r in rows], "^:", label="gRPC floor (no work)")
            ax.plot(kb, [r["naive"]["bytes_per_s"] / 1e6 for r in rows], "v:", label="naive grpc.aio stream")
            ax.plot(kb, [r["push"]["bytes_per_s"] / 1e6 for r in rows], "s-", label="kuberl push (gRPC)")
            for x, r in zip(kb, rows):
                ax.annotate(f"{r['ratio']:.2f}", (x, r["push"]["bytes_per_s"] / 1e6), textcoords="offset points",
                            xytext=(0, -14), ha="center", fontsize=8)
            ax.set_xscale("log", base=2)
            ax.set_xticks(kb, [f"{k:.0f}" for k in kb])
            ax.set_xlabel("message size (KB)")
            ax.set_ylabel("MB/s")
            ax.set_title("(a) actor -> buffer throughput, loopback")
        else:
            rows = result["b"]
            for t_s in sorted({r["sample_time_s"] for r in rows}):
                sel = [r for r in rows if r["sample_time_s"] == t_s]
                line, = ax.plot([r["actors"] for r in sel], [r["seconds"] for r in sel], "o-",
                                label=f"measured, t_s = {t_s} s")
                ax.plot([r["actors"] for r in sel], [r["eq1_tcp_s"] for r in sel], "--", color=line.get_color(),
                        label=f"eq. 1 (B = raw TCP), t_s = {t_s} s")
            ax.set_xscale("log", base=2)
            actors = sorted({r["actors"] for r in rows})
            ax.set_xticks(actors, [str(m) for m in actors])
            ax.set_yscale("log")
            ax.set_xlabel("actor processes")
            ax.set_ylabel("seconds")
            ax.set_title(f"(b) time to collect {result['b_samples']:,} samples of 512 KB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["a", "b", "all"], default="all")
    p.add_argument("--sizes-kb", default=",".join(str(s // KB) for s in SIZES))
    p.add_argument("--mb-per-point", type=int, default=256, help="data sent per size and run in (a), MB")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per size in (a); the best is kept")
    p.add_argument("--samples", type=int, default=10_000, help="samples to collect per point in (b)")
    p.add_argument("--actors", default="1,2,4,8,16", help="actor process counts in (b)")
    p.add_argument("--sample-times", default="0.001,0.01", help="seconds per sample in (b)")
    p.add_argument("--out", default=str(ROOT / "docs" / "transport"), help="writes OUT.json and OUT.png")
    args = p.parse_args(argv)
    sizes = [int(s) * KB for s in args.sizes_kb.split(",")]
    result: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        a_sizes = sizes if args.part in ("a", "all") else [512 * KB]
        result["a"] = part_a(a_sizes, args.mb_per_point * 1_000_000, args.repeats, tmp)
        if args.part in ("b", "all"):
            at512 = min(result["a"], key=lambda r: abs(r["size_bytes"] - 512 * KB))
            result["b_samples"] = args.samples
            result["b"] = part_b(args.samples, 512 * KB, [float(t) for t in args.sample_times.split(",")],
                                 [int(m) for m in args.actors.split(",")], at512["raw_tcp"]["bytes_per_s"],
                                 at512["push"]["bytes_per_s"], tmp)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
