"""The planner's buffer shards (services/planner/shards.py): when it adds or drains one, and how it
carries the change through (the backend starts the shard, the list gains it once it serves; a drained
shard is stopped and leaves the list), with the shard list sent to every shard at each step."""

from __future__ import annotations

import pytest

from kuberl.v1 import buffer_pb2
from services.config import config_from_dict
from services.planner.backend import Replica
from services.planner.core import Planner
from services.planner.shards import BUFFER_IDLE_CORES, decide_shards, shard_bounds
from tests.helpers import TINY_PPO
from tests.unit.planner.test_core import ModelStats, WireBackend


def test_decide_shards_adds_one_when_communication_bound_within_max():
    kw = dict(evidence="buffer-0 uses 0.98 CPU cores", buffer_cores={"buffer-0": 0.98}, idle_for_s=0.0, window_s=30.0)
    d = decide_shards(1, (1, 3), bottleneck="communication", **kw)
    assert (d.current, d.target) == (1, 2) and "communication-bound (buffer-0 uses 0.98 CPU cores)" in d.reason
    at_max = decide_shards(3, (1, 3), bottleneck="communication", **kw)
    assert at_max.target == 3 and "planner.buffer.max (3)" in at_max.reason
    # A change in flight holds everything, overrides included.
    busy = decide_shards(1, (1, 3), bottleneck="communication", busy="adding buffer shard 1", override=3, **kw)
    assert busy.target == 1 and busy.reason == "adding buffer shard 1"


def test_decide_shards_drains_one_only_after_every_shard_idled_for_the_window():
    idle = {"buffer-0": 0.1, "buffer-1": 0.05}
    kw = dict(bottleneck="sampling", evidence="", buffer_cores=idle, window_s=30.0)
    assert decide_shards(2, (1, 2), idle_for_s=10.0, **kw).target == 2
    d = decide_shards(2, (1, 2), idle_for_s=30.0, **kw)
    assert d.target == 1 and "draining shard 1" in d.reason
    assert decide_shards(2, (2, 2), idle_for_s=60.0, **kw).target == 2       # at planner.buffer.min
    one_busy = {"buffer-0": BUFFER_IDLE_CORES + 0.01, "buffer-1": 0.0}
    assert decide_shards(2, (1, 2), idle_for_s=60.0, **{**kw, "buffer_cores": one_busy}).target == 2
    unknown = {"buffer-0": 0.1}   # a shard whose CPU is not known: not drained on half the picture
    assert decide_shards(2, (1, 2), idle_for_s=60.0, **{**kw, "buffer_cores": unknown}).target == 2


def test_an_override_moves_one_shard_at_a_time():
    kw = dict(bottleneck="balanced", evidence="", buffer_cores={}, idle_for_s=0.0, window_s=30.0)
    assert decide_shards(1, (1, 4), override=3, **kw).target == 2
    assert decide_shards(3, (1, 4), override=1, **kw).target == 2
    held = decide_shards(2, (1, 4), override=2, **kw)
    assert held.target == 2 and "held at 2" in held.reason


def test_bounds_default_to_the_topology_and_are_checked_against_it():
    assert shard_bounds(config_from_dict({**TINY_PPO, "topology": {"buffers": 2}})) == (2, 2)
    assert shard_bounds(config_from_dict({**TINY_PPO, "planner": {"buffer": {"min": 1, "max": 4}}})) == (1, 4)
    from services.config import ConfigError
    with pytest.raises(ConfigError, match=r"topology.buffers: 1 is invalid: must lie within planner.buffer.min..max"):
        config_from_dict({**TINY_PPO, "planner": {"buffer": {"min": 2, "max": 4}}})
    with pytest.raises(ConfigError, match=r"planner.buffer: '1..65' is invalid: min..max must lie within 1..64"):
        config_from_dict({**TINY_PPO, "planner": {"buffer": {"min": 1, "max": 65}}})


class ShardingBackend(WireBackend):
    """WireBackend whose buffer shards it starts and stops: a shard it adds serves from the second
    listing on."""
    scales_buffers = True

    def __init__(self, actors: int):
        super().__init__(actors)
        self.shards = ["fake:buffer-0"]
        self.listed: dict[str, int] = {}
        self.stopped: list[str] = []
        self.followed: list[list[str]] = []

    async def buffers(self) -> list[Replica]:
        out = []
        for i, address in enumerate(self.shards):
            self.listed[address] = self.listed.get(address, 0) + 1
            ready = address == "fake:buffer-0" or self.listed[address] > 1
            out.append(Replica(f"buffer-{i}", address if ready else "", ready))
        return out

    async def buffer_list(self) -> list[str]:
        return list(self.shards)

    async def add_buffer(self) -> str:
        address = f"fake:buffer-{len(self.shards)}"
        self.shards.append(address)
        return address

    async def remove_buffer(self, address: str) -> None:
        self.shards.remove(address)
        self.stopped.append(address)

    def follow_topology(self, active: list[str]) -> None:
        self.followed.append(active)


