"""Malformed requests against the four services: every RPC found through server reflection gets
garbage frames, and every answer's status code is counted.

    .venv/bin/python -m bench.fuzz [--calls-per-rpc 60] [--seconds 600] [--seed 0] [--out docs/fuzz.json]

The buffer, learner, actor (env.mode external, so EnvSession reads what it is sent) and planner (on
an in-memory backend that changes nothing) each run as a process of their own on 127.0.0.1, port 0,
entered through the service's own `serving(cfg)` as `python -m services.<role>` does (this module
with `--serve ROLE`). This process lists each server's services through gRPC server reflection,
builds the request types from the descriptors it returns, and sends every RPC of the kuberl
services (`--include-grpc` adds health and reflection) frames of these kinds, to 127.0.0.1 only:

    random_bytes       1..64 random bytes
    truncated          a valid, randomly filled request cut short
    wrong_wire_type    a valid request plus a known field under another wire type (protobuf keeps
                       a mismatched wire type as an unknown field, so many of these still parse)
    invalid_wire_type  a field with wire type 6 or 7
    oversized_varint   a varint of 11 bytes, or one that never ends
    length_overflow    a length-delimited field longer than what follows
    invalid_utf8       a string field that is not UTF-8
    field_zero         a field numbered 0
    nested_garbage     a message-typed field whose bytes are garbage
    other_type         a valid request of another RPC
    empty              no bytes at all (the default message)
    oversize           one frame over the server's max_receive_message_length

A frame is `garbage` when the request type's own parser refuses it, `well_formed` when it parses
(however nonsensical its contents). Client-streaming and bidirectional RPCs get 0-2 good messages
(a valid fragment, a valid EnvSession hello) before the frame, and client streams 0-2 after it.
Expected: garbage -> INVALID_ARGUMENT, oversize -> RESOURCE_EXHAUSTED (refused by gRPC before any
handler runs), well-formed -> anything the service decides except UNKNOWN or INTERNAL (for
response streams the fuzzer reads one response, counted as STREAMING, or gives up after
`--stream-wait-s`, counted as DEADLINE_EXCEEDED). After each RPC's calls the server must still
answer a health check (else it counts as a death), and at the end a GetStats; a stream that another
client opened before the fuzzing (a "bystander": a push, a session, a subscription, a watch) must
still work.

Prints per service: calls tried, deaths, the count of each status code, UNKNOWN and INTERNAL, and
any call that did not get what was expected; writes the same as JSON (`--out`).
tests/integration/test_fuzz.py runs a smaller fuzz of each service in-process with the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import itertools
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kuberl.v1 import actor_pb2, buffer_pb2
from kuberl.v1 import common_pb2 as pb
from services.common.net.tls import TlsConfig
from services.config import config_from_dict
from services.common.net.tls import open_channel
from tests.fragments import make_fragment
from tests.helpers import ROOT, TINY_PPO

MiB = 1 << 20
CALL_TIMEOUT_S = 60.0   # upper bound for an answer on a loaded machine; nothing is judged by time
ROLES = ("buffer", "learner", "actor", "planner")
SERVICES = {"buffer": "kuberl.v1.Buffer", "learner": "kuberl.v1.Learner", "actor": "kuberl.v1.Actor",
            "planner": "kuberl.v1.Planner"}
KINDS = ("random_bytes", "truncated", "wrong_wire_type", "invalid_wire_type", "oversized_varint",
         "length_overflow", "invalid_utf8", "field_zero", "nested_garbage", "other_type", "empty")
EXPECTED = {"garbage": "INVALID_ARGUMENT", "oversize": "RESOURCE_EXHAUSTED"}
NEVER = ("UNKNOWN", "INTERNAL")


def fuzz_config() -> dict:
    """TINY_PPO with external simulators (EnvSession parses what it is sent), 1 MiB messages (the
    oversize frame stays small) and sessions that outlive the fuzzing (the actor's bystander)."""
    cfg = copy.deepcopy(TINY_PPO)
    cfg["env"] = {"id": "CartPole-v1", "mode": "external"}
    cfg["buffer"] = {"max_message_mb": 1}
    cfg["actor"].update({"session_timeout_s": 3600.0})
    cfg["planner"] = {"enabled": False}  # no periodic decisions: the RPCs drive it
    return cfg


def max_message_bytes(role: str, cfg: dict) -> int:
    return 4 * MiB if role == "planner" else cfg["buffer"]["max_message_mb"] * MiB  # see services/<role>/main.py


# -- the services -------------------------------------------------------------------------------------
class FixedBackend:
    """A planner backend with one actor and one learner (no addresses) that applies nothing."""
    name, leader = "fixed", True

    async def start(self) -> None:
        pass

    async def observe(self):
        from services.planner.backend import RoleState
        return {role: RoleState(desired=1) for role in ("actor", "learner")}  # no replica to read stats from

    async def buffers(self):
        return []

    async def apply(self, targets: dict[str, int], *, dry_run: bool = False):
        from services.planner.backend import ApplyResult
        return ApplyResult(applied=dict(targets), dry_run=True, detail="fuzz: nothing is applied")

    async def close(self) -> None:
        pass


@asynccontextmanager
async def serve_role(role: str, cfg: dict, workdir: Path, *, buffer: str = "", learner: str = ""):
    """Run one service in this process through its own `serving(cfg)`; yields its gRPC address."""
    config, listen = config_from_dict(cfg), "127.0.0.1:0"
    if role == "buffer":
        from services.buffer import main as buffer_main
        async with buffer_main.serving(config, listen=listen) as ep:
            yield ep.grpc
    elif role == "learner":
        from services.learner import main as learner_main
        async with learner_main.serving(config, listen=listen, buffer=buffer,
                                        checkpoint_dir=str(workdir / "checkpoints")) as ep:
            yield ep.grpc
    elif role == "actor":
        from services.actor import main as actor_main
        async with actor_main.serving(config, listen=listen, buffer=buffer, learner=learner,
                                      actor_id="fuzz-actor") as ep:
            yield ep.grpc
    elif role == "planner":
        from services.planner import main as planner_main
        async with planner_main.serving(config, FixedBackend(), listen=listen) as (ep, _):
            yield ep.grpc
    else:
        raise ValueError(role)


@asynccontextmanager
async def serve_in_process(roles, cfg: dict, workdir: Path):
    """The services `roles` need (an actor needs a learner and a buffer), in this process:
    yields {role: address} for every one started."""
    need = set(roles)
    if "actor" in need:
        need |= {"learner", "buffer"}
    if "learner" in need:
        need.add("buffer")
    addresses: dict[str, str] = {}
    async with AsyncExitStack() as stack:
        for role in ROLES:
            if role in need:
                addresses[role] = await stack.enter_async_context(serve_role(
                    role, cfg, workdir, buffer=addresses.get("buffer", ""), learner=addresses.get("learner", "")))
        yield addresses


class Process:
    """One service in a process of its own (`python -m bench.fuzz --serve ROLE`)."""

    def __init__(self, role: str, config: Path, workdir: Path, **peers: str):
        self.role, self.ready, self.log = role, workdir / f"{role}.ready", workdir / f"{role}.log"
        cmd = [sys.executable, "-m", "bench.fuzz", "--serve", role, "--config", str(config),
               "--workdir", str(workdir), "--ready", str(self.ready),
               *[a for k, v in peers.items() for a in (f"--{k}", v)]]
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300.0) -> str:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.role} did not start:\n{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        return json.loads(self.ready.read_text())["address"]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def _serve_main(args: argparse.Namespace) -> int:
    """`--serve ROLE`: run one service until SIGTERM, as services/<role>/__main__ does."""
    from services.common.service.runtime import run_service

    cfg = json.loads(Path(args.config).read_text())

    async def serve(_, stop: asyncio.Event) -> None:
        async with serve_role(args.serve, cfg, Path(args.workdir), buffer=args.buffer, learner=args.learner) as address:
            tmp = Path(args.ready).with_suffix(".tmp")
            tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
            tmp.replace(args.ready)
            await stop.wait()

    return run_service(args.serve, argparse.Namespace(log_level="WARNING"), serve)


# -- discovery ----------------------------------------------------------------------------------------
@dataclass
class Rpc:
    service: str
    method: str
    input: object               # the request message class, built from the reflected descriptor
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method}"


