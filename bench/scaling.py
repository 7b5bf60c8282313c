"""Scaling on simulated nodes: links, not cores, as the scarce resource (TianJi, arXiv 2502.20190, Fig. 6).

    sudo PYTHONPATH=. .venv/bin/python -m bench.scaling [--quick] [--panels abc] [--link-mbit 100]

Needs root (Linux network namespaces, veth, tc). Every role runs on a "node": a network namespace
`kbs-<role><i>` whose one interface is a veth into a switch namespace `kbs-sw` (a bridge). Both ends
of every node's veth carry a token-bucket filter (`tc ... tbf rate <link-mbit>mbit`), so each node
has a full-duplex link of that rate, as a NIC would; the monitor's link is not limited. Latency is
not emulated (no netem here). Nothing is created outside `kbs-` namespaces: the veths are created
inside them and the root namespace is never touched; leftovers of an earlier run (namespaces named
`kbs-*` and the processes inside them) are swept at start, and everything is removed on exit,
Ctrl-C or an exception.

Roles, sized so that the 2 cores are not what limits first:
- a buffer shard is the real `python -m services.buffer` (DQN replay of uint8 observations of
  `--obs-bytes`, replay ratio `--replay-ratio`, so the rate limiter paces both sides);
- a synthetic actor is a process that cuts a pre-encoded fragment (encoded once; each cut rewrites
  only the header with its seq and the trailer's creation time) at a set rate in samples/s, honours
  the buffer's insert limit (the actor's `InsertGate` fed by `watch_insert_limit`) and pushes with the
  actor's `Pusher`, never dropping (it waits while 16 fragments are unsent);
- a synthetic learner streams batches from every shard (StreamBatches, re-opened as it ends),
  "trains" by sleeping a fixed cost per batch, and reports to each shard what it consumed from it
  (ReportProgress with batches/samples_consumed_total, as services/learner/loops.send_progress);
- a monitor on its own node reads each shard's GetStats.

A point: after `--settle` seconds, a window of `--window` seconds in which are measured the receive
throughput (buffer/samples_received_total, summed over shards), the training throughput (samples
the learners took and trained on), each link's bytes in both directions (veth counters, as a share
of the link rate), the machine's CPU (/proc/stat every 0.25 s: busy share of both cores) and our
processes' CPU. A point whose median busy share is at least `--cpu-threshold` is reported CPU-bound,
whatever the links show; otherwise the bottleneck named is a link at >= 85% of its rate, else the
learner (busy >= 85% of the window, the rate limiter holding actors), else the actors.

Panels:
(a) receive and training throughput against the number of actors (each `--actor-rate` samples/s),
    one shard and one learner of fixed cost `--learner-cost` s per batch: linear until the
    production/consumption equilibrium (learner capacity / replay ratio), then flat;
(b) the same for several learner costs: the equilibrium moves with the learner's capacity until the
    shard's link caps it;
(c) receive and training throughput against the number of replicated groups G (G shards, G
    learners each streaming from every shard, G x `--group-actors` actors; actor i pushes to shard
    i % G): near-linear while links limit, until this machine's CPU does, which is detected and said.
From the measured per-shard figures (link goodput share, the buffer's CPU per byte) a projection to
the paper's 8-node testbed, its assumptions written out in the JSON and in docs/benchmarks.md.

Writes docs/scaling.json and docs/scaling.png (`--out`). The full run takes about 12 minutes here;
`--quick` a few. `--reanalyze docs/scaling.json` re-derives the verdicts, the summary, the projection
and the plot from a recorded run (no root needed).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "kbs-"
SWITCH = f"{PREFIX}sw"
BRIDGE = "br0"
SUBNET = "10.77"                 # inside the kbs- namespaces only; never routed from the host
BUFFER_PORT = 50051
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
MB = 1e6
LINK_BOUND = 0.85                # a link carrying this share of its rate is the bottleneck
LEARNER_BOUND = 0.85             # a learner busy this share of the window is
ACTOR_ROOM = 16                  # fragments a synthetic actor lets wait unsent


# --- topology and addresses (pure) ---------------------------------------------------------------

@dataclass(frozen=True)
class Node:
    """One simulated node: a network namespace with one veth into the switch namespace."""
    name: str            # the namespace
    kind: str            # "shard", "learner", "actor" or "monitor"
    group: int           # replicated group (monitor: -1)
    index: int           # within its kind and group
    ip: str
    veth: str            # the switch-side end of its link (the node-side end is eth0)
    link_mbit: float | None   # both directions; None: not limited

    @property
    def address(self) -> str:
        return f"{self.ip}:{BUFFER_PORT}"


KIND_OCTET = {"monitor": 0, "shard": 1, "learner": 2, "actor": 3}
KIND_LETTER = {"monitor": "m", "shard": "s", "learner": "l", "actor": "a"}


def plan_topology(groups: int, actor_nodes_per_group: int, link_mbit: float, prefix: str = PREFIX) -> list[Node]:
    """The nodes of `groups` replicated groups: per group a shard node, a learner node and
    `actor_nodes_per_group` actor nodes, all on links of `link_mbit`, plus one monitor node on an
    unlimited link. Addresses 10.77.<kind>.<n> /16 (n from 1), names <prefix><letter><n>, each
    within Linux's 15-character interface and sane namespace lengths."""
    if not 1 <= groups <= 60 or not 1 <= actor_nodes_per_group <= 4:
        raise ValueError("1..60 groups of 1..4 actor nodes")
    nodes = [Node(f"{prefix}m0", "monitor", -1, 0, f"{SUBNET}.0.1", "vm0", None)]
    for g in range(groups):
        for kind, count in (("shard", 1), ("learner", 1), ("actor", actor_nodes_per_group)):
            for i in range(count):
                n = g * count + i
                letter = KIND_LETTER[kind]
                nodes.append(Node(f"{prefix}{letter}{n}", kind, g, i, f"{SUBNET}.{KIND_OCTET[kind]}.{n + 1}",
                                  f"v{letter}{n}", link_mbit))
    return nodes


def nodes_of(nodes: list[Node], kind: str, group: int | None = None) -> list[Node]:
    return [n for n in nodes if n.kind == kind and (group is None or n.group == group)]