class Shards:
    """SetTopology as each shard answers it: drained when `drained` names it and it is draining."""

    def __init__(self):
        self.got: dict[str, buffer_pb2.BufferTopology] = {}
        self.drained: set[str] = set()

    async def __call__(self, i, address, request):
        t = request.topology
        held = self.got.get(address)
        if held is not None and 0 < t.generation < held.generation:
            raise AssertionError("the generation went back")
        if held is None or t.generation > held.generation:   # (generation 0 only reads, as a shard does)
            self.got[address] = held = t
        if held is None:
            return buffer_pb2.TopologyAck()
        draining = i >= held.active
        return buffer_pb2.TopologyAck(generation=held.generation, draining=draining, topology=held,
                                      drained=draining and address in self.drained)


async def test_the_planner_adds_a_shard_for_a_busy_buffer_and_drains_it_once_shards_idle():
    cfg = config_from_dict({**TINY_PPO, "planner": {
        "interval_s": 1, "warmup_s": 2, "cooldown_s": 3, "rate_halflife_s": 1, "scale_down_window_s": 4,
        "actor": {"min": 2, "max": 2}, "buffer": {"min": 1, "max": 2}}, "topology": {"actors": 2}})
    backend, clock, shards = ShardingBackend(actors=2), [0.0], Shards()
    stats = ModelStats(lambda: clock[0])
    planner = Planner(cfg, backend, clock=lambda: clock[0], wall=lambda: 1000.0 + clock[0], stats=stats,
                      send_topology=shards)
    stats.buffer_cores = 0.98                      # the one shard's process is at a full core
    for _ in range(8):
        clock[0] += 1.0
        d = await planner.step()
        if d.buffer_shards_target == 2:
            break
    assert (d.buffer_shards, d.buffer_shards_target) == (1, 2), d
    assert d.bottleneck == "communication" and "buffer-0 uses 0.98 CPU cores" in d.buffer_shards_reason
    assert shards.got["fake:buffer-0"].active == 1 and "fake:buffer-1" not in shards.got   # not serving yet
    await planner.shards.sync()                    # listed once: not serving yet, not in the list
    assert shards.got["fake:buffer-0"].active == 1 and "fake:buffer-1" not in shards.got
    await planner.shards.sync()                    # it serves now: in the list, sent to both
    for address in ("fake:buffer-0", "fake:buffer-1"):
        assert list(shards.got[address].addresses) == ["fake:buffer-0", "fake:buffer-1"]
        assert shards.got[address].active == 2
    assert backend.followed[-1] == ["fake:buffer-0", "fake:buffer-1"]
    assert planner.metrics.gauges["planner/buffer_shards"] == 2

    stats.buffer_cores = 0.05                      # both idle now: one is drained after the window
    drained_at = None
    for step in range(30):
        clock[0] += 1.0
        d = await planner.step()
        await planner.shards.sync()
        if d.buffer_shards_target == 1 and drained_at is None:
            drained_at = step
            assert "every buffer shard idles" in d.buffer_shards_reason
            assert shards.got["fake:buffer-1"].active == 1 and len(shards.got["fake:buffer-1"].addresses) == 2
            assert "draining buffer shard 1" in planner.shards.busy()
            shards.drained.add("fake:buffer-1")   # the shard says it is drained at the next SetTopology
        if backend.stopped:
            break
    assert drained_at is not None and backend.stopped == ["fake:buffer-1"]
    assert list(shards.got["fake:buffer-0"].addresses) == ["fake:buffer-0"] and not planner.shards.busy()
    assert planner.metrics.counters["planner/buffer_shards_drained_total"] == 1
    assert planner.metrics.counters["planner/buffer_shards_added_total"] == 1
    await planner.close()


async def test_a_paused_planner_changes_the_shards_only_when_asked():
    cfg = config_from_dict({**TINY_PPO, "planner": {
        "interval_s": 1, "warmup_s": 2, "cooldown_s": 3, "rate_halflife_s": 1,
        "actor": {"min": 2, "max": 2}, "buffer": {"min": 1, "max": 2}}, "topology": {"actors": 2}})
    backend, clock, shards = ShardingBackend(actors=2), [0.0], Shards()
    stats = ModelStats(lambda: clock[0])
    planner = Planner(cfg, backend, clock=lambda: clock[0], wall=lambda: 1000.0 + clock[0], stats=stats,
                      send_topology=shards)
    planner.paused = True
    stats.buffer_cores = 0.98                      # communication-bound, as in the test above
    for _ in range(8):
        clock[0] += 1.0
        d = await planner.step()
    assert d.bottleneck == "communication" and d.buffer_shards_target == 1 and backend.shards == ["fake:buffer-0"]
    assert d.buffer_shards_reason.startswith("paused; would go on: communication-bound"), d.buffer_shards_reason
    asked = await planner.set_override("buffer", 2, 60)   # what `kuberl scale buffer 2` sends
    assert asked.buffer_shards_target == 2 and backend.shards == ["fake:buffer-0", "fake:buffer-1"]
    await planner.close()