def _discover(address: str, include_grpc: bool, tls: TlsConfig | None) -> list[Rpc]:
    with open_channel(address, tls) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        pool = descriptor_pool.DescriptorPool(db)
        rpcs = []
        for name in sorted(db.get_services()):
            if name.startswith("grpc.") and not include_grpc:
                continue
            for m in pool.FindServiceByName(name).methods:
                rpcs.append(Rpc(name, m.name, message_factory.GetMessageClass(m.input_type),
                                m.client_streaming, m.server_streaming))
        return rpcs


async def discover(address: str, include_grpc: bool = False, tls: TlsConfig | None = None) -> list[Rpc]:
    """Every RPC the server at `address` lists through reflection (a blocking client, in a thread:
    the server may be running on this event loop)."""
    return await asyncio.to_thread(_discover, address, include_grpc, tls)


# -- frames -------------------------------------------------------------------------------------------
VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5
_I64_TYPES = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}
_I32_TYPES = {FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32}
_LEN_TYPES = {FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE}


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def wire_type_of(f: FieldDescriptor) -> int:
    return (I64 if f.type in _I64_TYPES else I32 if f.type in _I32_TYPES else LEN if f.type in _LEN_TYPES
            else SGROUP if f.type == FieldDescriptor.TYPE_GROUP else VARINT)