def actor_placement(actors: int, groups: int) -> list[tuple[int, int]]:
    """(group, actor node index within the group) of actor i = 0..actors-1: actor i pushes to shard
    i % groups (the index rule of services/common/net/shards.py) and sits on that group's actor nodes in
    turn, so each group's actors spread over its actor nodes."""
    return [(i % groups, i // groups) for i in range(actors)]


def tbf_burst_bytes(link_mbit: float) -> int:
    """A bucket of at least 64 KB (one GSO segment) and 10 ms of the rate."""
    return max(64 * 1024, int(link_mbit * 1e6 / 8 * 0.01))


def setup_commands(nodes: list[Node], switch: str = SWITCH) -> list[list[str]]:
    """The ip/tc commands that build `nodes` around a bridge in the `switch` namespace. The veth pair
    is created straight into the two namespaces: no interface ever exists in the root namespace."""
    cmds = [["ip", "netns", "add", switch],
            ["ip", "-n", switch, "link", "set", "lo", "up"],
            ["ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge"],
            ["ip", "-n", switch, "link", "set", BRIDGE, "up"]]
    for n in nodes:
        cmds += [["ip", "netns", "add", n.name],
                 ["ip", "-n", switch, "link", "add", n.veth, "type", "veth", "peer", "name", "eth0", "netns", n.name],
                 ["ip", "-n", switch, "link", "set", n.veth, "master", BRIDGE],
                 ["ip", "-n", switch, "link", "set", n.veth, "up"],
                 ["ip", "-n", n.name, "link", "set", "lo", "up"],
                 ["ip", "-n", n.name, "addr", "add", f"{n.ip}/16", "dev", "eth0"],
                 ["ip", "-n", n.name, "link", "set", "eth0", "up"]]
        if n.link_mbit:
            tbf = ["root", "tbf", "rate", f"{n.link_mbit:g}mbit", "burst", str(tbf_burst_bytes(n.link_mbit)),
                   "latency", "50ms"]
            cmds += [["tc", "-n", n.name, "qdisc", "add", "dev", "eth0", *tbf],     # the node's egress
                     ["tc", "-n", switch, "qdisc", "add", "dev", n.veth, *tbf]]     # the node's ingress
    return cmds


def ours(names: list[str], prefix: str = PREFIX) -> list[str]:
    """The namespaces among `names` that this bench creates (and may remove)."""
    return [n for n in names if n.startswith(prefix)]


# --- CPU saturation (pure) ------------------------------------------------------------------------

def parse_proc_stat(text: str) -> tuple[int, int]:
    """(busy, total) jiffies of the "cpu" line of /proc/stat: idle and iowait are not busy."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]]
            total = sum(v[:8])       # user nice system idle iowait irq softirq steal (guest is in user)
            return total - v[3] - v[4], total
    raise ValueError("no cpu line in /proc/stat")


def busy_shares(samples: list[tuple[int, int]]) -> list[float]:
    """Busy share of the machine in each interval between consecutive (busy, total) samples."""
    out = []
    for (b0, t0), (b1, t1) in zip(samples, samples[1:]):
        if t1 > t0:
            out.append((b1 - b0) / (t1 - t0))
    return out


def cpu_verdict(samples: list[tuple[int, int]], threshold: float = 0.9) -> dict:
    """Whether the machine was CPU-bound over recorded /proc/stat samples: the median busy share of
    its intervals at or over `threshold` (a median, so one burst does not decide it)."""
    shares = busy_shares(samples)
    if not shares:
        return {"saturated": False, "busy_median": None, "busy_mean": None, "busy_max": None, "intervals": 0}
    med = statistics.median(shares)
    return {"saturated": med >= threshold, "busy_median": med, "busy_mean": statistics.fmean(shares),
            "busy_max": max(shares), "intervals": len(shares)}


def classify(cpu_saturated: bool, link_util: float, learner_busy: float, actor_share_of_offered: float) -> str:
    """The bottleneck of one point: the resource found at its limit. A link carrying >= 85% of its
    rate (for several shards: every shard's link), a learner busy >= 85% of the window or actors
    cutting >= 90% of their set rate is what binds, saturated cores or not (a full link cannot carry
    more, whoever holds the cores). Only where none of them is at its limit and the machine's cores
    are saturated is the point CPU-bound: then the CPU, not a link, is what it measured. Whether the
    cores were saturated is reported beside every verdict (`cpu.saturated`)."""
    if link_util >= LINK_BOUND:
        return "link-bound"
    if learner_busy >= LEARNER_BOUND:
        return "learner-bound"
    if actor_share_of_offered >= 0.9:
        return "actor-bound"
    if cpu_saturated:
        return "CPU-bound"
    return "unclear"


def shard_link_util(links: dict, prefix: str = PREFIX) -> float:
    """The least loaded serving shard's ingress share of its link: every shard is link-bound when it
    is high. Shards of groups not running in the point (idle nodes, under 10 KB/s) are left out."""
    shards = [v["in_util"] for v in active_shard_links(links, prefix)]
    return min(shards) if shards else 0.0


def active_shard_links(links: dict, prefix: str = PREFIX) -> list[dict]:
    return [v for name, v in links.items() if name.startswith(f"{prefix}s") and v["in_bytes_per_s"] > 1e4]


def analyze(point: dict) -> str:
    """The verdict of a recorded point (`measure`'s dict)."""
    offered = point["offered_samples_per_s"]
    return classify(point["cpu"]["saturated"], shard_link_util(point["links"]), point["learner_busy"],
                    point["actors_cut_samples_per_s"] / offered if offered else 0.0)


def others_cores(verdict: dict, ours_cores: float, cpus: int) -> float | None:
    """Cores busy with work that is not this bench's (other users of a shared machine) in a window:
    the machine's busy share times its cores, less what our processes took (kernel work for our
    links, softirq on no process's account, counts as theirs: an upper bound)."""
    if verdict.get("busy_mean") is None:
        return None
    return max(0.0, verdict["busy_mean"] * cpus - ours_cores)


def groups_fitting(cpus: int, cores_per_group: float, headroom: float = 0.9) -> int:
    """Groups whose processes fit in `headroom` of the machine's cores at `cores_per_group` each."""
    return int(cpus * headroom / cores_per_group) if cores_per_group > 0 else 0


# --- projection (pure) ----------------------------------------------------------------------------

def project(nodes: int, *, link_gbit: float, goodput_share: float, served_wire_per_received: float,
            buffer_cpu_s_per_gb: float, replay_ratio: float, sample_bytes: float,
            cores_per_buffer: float = 1.0) -> list[dict]:
    """Receive and training throughput of 1..`nodes` replicated groups, one per node.

    Per group, the shard receives at most its link's rate times the goodput share measured here
    (payload bytes over line bytes), serves at most its link's rate times the goodput share divided
    by the bytes it sends per byte received (`served_wire_per_received`, batches carry obs and
    next_obs: replay ratio x ~2), and handles at most `cores_per_buffer` / (CPU s per byte) (a buffer
    is one event loop). Groups add: no resource is shared between them but the switch, taken as
    non-blocking. Training throughput is the replay ratio times receive."""
    link_bytes = link_gbit * 1e9 / 8 * goodput_share
    caps = {"link in": link_bytes,
            "link out": link_bytes / served_wire_per_received if served_wire_per_received > 0 else float("inf"),
            "buffer CPU": cores_per_buffer / buffer_cpu_s_per_gb * 1e9}
    bound = min(caps, key=caps.get)
    per_group = caps[bound]
    return [{"groups": g, "receive_bytes_per_s": g * per_group, "receive_samples_per_s": g * per_group / sample_bytes,
             "training_samples_per_s": g * per_group / sample_bytes * replay_ratio, "bound": bound,
             "caps_bytes_per_s": caps} for g in range(1, nodes + 1)]


def equilibrium_samples_per_s(batch: int, cost_s: float, replay_ratio: float, learners: int = 1) -> float:
    """Receive throughput at which learners of `cost_s` per batch of `batch` keep the replay ratio:
    the learners' capacity over the ratio (TianJi's balance n_A TR_A = n_L TR_L / R)."""
    return learners * batch / cost_s / replay_ratio


# --- namespaces and processes ---------------------------------------------------------------------

def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return out


def list_netns() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep(log=print) -> int:
    """Remove every `kbs-` namespace and end the processes inside it (they can only be an earlier run
    of this bench's: it created them there). Returns the namespaces removed."""
    names = ours(list_netns())
    for ns in names:
        for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in names:
        _run(["ip", "netns", "del", ns], check=False)
    if names:
        log(f"removed {len(names)} namespaces left by an earlier run: {' '.join(names)}")
    return len(names)


def _enter_netns(name: str) -> None:
    """Move this process (its only thread, before gRPC starts any) into namespace `name`; ask to be
    ended with the parent."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {name}")
    finally:
        os.close(fd)


def _pdeathsig() -> None:
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def link_bytes(switch: str = SWITCH) -> dict[str, tuple[int, int]]:
    """Per switch-side veth: (bytes into the node, bytes out of the node) so far."""
    data = json.loads(_run(["ip", "-s", "-j", "-n", switch, "link", "show"]).stdout)
    out = {}
    for link in data:
        s = link.get("stats64") or link.get("stats") or {}
        out[link["ifname"]] = (int(s["tx"]["bytes"]), int(s["rx"]["bytes"]))
    return out


def proc_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- synthetic roles (spawned processes; each enters its node's namespace first) ------------------

def fragment_parts(actor_id: str, incarnation: int, shape: tuple[int, int, int]):
    """(header of seq, the constant body, trailer of the creation time, samples) of a DQN fragment of
    uint8 obs [T+1, N, D]: header(seq) + body + trailer(t) is `encode_fragment`'s payload, byte for
    byte, so a synthetic actor encodes the tensors once and only rewrites the two ends."""
    import numpy as np

    from kuberl.v1 import common_pb2 as pb
    from services.common.protocol.fragments import encode_fragment

    T, N, D = shape
    obs = np.random.default_rng(abs(hash(actor_id)) % 2**32).integers(0, 256, (T + 1, N, D), dtype=np.uint8)

    def head(seq: int) -> bytes:
        return pb.TrajectoryFragment(actor_id=actor_id, seq=seq, policy_version=0, algorithm=pb.ALGORITHM_DQN,
                                     env_ids=list(range(N)), num_steps=T, incarnation=incarnation).SerializeToString()

    def tail(t: float) -> bytes:
        return pb.TrajectoryFragment(created_unix_s=t).SerializeToString()

    full = encode_fragment(actor_id=actor_id, seq=0, policy_version=0, algorithm=pb.ALGORITHM_DQN, env_ids=range(N),
                           obs=obs, actions=np.zeros((T, N), np.int64), rewards=np.zeros((T, N), np.float32),
                           terminated=np.zeros((T, N), bool), truncated=np.zeros((T, N), bool),
                           final_obs=np.empty((0, D), np.uint8), final_index=np.empty(0, np.int64),
                           created_unix_s=1.0, incarnation=incarnation).payload
    body = full[len(head(0)):len(full) - len(tail(1.0))]
    return head, body, tail, T * N


# actor counters: 0 samples cut, 1 samples acked, 2 seconds held by the limiter, 3 ready, 4 seconds
# waiting for the link (room), 5 fragments dropped; control: 0 rate (samples/s), 1 stop
def _actor_main(ns: str, address: str, actor_id: str, shape, counters, ctl) -> None:
    _enter_netns(ns)
    import asyncio
    import secrets
    import threading

    import uvloop

    from kuberl.v1 import buffer_pb2_grpc
    from services.actor.limiter import InsertGate
    from services.actor.push import Pusher
    from services.actor.subscribe import watch_insert_limit
    from services.common.config import ActorConfig
    from services.common.protocol.fragments import EncodedFragment
    from services.common.net.grpcutil import MiB, make_channel
    from services.common.stats import Metrics

    sys.setswitchinterval(0.0001)
    incarnation = secrets.randbits(63)
    head, body, tail, samples = fragment_parts(actor_id, incarnation, shape)
    cfg = ActorConfig()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        metrics = Metrics("actor", instance_id=actor_id)
        channel = make_channel(address, 64 * MiB)
        await channel.channel_ready()
        gate = InsertGate(metrics)
        watch = asyncio.create_task(watch_insert_limit(buffer_pb2_grpc.BufferStub(channel), actor_id, incarnation,
                                                       gate, metrics))
        pusher = Pusher(channel, cfg.queue_fragments, cfg.push_ack_interval_s, metrics)
        room = threading.Semaphore(ACTOR_ROOM)
        stop = threading.Event()
        stopping = asyncio.Event()

        def produce() -> None:
            seq, due = 0, time.monotonic()
            while not stop.is_set():
                rate = ctl[0]
                if rate <= 0:
                    time.sleep(0.05)
                    due = time.monotonic()
                    continue
                counters[2] += gate.wait(stop)
                now = time.monotonic()
                if due > now:
                    time.sleep(due - now)
                due = max(due, now) + samples / rate
                t0 = time.monotonic()
                while not room.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                counters[4] += time.monotonic() - t0
                msg = EncodedFragment(seq, samples, head(seq) + body + tail(time.time()))
                gate.cut(seq, samples)
                loop.call_soon_threadsafe(pusher.enqueue, msg)
                counters[0] += samples
                seq += 1

        threading.Thread(target=produce, daemon=True).start()
        push = asyncio.create_task(pusher.run(stopping))
        counters[3] = 1
        released = 0
        while not push.done() and not ctl[1]:
            sent = int(metrics.counters["actor/fragments_pushed_total"])
            for _ in range(sent - released):
                room.release()
            released = sent
            counters[1] = metrics.counters["actor/fragments_acked_total"] * samples
            counters[5] = metrics.counters["actor/fragments_dropped_total"]
            await asyncio.sleep(0.005)
        stop.set()
        watch.cancel()
        push.cancel()

    uvloop.run(main())


# learner counters: 0 batches, 1 samples, 2 busy seconds, 3 ready, 4 bytes received; control: 0 cost s
def _learner_main(ns: str, addresses: list[str], learner_id: str, batch: int, counters, ctl) -> None:
    _enter_netns(ns)
    import asyncio

    import grpc
    import uvloop

    from kuberl.v1 import buffer_pb2, buffer_pb2_grpc
    from kuberl.v1 import common_pb2 as pb
    from services.common.net.grpcutil import MiB, make_channel

    async def main() -> None:
        stubs = []
        for a in addresses:
            ch = make_channel(a, 64 * MiB)
            await ch.channel_ready()
            stubs.append(buffer_pb2_grpc.BufferStub(ch))
        inbox: asyncio.Queue = asyncio.Queue(maxsize=2)     # buffer.batch_prefetch
        consumed = [[0, 0] for _ in stubs]                  # per shard: batches, samples
        progressed = [asyncio.Event() for _ in stubs]
        request = buffer_pb2.BatchRequest(learner_id=learner_id, algorithm=pb.ALGORITHM_DQN, batch_size=batch)

        async def fetch(i: int) -> None:
            while True:
                try:
                    async for b in stubs[i].StreamBatches(request):
                        await inbox.put((i, b.transitions.rewards.shape[0], b.ByteSize()))
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.2)

        async def report(i: int) -> None:
            while True:
                try:
                    await stubs[i].ReportProgress(buffer_pb2.LearnerProgress(
                        learner_id=learner_id, policy_version=int(counters[0]), samples_consumed_total=consumed[i][1],
                        batches_consumed_total=consumed[i][0]), timeout=5)
                except grpc.aio.AioRpcError:
                    pass
                progressed[i].clear()
                try:
                    await asyncio.wait_for(progressed[i].wait(), 1.0)
                except TimeoutError:
                    pass

        tasks = [asyncio.create_task(f(i)) for i in range(len(stubs)) for f in (fetch, report)]
        counters[3] = 1
        while True:
            i, rows, nbytes = await inbox.get()
            t0 = time.monotonic()
            await asyncio.sleep(ctl[0])          # the update: a fixed cost per batch
            counters[2] += time.monotonic() - t0
            consumed[i][0] += 1
            consumed[i][1] += rows
            counters[0] += 1
            counters[1] += rows
            counters[4] += nbytes
            progressed[i].set()
        del tasks

    uvloop.run(main())


def _monitor_main(ns: str, addresses: list[str], conn) -> None:
    """Answers each request on `conn` with every shard's GetStats."""
    _enter_netns(ns)
    import grpc

    from kuberl.v1 import buffer_pb2_grpc
    from kuberl.v1 import common_pb2 as pb

    stubs = [buffer_pb2_grpc.BufferStub(grpc.insecure_channel(a)) for a in addresses]
    while (req := conn.recv()) != "quit":
        out = []
        for s in stubs:
            try:
                out.append(dict(s.GetStats(pb.GetStatsRequest(), timeout=5).metrics))
            except grpc.RpcError:
                out.append({})
        conn.send(out)
    del req


# --- the bench ---------------------------------------------------------------------------------------

class Cluster:
    """Namespaces and the processes in them; `close` removes them all (idempotent)."""

    def __init__(self, args, tmp: Path, log=print):
        self.args, self.tmp, self.log = args, tmp, log
        self.ctx = mp.get_context("spawn")
        self.nodes: list[Node] = []
        self.netns: list[str] = []
        self.buffers: list[subprocess.Popen] = []
        self.procs: list = []
        self.actors: list[dict] = []
        self.learners: list[dict] = []
        self.monitor = None

    # network
    def build(self, nodes: list[Node]) -> None:
        self.nodes = nodes
        for cmd in setup_commands(nodes):
            if cmd[:3] == ["ip", "netns", "add"]:
                self.netns.append(cmd[3])
            _run(cmd)

    def node(self, kind: str, group: int, index: int = 0) -> Node:
        return next(n for n in self.nodes if n.kind == kind and n.group == group and n.index == index)

    # processes
    def buffer_config(self, learning_starts: int) -> dict:
        a = self.args
        return {"algorithm": "dqn",
                "env": {"mode": "external", "observation_shape": [a.obs_bytes], "observation_dtype": "uint8",
                        "num_actions": 2},
                "dqn": {"rollout_steps": a.rollout_steps, "buffer_size": a.replay_size, "batch_size": a.batch,
                        "learning_starts": learning_starts, "replay_ratio": a.replay_ratio, "n_step": 1},
                "buffer": {"max_message_mb": 64}}

    def start_buffers(self, groups: int) -> list[str]:
        import yaml

        cfg = self.tmp / "buffer.yaml"
        cfg.write_text(yaml.safe_dump(self.buffer_config(self.args.learning_starts)))
        readies = []
        for g in range(groups):
            node = self.node("shard", g)
            ready = self.tmp / f"ready-{g}-{time.monotonic_ns()}.json"
            log = open(self.tmp / f"buffer-{g}.log", "ab")
            self.buffers.append(subprocess.Popen(
                ["ip", "netns", "exec", node.name, sys.executable, "-m", "services.buffer", "--config", str(cfg),
                 "--listen", node.address, "--metrics-listen", "127.0.0.1:0", "--ready-file", str(ready)],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_pdeathsig,
                env={**os.environ, "PYTHONPATH": str(ROOT)}))
            log.close()
            readies.append(ready)
        deadline = time.monotonic() + 90
        for g, ready in enumerate(readies):
            while not ready.exists():
                if self.buffers[-groups + g].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"buffer {g} did not start:\n"
                                       + (self.tmp / f"buffer-{g}.log").read_text(errors="replace")[-3000:])
                time.sleep(0.05)
        return [self.node("shard", g).address for g in range(groups)]

    def _spawn(self, target, args) -> mp.Process:
        p = self.ctx.Process(target=target, args=args, daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def start_actor(self, group: int, node_index: int, address: str, rate: float) -> dict:
        a = self.args
        counters, ctl = self.ctx.Array("d", 6, lock=False), self.ctx.Array("d", 2, lock=False)
        ctl[0] = rate
        node = self.node("actor", group, node_index % a.actor_nodes)
        actor_id = f"synthetic-{len(self.actors)}"
        p = self._spawn(_actor_main, (node.name, address, actor_id, (a.rollout_steps, a.envs, a.obs_bytes),
                                      counters, ctl))
        h = {"proc": p, "counters": counters, "ctl": ctl, "group": group, "node": node.name}
        self.actors.append(h)
        return h

    def start_learner(self, group: int, addresses: list[str], cost_s: float) -> dict:
        counters, ctl = self.ctx.Array("d", 5, lock=False), self.ctx.Array("d", 1, lock=False)
        ctl[0] = cost_s
        node = self.node("learner", group)
        p = self._spawn(_learner_main, (node.name, addresses, f"learner-{group}", self.args.batch, counters, ctl))
        h = {"proc": p, "counters": counters, "ctl": ctl, "group": group, "node": node.name}
        self.learners.append(h)
        return h

    def start_monitor(self, addresses: list[str]) -> None:
        parent, child = self.ctx.Pipe()
        p = self._spawn(_monitor_main, (self.node("monitor", -1).name, addresses, child))
        self.monitor = (p, parent)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        for h in self.actors + self.learners:
            while not h["counters"][3]:
                if not h["proc"].is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"a synthetic role on {h['node']} did not start")
                time.sleep(0.05)

    def shard_stats(self) -> list[dict]:
        _, conn = self.monitor
        conn.send("stats")
        if not conn.poll(30):
            raise RuntimeError("the monitor did not answer")
        return conn.recv()

    def pids(self) -> dict[str, list[int]]:
        return {"buffers": [b.pid for b in self.buffers], "actors": [h["proc"].pid for h in self.actors],
                "learners": [h["proc"].pid for h in self.learners]}

    def stop_processes(self) -> None:
        if self.monitor is not None:
            try:
                self.monitor[1].send("quit")
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for b in self.buffers:
            if b.poll() is None:
                b.send_signal(signal.SIGTERM)
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for b in self.buffers:
            try:
                b.wait(10)
            except subprocess.TimeoutExpired:
                b.kill()
                b.wait()
        self.procs, self.buffers, self.actors, self.learners, self.monitor = [], [], [], [], None

    def close(self) -> None:
        self.stop_processes()
        for ns in reversed(self.netns):
            for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", ns], check=False)
        self.netns = []


def measure(cl: Cluster, settle: float, window: float, offered: float) -> dict:
    """One point: wait `settle` s, then measure `window` s."""
    a = cl.args
    time.sleep(settle)
    pids = cl.pids()
    all_pids = [p for v in pids.values() for p in v]

    def snap() -> dict:
        return {"t": time.monotonic(), "stats": cl.shard_stats(), "links": link_bytes(),
                "actors": [list(h["counters"]) for h in cl.actors], "learners": [list(h["counters"]) for h in cl.learners],
                "cpu": {k: [proc_cpu_s(p) for p in v] for k, v in pids.items()}}

    s0 = snap()
    cpu = [parse_proc_stat(Path("/proc/stat").read_text())]
    end = s0["t"] + window
    while time.monotonic() < end:
        time.sleep(min(0.25, max(0.0, end - time.monotonic())))
        cpu.append(parse_proc_stat(Path("/proc/stat").read_text()))
    s1 = snap()
    dt = s1["t"] - s0["t"]

    def stat_rate(name: str) -> float:
        return sum(b.get(name, 0) - a_.get(name, 0) for a_, b in zip(s0["stats"], s1["stats"])) / dt

    received = stat_rate("buffer/samples_received_total")
    served = stat_rate("buffer/samples_served_total")
    trained = sum(b[1] - a_[1] for a_, b in zip(s0["learners"], s1["learners"])) / dt
    learner_busy = max([(b[2] - a_[2]) / dt for a_, b in zip(s0["learners"], s1["learners"])] or [0.0])
    cut = sum(b[0] - a_[0] for a_, b in zip(s0["actors"], s1["actors"])) / dt
    held = sum(b[2] - a_[2] for a_, b in zip(s0["actors"], s1["actors"])) / dt
    dropped = sum(b[5] for b in s1["actors"])
    links = {}
    for n in cl.nodes:
        if n.link_mbit and n.veth in s1["links"]:
            (i0, o0), (i1, o1) = s0["links"][n.veth], s1["links"][n.veth]
            cap = n.link_mbit * 1e6 / 8
            links[n.name] = {"in_util": (i1 - i0) / dt / cap, "out_util": (o1 - o0) / dt / cap,
                             "in_bytes_per_s": (i1 - i0) / dt, "out_bytes_per_s": (o1 - o0) / dt}
    busiest = max(links.items(), key=lambda kv: max(kv[1]["in_util"], kv[1]["out_util"]), default=(None, None))
    util_max = max(busiest[1]["in_util"], busiest[1]["out_util"]) if busiest[1] else 0.0
    verdict = cpu_verdict(cpu, a.cpu_threshold)
    ours_cpu = {k: sum(b - a_ for a_, b in zip(s0["cpu"][k], s1["cpu"][k])) / dt for k in pids}
    sample_bytes = a.obs_bytes * (a.rollout_steps + 1) / a.rollout_steps
    point = {"window_s": dt, "receive_samples_per_s": received, "receive_mb_per_s": received * sample_bytes / MB,
             "training_samples_per_s": trained, "served_samples_per_s": served, "actors_cut_samples_per_s": cut,
             "offered_samples_per_s": offered, "actor_held_share": held / max(1, len(cl.actors)),
             "learner_busy": learner_busy, "fragments_dropped": dropped, "links": links, "busiest_link": busiest[0],
             "link_util_max": util_max, "cpu": verdict, "our_cpu_cores": ours_cpu,
             "buffer_cpu_cores": [b - a_ for a_, b in zip(s0["cpu"]["buffers"], s1["cpu"]["buffers"])],
             "all_pids": len(all_pids)}
    point["buffer_cpu_cores"] = [c / dt for c in point["buffer_cpu_cores"]]
    ours_total = sum(ours_cpu.values())
    point["others_cpu_cores"] = others_cores(verdict, ours_total, os.cpu_count() or 1)
    point["shard_link_util_min"] = shard_link_util(links)
    point["bottleneck"] = analyze(point)
    return point


def describe(p: dict) -> str:
    c = p["cpu"]
    return (f"receive {p['receive_samples_per_s']:>7,.0f} samples/s ({p['receive_mb_per_s']:5.1f} MB/s), training "
            f"{p['training_samples_per_s']:>7,.0f}; busiest link {p['busiest_link']} {p['link_util_max']:.0%}; "
            f"learner busy {p['learner_busy']:.0%}; CPU busy {c['busy_median']:.0%} (ours "
            f"{sum(p['our_cpu_cores'].values()):.2f} cores, others {p['others_cpu_cores'] or 0:.2f}) -> {p['bottleneck']}")


def panel_ab(cl: Cluster, costs: list[float], actor_counts: list[int], settle: float, window: float) -> list[dict]:
    """One group; for each learner cost, actors 1..max at `--actor-rate` each (started once, switched on)."""
    a = cl.args
    cl.build(plan_topology(1, a.actor_nodes, a.link_mbit)) if not cl.nodes else None
    addresses = cl.start_buffers(1)
    cl.start_monitor(addresses)
    learner = cl.start_learner(0, addresses, costs[0])
    for i in range(max(actor_counts)):
        cl.start_actor(0, i, addresses[0], 0.0)
    cl.wait_ready()
    rows = []
    try:
        for cost in costs:
            learner["ctl"][0] = cost
            eq = equilibrium_samples_per_s(a.batch, cost, a.replay_ratio)
            cl.log(f"learner {cost:g} s per batch of {a.batch} (capacity {a.batch / cost:,.0f} samples/s, "
                   f"equilibrium receive {eq:,.0f} samples/s at replay ratio {a.replay_ratio:g})")
            for k in actor_counts:
                for i, h in enumerate(cl.actors):
                    h["ctl"][0] = a.actor_rate if i < k else 0.0
                p = measure(cl, settle, window, k * a.actor_rate)
                p.update(learner_cost_s=cost, actors=k, equilibrium_samples_per_s=eq)
                rows.append(p)
                cl.log(f"  {k:>2} actors: {describe(p)}")
    finally:
        cl.stop_processes()
    return rows


def panel_c(cl: Cluster, group_counts: list[int], settle: float, window: float) -> list[dict]:
    a = cl.args
    rows = []
    for g in group_counts:
        addresses = cl.start_buffers(g)
        try:
            cl.start_monitor(addresses)
            for i in range(g):
                cl.start_learner(i, addresses, a.group_learner_cost)
            for grp, slot in actor_placement(g * a.group_actors, g):
                cl.start_actor(grp, slot, addresses[grp], a.group_actor_rate)
            cl.wait_ready()
            p = measure(cl, settle, window, g * a.group_actors * a.group_actor_rate)
            p.update(groups=g, processes=p["all_pids"])
            rows.append(p)
            cl.log(f"  {g} group(s): {describe(p)}")
        finally:
            cl.stop_processes()
    return rows


def idle_cpu(seconds: float, threshold: float) -> dict:
    samples = [parse_proc_stat(Path("/proc/stat").read_text())]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.25)
        samples.append(parse_proc_stat(Path("/proc/stat").read_text()))
    return cpu_verdict(samples, threshold)


def summarize_c(rows: list[dict]) -> dict:
    """Scaling efficiency of (c) and where the CPU became the limit."""
    if not rows:
        return {}
    base = rows[0]["receive_samples_per_s"] / rows[0]["groups"]
    for r in rows:
        r["efficiency"] = r["receive_samples_per_s"] / (r["groups"] * base)
    cpu_bound = [r["groups"] for r in rows if r["bottleneck"] == "CPU-bound"
                 or (r["cpu"]["saturated"] and r["efficiency"] < 0.9)]
    link_bound = [r["groups"] for r in rows if r["bottleneck"] == "link-bound"]
    first = next((r for r in rows if r["groups"] in cpu_bound), None)
    ours_per_group = sum(rows[0]["our_cpu_cores"].values()) / rows[0]["groups"]
    return {"per_group_receive_samples_per_s_at_1": base, "cpu_bound_from_groups": min(cpu_bound) if cpu_bound else None,
            "at_cpu_limit": None if first is None else {
                "groups": first["groups"], "our_cores": sum(first["our_cpu_cores"].values()),
                "others_cores": first["others_cpu_cores"], "busy_median": first["cpu"]["busy_median"]},
            "link_bound_groups": link_bound, "our_cores_per_group": ours_per_group,
            # what the bench's own processes would fit in this machine's cores, had it no other users
            "groups_fitting_cores_alone": groups_fitting(os.cpu_count() or 1, ours_per_group),
            "peak_receive_samples_per_s": max(r["receive_samples_per_s"] for r in rows)}


def projection(result: dict, args) -> dict:
    """The 8-node projection from what (c) measured in its link-bound points."""
    rows = [r for r in result.get("c", []) if r["bottleneck"] == "link-bound"] or result.get("c", [])
    if not rows:
        return {}
    sample_bytes = args.obs_bytes * (args.rollout_steps + 1) / args.rollout_steps
    shard_links = [v for r in rows for v in active_shard_links(r["links"])]
    wire_in = statistics.median(v["in_bytes_per_s"] for v in shard_links)
    wire_out = statistics.median(v["out_bytes_per_s"] for v in shard_links)
    per_shard_goodput = statistics.median(r["receive_samples_per_s"] / r["groups"] for r in rows) * sample_bytes
    goodput_share = per_shard_goodput / (args.link_mbit * 1e6 / 8)
    buffer_cpu = statistics.median(sum(r["buffer_cpu_cores"]) / (r["receive_samples_per_s"] * sample_bytes / 1e9)
                                   for r in rows)
    assumptions = [
        f"one replicated group per node (a buffer shard and a learner), {args.project_nodes} nodes, each with a "
        f"full-duplex {args.project_nic_gbit:g} Gbit/s NIC into a non-blocking switch (the NIC speed of the "
        "paper's testbed is an assumption here: pass --project-nic-gbit)",
        "actors push to a shard on another node (a Deployment's pods land anywhere), so every received byte "
        "crosses the shard's NIC, as on the simulated links here",
        f"the goodput share measured here ({goodput_share:.2f} of the line rate: gRPC, HTTP/2, TCP/IP and "
        "Ethernet framing, the ack and limiter streams) carries over to the faster NIC",
        f"a shard sends {wire_out / wire_in:.2f} bytes of batches per byte it receives (measured: replay ratio "
        f"{args.replay_ratio:g}, obs and next_obs per sample)",
        f"a buffer is one event loop: at most one core, at the CPU cost measured here ({buffer_cpu:.2f} s per GB "
        "received, batches served included) on this machine's cores",
        "learners keep up (GPU learners sized to the replay ratio times receive) and actors produce more than "
        "a link carries: the projection is of the data path, not of a training run",
        "latency is not modelled (no netem here): a real network's RTT only matters where the HTTP/2 windows "
        "do not cover the bandwidth-delay product",
    ]
    rows8 = project(args.project_nodes, link_gbit=args.project_nic_gbit, goodput_share=goodput_share,
                    served_wire_per_received=wire_out / wire_in, buffer_cpu_s_per_gb=buffer_cpu,
                    replay_ratio=args.replay_ratio, sample_bytes=sample_bytes)
    return {"measured": {"per_shard_goodput_bytes_per_s": per_shard_goodput, "goodput_share": goodput_share,
                         "served_wire_per_received_wire": wire_out / wire_in, "buffer_cpu_s_per_gb": buffer_cpu,
                         "sample_bytes": sample_bytes, "link_mbit": args.link_mbit},
            "assumptions": assumptions, "rows": rows8}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    a = result["args"]
    ab = result.get("ab", [])
    ax = axes[0]
    rows = [r for r in ab if r["learner_cost_s"] == a["learner_cost"]]
    if rows:
        k = [r["actors"] for r in rows]
        ax.plot(k, [r["receive_samples_per_s"] for r in rows], "o-", label="receive (buffer)")
        ax.plot(k, [r["training_samples_per_s"] for r in rows], "s-", label="training (learner)")
        ax.plot(k, [r["offered_samples_per_s"] for r in rows], ":", color="grey", label="actors' set rate")
        ax.axhline(rows[0]["equilibrium_samples_per_s"], ls="--", color="C0", alpha=0.6,
                   label="equilibrium: learner capacity / R")
        for r in rows:
            if r["bottleneck"] == "CPU-bound":
                ax.plot(r["actors"], r["receive_samples_per_s"], "rx", ms=10)
    ax.set_xlabel("actors")
    ax.set_ylabel("samples/s")
    ax.set_title(f"(a) one shard, learner {a['learner_cost']:g} s/batch")
    ax = axes[1]
    for i, cost in enumerate(sorted({r["learner_cost_s"] for r in ab}, reverse=True)):
        rows = [r for r in ab if r["learner_cost_s"] == cost]
        ax.plot([r["actors"] for r in rows], [r["receive_samples_per_s"] for r in rows], "o-", color=f"C{i}",
                label=f"{cost:g} s/batch")
        ax.axhline(rows[0]["equilibrium_samples_per_s"], ls="--", color=f"C{i}", alpha=0.5)
        for r in rows:
            if r["bottleneck"] == "CPU-bound":
                ax.plot(r["actors"], r["receive_samples_per_s"], "rx", ms=10)
    if ab:
        cap = a["link_mbit"] * 1e6 / 8 / (a["obs_bytes"] * (a["rollout_steps"] + 1) / a["rollout_steps"])
        ax.axhline(cap, color="k", lw=0.8, label=f"{a['link_mbit']:g} Mbit/s link, payload only")
    ax.set_xlabel("actors")
    ax.set_ylabel("receive samples/s")
    ax.set_title("(b) equilibrium moves with learner capacity (dashed)")
    ax = axes[2]
    rows = result.get("c", [])
    if rows:
        g = [r["groups"] for r in rows]
        ax.plot(g, [r["receive_samples_per_s"] for r in rows], "o-", label="receive")
        ax.plot(g, [r["training_samples_per_s"] for r in rows], "s-", label="training")
        base = rows[0]["receive_samples_per_s"] / rows[0]["groups"]
        ax.plot(g, [x * base for x in g], ":", color="grey", label="linear from 1 group")
        for r in rows:
            if r["bottleneck"] == "CPU-bound":
                ax.plot(r["groups"], r["receive_samples_per_s"], "rx", ms=12)
        ax.plot([], [], "rx", label="CPU-bound point")
    ax.set_xlabel("replicated groups (shards + learners)")
    ax.set_ylabel("samples/s")
    ax.set_title("(c) scaling groups on simulated nodes")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def reanalyze(src: Path, out: Path) -> int:
    result = json.loads(src.read_text())
    args = argparse.Namespace(**result["args"])
    for r in result.get("ab", []) + result.get("c", []):
        r["shard_link_util_min"] = shard_link_util(r["links"])
        r["bottleneck"] = analyze(r)
    if result.get("c"):
        result["c_summary"] = summarize_c(result["c"])
        result["projection"] = projection(result, args)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: few points, short windows")
    p.add_argument("--panels", default="abc", help="which of a/b (together) and c to run")
    p.add_argument("--link-mbit", type=float, default=100.0, help="every node's link rate, each direction")
    p.add_argument("--actor-nodes", type=int, default=2, help="actor nodes per group")
    p.add_argument("--obs-bytes", type=int, default=1024, help="uint8 observation bytes per sample")
    p.add_argument("--rollout-steps", type=int, default=16)
    p.add_argument("--envs", type=int, default=4, help="envs per fragment: samples per fragment = steps x envs")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--replay-ratio", type=float, default=0.25,
                   help="samples trained per sample inserted (Ape-X's is about 0.2)")
    p.add_argument("--replay-size", type=int, default=16384, help="transitions per shard")
    p.add_argument("--learning-starts", type=int, default=2048)
    p.add_argument("--actor-rate", type=float, default=1000.0, help="(a, b): samples/s per actor")
    p.add_argument("--learner-cost", type=float, default=0.25, help="(a): seconds per batch")
    p.add_argument("--costs", default="0.5,0.25,0.125,0.0625", help="(b): learner seconds per batch")
    p.add_argument("--actors", default="1,2,3,4,6,8,12,16", help="(a, b): actor counts")
    p.add_argument("--groups", default="1,2,3,4,6", help="(c): replicated group counts")
    p.add_argument("--group-actors", type=int, default=3, help="(c): actors per group")
    p.add_argument("--group-actor-rate", type=float, default=5000.0, help="(c): samples/s per actor")
    p.add_argument("--group-learner-cost", type=float, default=0.05, help="(c): learner seconds per batch")
    p.add_argument("--settle", type=float, default=4.0)
    p.add_argument("--window", type=float, default=6.0)
    p.add_argument("--cpu-threshold", type=float, default=0.9, help="median busy share that makes a point CPU-bound")
    p.add_argument("--project-nodes", type=int, default=8)
    p.add_argument("--project-nic-gbit", type=float, default=10.0)
    p.add_argument("--out", default=str(ROOT / "docs" / "scaling"), help="writes OUT.json and OUT.png")
    p.add_argument("--reanalyze", metavar="JSON", help="re-derive verdicts, summary, projection and plot from a "
                   "recorded run's JSON (no namespaces, no root), writing OUT.json and OUT.png")
    args = p.parse_args(argv)
    if args.reanalyze:
        return reanalyze(Path(args.reanalyze), Path(args.out))
    if args.quick:
        args.actors, args.costs, args.groups = "1,4,8", "0.25,0.0625", "1,2"
        args.settle, args.window = 3.0, 3.0
    if os.geteuid() != 0:
        print("bench/scaling.py needs root (network namespaces, veth, tc)", file=sys.stderr)
        return 2
    actor_counts = [int(x) for x in args.actors.split(",")]
    costs = [float(x) for x in args.costs.split(",")]
    if args.learner_cost not in costs:
        costs.insert(0, args.learner_cost)
    groups = [int(x) for x in args.groups.split(",")]

    sweep()
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
                    "python": sys.version.split()[0], "args": vars(args)}
    result["idle_cpu"] = idle_cpu(3.0, args.cpu_threshold)
    print(f"machine before the run: CPU busy {result['idle_cpu']['busy_median']:.0%} (median of 0.25 s intervals)")
    with tempfile.TemporaryDirectory(prefix="kbs-") as tmp:
        cl = Cluster(args, Path(tmp))
        atexit.register(cl.close)

        def on_term(signum, frame):
            raise SystemExit(128 + signum)

        old = signal.signal(signal.SIGTERM, on_term)
        old_int = signal.signal(signal.SIGINT, signal.default_int_handler)   # even when started in the background
        try:
            cl.build(plan_topology(max(groups) if "c" in args.panels else 1, args.actor_nodes, args.link_mbit))
            print(f"{len(cl.netns)} namespaces, links {args.link_mbit:g} Mbit/s each way (tbf)")
            if "a" in args.panels or "b" in args.panels:
                print("\n(a, b) one shard, one learner; actors at "
                      f"{args.actor_rate:,.0f} samples/s ({args.actor_rate * args.obs_bytes / MB:.1f} MB/s) each")
                result["ab"] = panel_ab(cl, costs, actor_counts, args.settle, args.window)
            if "c" in args.panels:
                print(f"\n(c) G groups: G shards, G learners ({args.group_learner_cost:g} s/batch) each streaming "
                      f"from every shard, {args.group_actors} actors per group at {args.group_actor_rate:,.0f} samples/s")
                result["c"] = panel_c(cl, groups, args.settle + 2, args.window)
                result["c_summary"] = summarize_c(result["c"])
                result["projection"] = projection(result, args)
        finally:
            cl.close()
            signal.signal(signal.SIGTERM, old)
            signal.signal(signal.SIGINT, old_int)
            atexit.unregister(cl.close)
    left = ours(list_netns())
    result["leftover_namespaces"] = left
    s = result.get("c_summary") or {}
    if s:
        where = s["cpu_bound_from_groups"]
        at = s["at_cpu_limit"]
        print("\nCPU limit: " + (f"this machine's CPU is the limit from {where} groups on (our processes "
                                 f"{at['our_cores']:.2f} cores, other work {at['others_cores'] or 0:.2f})" if where
                                 else "not reached in the group counts measured"))
    proj = result.get("projection") or {}
    for r in proj.get("rows", []):
        print(f"projection {r['groups']} node(s): receive {r['receive_bytes_per_s'] / 1e9:.2f} GB/s, "
              f"{r['receive_samples_per_s']:,.0f} samples/s, training {r['training_samples_per_s']:,.0f} ({r['bound']})")
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=lambda o: asdict(o)) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}; namespaces left: {left or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