async def test_a_planner_restarted_mid_drain_keeps_the_shard_draining_and_finishes_the_drain():
    cfg = config_from_dict({**TINY_PPO, "planner": {
        "interval_s": 1, "warmup_s": 2, "cooldown_s": 3, "rate_halflife_s": 1, "buffer": {"min": 1, "max": 3}},
        "topology": {"actors": 2}})
    backend, shards, clock = ShardingBackend(actors=2), Shards(), [0.0]
    backend.shards = ["fake:buffer-0", "fake:buffer-1", "fake:buffer-2"]
    first = Planner(cfg, backend, clock=lambda: clock[0], wall=lambda: 1000.0, stats=ModelStats(lambda: clock[0]),
                    send_topology=shards)
    await first.shards.sync()
    assert shards.got["fake:buffer-2"].active == 3
    await first.shards.scale_to(2)                 # shard 2 drains; then the planner goes away
    drain_generation = shards.got["fake:buffer-2"].generation
    assert shards.got["fake:buffer-2"].active == 2
    await first.close()

    # The new planner's clock reads earlier than the generation held (a skewed node): still past it.
    second = Planner(cfg, backend, clock=lambda: clock[0], wall=lambda: 500.0, stats=ModelStats(lambda: clock[0]),
                     send_topology=shards)
    await second.shards.sync()
    for address in backend.shards:
        got = shards.got[address]
        assert got.generation > drain_generation and got.active == 2, (address, got)
        assert list(got.addresses) == backend.shards
    assert "draining buffer shard 2 (fake:buffer-2)" in second.shards.busy()
    assert second.metrics.gauges["planner/buffer_shards"] == 2
    shards.drained.add("fake:buffer-2")
    await second.shards.sync()                     # the ack says drained
    await second.shards.sync()                     # stopped, and the list shrinks
    assert backend.stopped == ["fake:buffer-2"] and not second.shards.busy()
    assert list(shards.got["fake:buffer-0"].addresses) == ["fake:buffer-0", "fake:buffer-1"]
    await second.close()


async def test_a_resumed_list_that_drains_two_shards_drains_and_stops_both():
    cfg = config_from_dict({**TINY_PPO, "planner": {"buffer": {"min": 1, "max": 4}}, "topology": {"actors": 2}})
    backend, shards = ShardingBackend(actors=2), Shards()
    backend.shards = [f"fake:buffer-{i}" for i in range(4)]
    held = buffer_pb2.BufferTopology(generation=7, addresses=backend.shards, active=2)
    for address in backend.shards:          # what a planner that drained two at once would have left
        shards.got[address] = held
    planner = Planner(cfg, backend, clock=lambda: 0.0, wall=lambda: 0.0, stats=ModelStats(lambda: 0.0),
                      send_topology=shards)
    await planner.shards.sync()
    assert "draining buffer shard 2 (fake:buffer-2)" in planner.shards.busy()
    shards.drained |= {"fake:buffer-2", "fake:buffer-3"}
    for _ in range(6):
        await planner.shards.sync()
    assert backend.stopped == ["fake:buffer-2", "fake:buffer-3"] and not planner.shards.busy()
    assert list(shards.got["fake:buffer-0"].addresses) == ["fake:buffer-0", "fake:buffer-1"]
    await planner.close()


async def test_a_planner_with_no_list_held_anywhere_makes_every_shard_it_runs_active():
    cfg = config_from_dict({**TINY_PPO, "planner": {"buffer": {"min": 1, "max": 3}}})
    backend, shards = ShardingBackend(actors=1), Shards()
    backend.shards = ["fake:buffer-0", "fake:buffer-1"]
    planner = Planner(cfg, backend, clock=lambda: 0.0, wall=lambda: 1000.0, stats=ModelStats(lambda: 0.0),
                      send_topology=shards)
    await planner.shards.sync()
    assert all(shards.got[a].active == 2 for a in backend.shards) and not planner.shards.busy()
    await planner.close()


async def test_a_backend_that_does_not_run_shards_publishes_nothing_and_says_why_it_adds_none():
    cfg = config_from_dict({**TINY_PPO, "planner": {
        "interval_s": 1, "warmup_s": 2, "cooldown_s": 3, "rate_halflife_s": 1, "buffer": {"min": 1, "max": 2}}})
    backend, clock, shards = WireBackend(actors=1), [0.0], Shards()
    stats = ModelStats(lambda: clock[0])
    planner = Planner(cfg, backend, clock=lambda: clock[0], stats=stats, send_topology=shards)
    stats.buffer_cores = 0.98
    for _ in range(8):
        clock[0] += 1.0
        d = await planner.step()
    assert not shards.got   # (the Kubernetes backend names pods by IP: a list of those would move everyone)
    assert d.buffer_shards_target == d.buffer_shards == 0
    assert "does not start buffer shards" in d.buffer_shards_reason
    await planner.close()