def random_message(cls, rng: random.Random, fill: float = 0.6, depth: int = 0):
    """An instance of `cls` with random values in about `fill` of its fields (nested to depth 2)."""
    msg = cls()
    for f in cls.DESCRIPTOR.fields:
        if rng.random() > fill:
            continue
        if f.message_type is not None:
            if depth >= 2 or f.message_type.GetOptions().map_entry:
                continue
            sub = random_message(message_factory.GetMessageClass(f.message_type), rng, fill, depth + 1)
            (getattr(msg, f.name).add() if f.is_repeated else getattr(msg, f.name)).CopyFrom(sub)
            continue
        values = [_random_scalar(f, rng) for _ in range(rng.randint(1, 3) if f.is_repeated else 1)]
        if f.is_repeated:
            getattr(msg, f.name).extend(values)
        else:
            setattr(msg, f.name, values[0])
    return msg


def _random_scalar(f: FieldDescriptor, rng: random.Random):
    c = f.cpp_type
    if c == FieldDescriptor.CPPTYPE_STRING:
        return (rng.randbytes(rng.randint(0, 16)) if f.type == FieldDescriptor.TYPE_BYTES
                else "".join(rng.choice("abcxyz-0189é") for _ in range(rng.randint(0, 16))))
    if c == FieldDescriptor.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if c in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
        return rng.choice([0.0, -1.0, 1e30, float("inf"), float("nan"), rng.uniform(-1e3, 1e3)])
    if c == FieldDescriptor.CPPTYPE_ENUM:
        return rng.choice([v.number for v in f.enum_type.values] + [rng.randint(-5, 1000)])
    bits = 32 if c in (FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_UINT32) else 64
    if c in (FieldDescriptor.CPPTYPE_UINT32, FieldDescriptor.CPPTYPE_UINT64):
        return rng.choice([0, 1, 2, 255, (1 << bits) - 1, rng.randrange(1 << bits)])
    return rng.choice([0, 1, -1, (1 << (bits - 1)) - 1, -(1 << (bits - 1)), rng.randint(-1000, 1000)])


class Frames:
    """Malformed frames for the RPCs of one server, drawn from `rng`."""

    def __init__(self, rng: random.Random, rpcs: list[Rpc]):
        self.rng, self.types = rng, [r.input for r in rpcs]

    def make(self, kind: str, rpc: Rpc) -> bytes:
        return getattr(self, kind)(rpc.input)

    def _sample(self, cls) -> bytes:
        for _ in range(8):  # a non-empty one where the type has fields
            data = random_message(cls, self.rng, fill=0.8).SerializeToString()
            if data:
                return data
        return data

    def _field(self, cls, want=None) -> FieldDescriptor | None:
        fields = [f for f in cls.DESCRIPTOR.fields if want is None or want(f)]
        return self.rng.choice(fields) if fields else None

    def random_bytes(self, cls) -> bytes:
        return self.rng.randbytes(self.rng.randint(1, 64))

    def truncated(self, cls) -> bytes:
        data = self._sample(cls)
        return data[:self.rng.randint(1, len(data) - 1)] if len(data) > 1 else b"\x0a"

    def wrong_wire_type(self, cls) -> bytes:
        f = self._field(cls)
        number, natural = (f.number, wire_type_of(f)) if f else (self.rng.randint(1, 20), VARINT)
        wt = self.rng.choice([w for w in (VARINT, I64, LEN, SGROUP, EGROUP, I32) if w != natural])
        payload = {VARINT: varint(self.rng.randrange(1 << 64)), I64: self.rng.randbytes(8), I32: self.rng.randbytes(4),
                   LEN: varint(3) + self.rng.randbytes(3), SGROUP: b"", EGROUP: b""}[wt]
        return self._sample(cls) + tag(number, wt) + payload

    def invalid_wire_type(self, cls) -> bytes:
        return self._sample(cls) + tag(self.rng.randint(1, 30), self.rng.choice([6, 7])) + self.rng.randbytes(4)

    def oversized_varint(self, cls) -> bytes:
        f = self._field(cls, lambda f: wire_type_of(f) == VARINT)
        number = f.number if f else 1
        return self.rng.choice([
            tag(number, VARINT) + b"\xff" * 10 + b"\x01",         # 11 bytes: more than 64 bits
            tag(number, VARINT) + b"\x80" * self.rng.randint(1, 9),  # never ends
            b"\xff" * 11 + b"\x01",                               # a tag of 12 bytes
        ])

    def length_overflow(self, cls) -> bytes:
        f = self._field(cls, lambda f: wire_type_of(f) == LEN)
        number = f.number if f else self.rng.randint(1, 20)
        body = self.rng.randbytes(self.rng.randint(0, 8))
        return tag(number, LEN) + varint(len(body) + self.rng.choice([1, 100, 1 << 31, (1 << 64) - 1])) + body

    def invalid_utf8(self, cls) -> bytes:
        f = self._field(cls, lambda f: f.type == FieldDescriptor.TYPE_STRING)
        if f is None:
            return self.length_overflow(cls)
        bad = self.rng.choice([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"ok\x80"])
        return tag(f.number, LEN) + varint(len(bad)) + bad

    def field_zero(self, cls) -> bytes:
        return tag(0, self.rng.choice([VARINT, LEN])) + varint(1) + b"\x00"

    def nested_garbage(self, cls) -> bytes:
        f = self._field(cls, lambda f: f.type == FieldDescriptor.TYPE_MESSAGE)
        if f is None:
            return self.random_bytes(cls)
        bad = self.rng.choice([b"\xff" * 5, b"\x08", b"\x0a\x7f", tag(0, VARINT) + b"\x01"])
        return tag(f.number, LEN) + varint(len(bad)) + bad

    def other_type(self, cls) -> bytes:
        others = [t for t in self.types if t.DESCRIPTOR.full_name != cls.DESCRIPTOR.full_name] or self.types
        return random_message(self.rng.choice(others), self.rng).SerializeToString()

    def empty(self, cls) -> bytes:
        return b""


def parses(cls, data: bytes) -> bool:
    try:
        cls.FromString(data)
        return True
    except Exception:  # google.protobuf.message.DecodeError; anything else counts as garbage too
        return False


_calls = itertools.count()  # unique session ids and actor ids


def good_messages(rpc: Rpc) -> list[bytes]:
    """Messages a client stream may start with that the service accepts, so that it reads on."""
    n = next(_calls)
    if rpc.path == "/kuberl.v1.Actor/EnvSession":
        hello = actor_pb2.EnvHello(
            session_id=f"fuzz-{n}", num_envs=1, simulator="bench.fuzz",
            observation_space=actor_pb2.Space(box=actor_pb2.BoxSpace(shape=[4], dtype=pb.DTYPE_FLOAT32)),
            action_space=actor_pb2.Space(discrete=actor_pb2.DiscreteSpace(n=2)))
        return [actor_pb2.EnvMessage(hello=hello).SerializeToString()]  # hello, exactly once
    if rpc.path == "/kuberl.v1.Buffer/PushTrajectories":
        return [make_fragment(actor_id=f"fuzz-{n}", seq=s).SerializeToString() for s in range(2)]
    return []  # unknown protocol: the frame goes first


# -- calls --------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    rpc: str
    kind: str       # a KINDS entry or "oversize"
    frame: str      # "garbage", "well_formed" or "oversize"
    code: str       # a status code name, or STREAMING (a response stream was open and answering)
    details: str
    sample: str     # the frame's first bytes, hex

    @property
    def expected(self) -> bool:
        return self.code not in NEVER and self.code == EXPECTED.get(self.frame, self.code)


async def _invoke(channel: grpc.aio.Channel, rpc: Rpc, frames: list[bytes], timeout: float,
                  stream_wait_s: float) -> tuple[str, str]:
    """Send `frames` (one, for a unary request) as they are; (status code name, details)."""
    if not rpc.client_streaming:
        if not rpc.server_streaming:
            try:
                await channel.unary_unary(rpc.path)(frames[0], timeout=timeout)
                return "OK", ""
            except grpc.aio.AioRpcError as err:
                return err.code().name, err.details() or ""
        call = channel.unary_stream(rpc.path)(frames[0], timeout=timeout)
        try:
            async with asyncio.timeout(stream_wait_s):
                async for _ in call:
                    return "STREAMING", "answered with a response stream"
            return "OK", ""
        except grpc.aio.AioRpcError as err:
            return err.code().name, err.details() or ""
        except TimeoutError:
            return "DEADLINE_EXCEEDED", f"no response or status within {stream_wait_s:g} s (stream open)"
        finally:
            call.cancel()
    factory = channel.stream_stream if rpc.server_streaming else channel.stream_unary
    call = factory(rpc.path)(timeout=timeout)
    try:
        for data in frames:
            await call.write(data)
        await call.done_writing()
    except Exception:
        # The RPC already ended: its status says why. (grpc.aio raises InvalidStateError, an
        # INTERNAL AioRpcError, or from done_writing an error of a private grpcio type.)
        pass
    try:
        if rpc.server_streaming:
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError:
        pass
    return (await call.code()).name, await call.details() or ""


async def _healthy(channel: grpc.aio.Channel) -> bool:
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.aio.AioRpcError:
        return False


class Bystander:
    """A well-behaved client of the service with a stream open while the service is fuzzed:
    `start()` opens it (and sees it answered), `still_fine()` checks that it still works."""

    def __init__(self, channel: grpc.aio.Channel, service: str):
        self.channel, self.service, self.call = channel, service, None

    async def start(self) -> None:
        ch = self.channel
        if self.service == "kuberl.v1.Actor":    # a simulator's session, accepted
            self.call = ch.stream_stream("/kuberl.v1.Actor/EnvSession")(timeout=3600)
            await self.call.write(good_messages(Rpc(self.service, "EnvSession", None, True, True))[0])
            await self.call.read()
        elif self.service == "kuberl.v1.Buffer":  # an actor's push stream, one fragment written
            self.call = ch.stream_unary("/kuberl.v1.Buffer/PushTrajectories")(timeout=3600)
            await self.call.write(make_fragment(actor_id="bystander", seq=0).SerializeToString())
        elif self.service == "kuberl.v1.Learner":  # an actor's weights subscription, first weights read
            self.call = ch.unary_stream("/kuberl.v1.Learner/SubscribeWeights")(
                b"\x0a\x09bystander", timeout=3600)  # WeightsRequest{subscriber_id: "bystander"}
            await self.call.read()
        elif self.service == "kuberl.v1.Planner":  # a decisions watch, the first decision read
            await ch.unary_unary("/kuberl.v1.Planner/Apply")(b"", timeout=CALL_TIMEOUT_S)  # records one
            self.call = ch.unary_stream("/kuberl.v1.Planner/WatchDecisions")(b"", timeout=3600)
            await self.call.read()

    async def still_fine(self) -> bool | None:
        if self.call is None:
            return None
        if self.call.done():
            return False
        if self.service == "kuberl.v1.Buffer":  # the stream takes one more fragment and acknowledges both
            try:
                await self.call.write(make_fragment(actor_id="bystander", seq=1).SerializeToString())
                await self.call.done_writing()
                return buffer_pb2.PushAck.FromString(await self.call).accepted == 2
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                return False
        if self.service == "kuberl.v1.Actor":  # half-closed, the session ends cleanly
            await self.call.done_writing()
            while await self.call.read() is not grpc.aio.EOF:
                pass
            return await self.call.code() == grpc.StatusCode.OK
        return True

    def close(self) -> None:
        if self.call is not None:
            self.call.cancel()


@dataclass
class Report:
    service: str
    calls: int = 0
    deaths: int = 0
    codes: collections.Counter = field(default_factory=collections.Counter)
    by_frame: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    by_rpc: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    unexpected: list = field(default_factory=list)
    bystander_ok: bool | None = None
    get_stats_ok: bool | None = None
    stopped_early: str = ""

    def add(self, o: Outcome) -> None:
        self.calls += 1
        self.codes[o.code] += 1
        self.by_frame[o.frame][o.code] += 1
        self.by_rpc[o.rpc][o.code] += 1
        if not o.expected:
            self.unexpected.append(o)

    def as_dict(self) -> dict:
        return {"calls": self.calls, "deaths": self.deaths, "codes": dict(sorted(self.codes.items())),
                "unknown": self.codes["UNKNOWN"], "internal": self.codes["INTERNAL"],
                "by_frame": {k: dict(sorted(v.items())) for k, v in sorted(self.by_frame.items())},
                "by_rpc": {k: dict(sorted(v.items())) for k, v in sorted(self.by_rpc.items())},
                "unexpected": [o.__dict__ for o in self.unexpected[:50]], "unexpected_total": len(self.unexpected),
                "bystander_ok": self.bystander_ok, "get_stats_ok": self.get_stats_ok,
                "stopped_early": self.stopped_early}


async def fuzz_server(address: str, *, max_message: int, calls_per_rpc: int, seed: int, deadline: float | None = None,
                      include_grpc: bool = False, oversize_per_rpc: int = 1, stream_wait_s: float = 2.0,
                      alive=lambda: True, tls: TlsConfig | None = None) -> dict[str, Report]:
    """Fuzz every RPC of the server at `address`: `calls_per_rpc` malformed calls each (kinds in
    turn, contents from `seed`) plus `oversize_per_rpc` frames over `max_message` bytes; stops early
    past `deadline` (loop time; None: never) or when the server stops answering health (a death).
    `alive()` also tells a death (a process that exited). `tls`: the server's (the clients dial as
    its peers do)."""
    rng = random.Random(seed)
    rpcs = await discover(address, include_grpc, tls)
    frames = Frames(rng, rpcs)
    reports = {s: Report(s) for s in dict.fromkeys(r.service for r in rpcs)}
    loop = asyncio.get_running_loop()
    options = [("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)]
    async with AsyncExitStack() as stack:
        others = await stack.enter_async_context(open_channel(address, tls, aio=True))  # another client
        bystanders = {s: Bystander(others, s) for s in reports}
        for b in bystanders.values():
            stack.callback(b.close)
            await b.start()
        channel = await stack.enter_async_context(open_channel(address, tls, aio=True, options=options))
        for rpc in rpcs:
            report = reports[rpc.service]
            if report.deaths or report.stopped_early:
                continue
            plan = [KINDS[i % len(KINDS)] for i in range(calls_per_rpc)] + ["oversize"] * oversize_per_rpc
            for kind in plan:
                if deadline is not None and loop.time() > deadline:
                    report.stopped_early = "time budget spent"
                    break
                bad = (b"\x00" * (max_message + 1024) if kind == "oversize" else frames.make(kind, rpc))
                frame = "oversize" if kind == "oversize" else "well_formed" if parses(rpc.input, bad) else "garbage"
                if rpc.client_streaming:
                    good = good_messages(rpc)
                    before = good[:rng.randint(0, len(good))] if rpc.path != "/kuberl.v1.Actor/EnvSession" else good
                    after = good_messages(rpc)[:rng.randint(0, 2)] if not rpc.server_streaming else []
                    sent = before + [bad] + after
                else:
                    sent = [bad]
                wait = CALL_TIMEOUT_S if frame != "well_formed" else stream_wait_s
                code, details = await _invoke(channel, rpc, sent, CALL_TIMEOUT_S, wait)
                report.add(Outcome(rpc.path, kind, frame, code, details[:300], bad[:32].hex()))
            if not (alive() and await _healthy(channel)):
                report.deaths += 1
        for service, report in reports.items():
            report.bystander_ok = await bystanders[service].still_fine()
            if report.deaths or service.startswith("grpc."):
                continue
            try:
                await channel.unary_unary(f"/{service}/GetStats", response_deserializer=pb.GetStatsResponse.FromString)(
                    pb.GetStatsRequest().SerializeToString(), timeout=CALL_TIMEOUT_S)
                report.get_stats_ok = True
            except grpc.aio.AioRpcError:
                report.get_stats_ok = False
    return reports


# -- the benchmark ------------------------------------------------------------------------------------
def _table(reports: dict[str, Report]) -> str:
    lines = [f"{'service':<20} {'calls':>6} {'deaths':>6} {'UNKNOWN':>8} {'INTERNAL':>8} {'unexpected':>10}  codes"]
    for name, r in reports.items():
        codes = ", ".join(f"{k} {v}" for k, v in sorted(r.codes.items()))
        lines.append(f"{name:<20} {r.calls:>6} {r.deaths:>6} {r.codes['UNKNOWN']:>8} {r.codes['INTERNAL']:>8} "
                     f"{len(r.unexpected):>10}  {codes}")
        for frame, c in sorted(r.by_frame.items()):
            lines.append(f"{'':<20} {frame:>15}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
        lines.append(f"{'':<20} another client's stream still works: {r.bystander_ok}; GetStats afterwards: "
                     f"{'OK' if r.get_stats_ok else r.get_stats_ok}{'; ' + r.stopped_early if r.stopped_early else ''}")
        for o in r.unexpected[:5]:
            lines.append(f"{'':<20} UNEXPECTED {o.rpc} {o.kind} ({o.frame}): {o.code} {o.details[:120]}")
    return "\n".join(lines)


async def _bench(args: argparse.Namespace) -> dict:
    cfg = fuzz_config()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.seconds
    reports: dict[str, Report] = {}
    with tempfile.TemporaryDirectory(prefix="kuberl-fuzz-") as tmp:
        workdir = Path(tmp)
        config = workdir / "config.json"
        config.write_text(json.dumps(cfg))
        procs: dict[str, Process] = {}
        addresses: dict[str, str] = {}
        try:
            for role in ROLES:  # in dependency order
                peers = {k: addresses[k] for k in ("buffer", "learner") if k in addresses and role != k}
                procs[role] = Process(role, config, workdir, **peers)
                addresses[role] = await asyncio.to_thread(procs[role].wait_ready)
            for i, role in enumerate(ROLES):
                got = await fuzz_server(addresses[role], max_message=max_message_bytes(role, cfg),
                                        calls_per_rpc=args.calls_per_rpc, seed=args.seed + i, deadline=deadline,
                                        include_grpc=args.include_grpc, stream_wait_s=args.stream_wait_s,
                                        alive=procs[role].alive)
                reports.update(got)
                print(_table(got), flush=True)
        finally:
            exits = {role: p.stop() for role, p in reversed(procs.items())}
    return {"reports": reports, "exit_codes": exits}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls-per-rpc", type=int, default=60, help="malformed calls per RPC (plus one oversize frame)")
    p.add_argument("--seconds", type=float, default=600.0, help="time budget for all the calls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream-wait-s", type=float, default=2.0,
                   help="how long a well-formed request's response stream is waited on")
    p.add_argument("--include-grpc", action="store_true", help="also fuzz the health and reflection services")
    p.add_argument("--out", default=str(ROOT / "docs" / "fuzz.json"))
    # Internal: run one service (used by the benchmark for each of its processes).
    p.add_argument("--serve", choices=ROLES, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--ready", help=argparse.SUPPRESS)
    p.add_argument("--buffer", default="", help=argparse.SUPPRESS)
    p.add_argument("--learner", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return _serve_main(args)
    started = time.time()
    result = asyncio.run(_bench(args))
    reports: dict[str, Report] = result["reports"]
    out = {
        "args": {k: v for k, v in vars(args).items() if k in ("calls_per_rpc", "seconds", "seed", "stream_wait_s",
                                                              "include_grpc")},
        "seconds": round(time.time() - started, 1),
        "machine": {"python": platform.python_version(), "grpcio": grpc.__version__, "cpus": os.cpu_count()},
        "exit_codes": result["exit_codes"],
        "services": {name: r.as_dict() for name, r in reports.items()},
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    bad = sum(len(r.unexpected) + r.deaths for r in reports.values())
    return 1 if bad or any(False in (r.bystander_ok, r.get_stats_ok) for r in reports.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
