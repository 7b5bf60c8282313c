"""Delivery between an actor's Pusher (services/actor/push.py) and a real buffer: what the actor counts
as acknowledged is what the buffer stored, through a re-send, a refusal, an actor restarted under the
same id, and a buffer killed with SIGKILL before it acknowledged anything."""

from __future__ import annotations

import asyncio
import re
import signal

import grpc
import pytest

from kuberl.v1 import buffer_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.actor.push import Pusher
from services.buffer import main as buffer_main
from services.config import config_from_dict
from services.common.protocol.fragments import EncodedFragment, new_incarnation
from services.common.local.procs import free_port
from services.common.stats import Metrics
from tests.helpers import TINY_DQN, TINY_PPO, Service, write_config
from tests.unit.fragment_factory import make_msg

WAIT_S = 60.0  # generous bounds for a busy machine; nothing below asserts on time


def frag(seq: int, incarnation: int, actor_id: str = "actor-0", **kw) -> EncodedFragment:
    return EncodedFragment.of(make_msg(actor_id=actor_id, seq=seq, base=seq, incarnation=incarnation, **kw))


async def stats(channel: grpc.aio.Channel) -> dict[str, float]:
    stub = buffer_pb2_grpc.BufferStub(channel)
    return dict((await stub.GetStats(pb.GetStatsRequest(), timeout=5)).metrics)


async def deliver(channel: grpc.aio.Channel, fragments, *, unacked=()) -> Metrics:
    """Push `fragments` through a fresh Pusher (with `unacked` as if a broken stream left them
    unacknowledged) until all are acknowledged; returns the pusher's metrics."""
    metrics = Metrics("actor")
    pusher = Pusher(channel, capacity=64, ack_interval_s=0.05, metrics=metrics)
    for m in unacked:
        pusher.unacked.append(m)
        pusher.unacked_bytes += len(m.payload)
    for m in fragments:
        pusher.enqueue(m)
    stopping = asyncio.Event()
    stopping.set()
    await asyncio.wait_for(pusher.run(stopping), WAIT_S)
    assert pusher.pending == 0
    return metrics


@pytest.fixture
async def buffer_channel():
    async with buffer_main.serving(config_from_dict(TINY_PPO), listen="127.0.0.1:0") as endpoints:
        async with grpc.aio.insecure_channel(endpoints.grpc) as channel:
            yield channel


async def test_a_restarted_actor_under_the_same_id_has_every_acknowledged_fragment_stored(buffer_channel):
    first, second = new_incarnation(), new_incarnation()
    assert first != second
    first = await deliver(buffer_channel, [frag(s, incarnation=first) for s in range(5)])
    second = await deliver(buffer_channel, [frag(s, incarnation=second) for s in range(5)])  # seq from 0 again
    assert first.counters["actor/fragments_acked_total"] == second.counters["actor/fragments_acked_total"] == 5
    s = await stats(buffer_channel)
    assert s["buffer/fragments_received_total"] == 10   # acknowledged = stored, for both processes
    assert s["buffer/fragments_duplicate_total"] == 0


async def test_a_resend_of_the_same_incarnation_is_stored_once_and_then_forgotten(buffer_channel):
    await deliver(buffer_channel, [frag(s, incarnation=5) for s in range(5)])
    # The same process after a broken stream: 0..4 were stored but never acknowledged to it.
    metrics = await deliver(buffer_channel, [frag(s, incarnation=5) for s in (5, 6)],
                            unacked=[frag(s, incarnation=5) for s in range(5)])
    assert metrics.counters["actor/fragments_resent_total"] == 5
    assert metrics.counters["actor/fragments_acked_total"] == 7
    s = await stats(buffer_channel)
    assert (s["buffer/fragments_received_total"], s["buffer/fragments_duplicate_total"]) == (7, 5)


async def test_a_refused_fragment_is_counted_and_the_rest_are_stored(buffer_channel):
    good = [frag(s, incarnation=9) for s in range(6) if s != 3]
    bad = frag(3, incarnation=9, obs_shape=(3,), policy_version=0)
    bad = EncodedFragment(3, bad.samples, bad.payload[:-40] + b"\xff" * 40)  # corrupt tail: unparseable
    metrics = await deliver(buffer_channel, good[:3] + [bad] + good[3:])
    assert metrics.counters["actor/fragments_rejected_total"] == 1
    assert metrics.counters["actor/fragments_acked_total"] == 5
    s = await stats(buffer_channel)
    assert s["buffer/fragments_received_total"] == 5
    assert s["buffer/fragments_invalid_total"] == 1


def _pushing_to_a_buffer(tmp_path, config, *args: str, capacity: int, ack_interval_s: float):
    """A buffer process on a fixed address (a successor can take it) and a Pusher running against it:
    (address, buffer, channel, pusher, metrics, stopping, task)."""
    address = f"127.0.0.1:{free_port()}"
    old = Service("buffer", tmp_path, config, *args, listen=address)
    old.wait_ready()
    metrics = Metrics("actor")
    channel = grpc.aio.insecure_channel(address)
    pusher = Pusher(channel, capacity=capacity, ack_interval_s=ack_interval_s, metrics=metrics)
    stopping = asyncio.Event()
    task = asyncio.create_task(pusher.run(stopping), name="push")
    return address, old, channel, pusher, metrics, stopping, task


async def _tear_down(task: asyncio.Task, channel: grpc.aio.Channel, *buffers: Service | None) -> None:
    """End the pusher, its channel and every buffer process still running."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await channel.close()
    for svc in buffers:
        if svc is not None and svc.popen.poll() is None:
            svc.popen.kill()
            svc.popen.wait()


async def test_fragments_a_killed_buffer_never_acknowledged_are_resent_to_its_successor(tmp_path):
    config = write_config(tmp_path / "exp.yaml", TINY_PPO)
    # A long ack interval: the stream stays open, so nothing is acknowledged before the kill.
    address, old, channel, pusher, metrics, stopping, task = _pushing_to_a_buffer(
        tmp_path, config, capacity=64, ack_interval_s=3600.0)
    new = None
    try:
        for s in range(10):
            pusher.enqueue(frag(s, incarnation=77))
        async with grpc.aio.insecure_channel(address) as ch:
            async with asyncio.timeout(WAIT_S):
                while (await stats(ch)).get("buffer/fragments_received_total") != 10:
                    await asyncio.sleep(0.05)
        old.popen.send_signal(signal.SIGKILL)
        old.popen.wait(WAIT_S)
        assert pusher.pending == 10 and metrics.counters["actor/fragments_acked_total"] == 0
        new = Service("buffer", tmp_path, config, listen=address)
        new.wait_ready()
        stopping.set()  # end the stream as soon as the re-send is written, and take the ack
        await asyncio.wait_for(task, WAIT_S)
        async with grpc.aio.insecure_channel(address) as ch:
            s = await stats(ch)
        assert s["buffer/fragments_received_total"] == 10
        assert metrics.counters["actor/fragments_acked_total"] == 10
        assert metrics.counters["actor/fragments_resent_total"] >= 10
        assert pusher.pending == 0
    finally:
        await _tear_down(task, channel, old, new)


async def test_a_fragment_too_old_to_dedupe_is_counted_as_rejected_not_acknowledged(buffer_channel):
    """A sender that broke the queue bound (more than DEDUPE_WINDOW seqs apart in flight) gets its
    oldest fragment refused; the actor counts it, fragments and samples, and never as acknowledged."""
    from services.common.protocol.fragments import DEDUPE_WINDOW

    inc = new_incarnation()
    new, old = frag(DEDUPE_WINDOW + 5, inc), frag(0, inc)
    metrics = await deliver(buffer_channel, [new, old])
    snap = metrics.snapshot()
    assert snap["actor/fragments_rejected_total"] == 1 and snap["actor/samples_rejected_total"] == old.samples
    assert snap["actor/fragments_acked_total"] == 1
    buffer = await stats(buffer_channel)
    assert buffer["buffer/fragments_received_total"] == 1 and buffer["buffer/fragments_too_old_total"] == 1


def _stopped_line(log: str) -> int:
    """Fragments received, from a buffer's last log line (services/buffer/main.py)."""
    found = re.search(r"buffer stopped: (\d+) fragments received", log)
    assert found, f"no final line in the buffer's log:\n{log[-2000:]}"
    return int(found.group(1))


async def _until(check, what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not check():
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("algorithm,store_thread", [("ppo", False), ("dqn", False), ("dqn", True)])
async def test_a_buffer_stopped_with_sigterm_acknowledges_what_its_open_stream_stored(tmp_path, algorithm,
                                                                                      store_thread):
    """SIGTERM (a pod deleted, a node drained) ends the buffer's open push streams with their acks:
    the actor counts as acknowledged exactly what that buffer stored, and re-sends to its successor
    only what it did not store, never data a learner may already have trained on. What the buffer
    held goes with it (PPO's FIFO: said in its last line), unless its replay has a checkpoint dir (DQN):
    then the successor restores every acknowledged sample."""
    base = TINY_PPO if algorithm == "ppo" else TINY_DQN
    config = write_config(tmp_path / "exp.yaml", {**base, "buffer": {**base.get("buffer", {}), "store_thread": store_thread}})
    args = () if algorithm == "ppo" else ("--checkpoint-dir", str(tmp_path / "replay"))
    kind = {"algorithm": pb.ALGORITHM_PPO if algorithm == "ppo" else pb.ALGORITHM_DQN}
    # A long ack interval: the stream is open, its fragments stored but not acknowledged, at SIGTERM.
    address, old, channel, pusher, metrics, stopping, task = _pushing_to_a_buffer(
        tmp_path, config, *args, capacity=64, ack_interval_s=3600.0)
    new = None
    try:
        sent = [frag(s, incarnation=78, **kind) for s in range(15)]
        for m in sent[:10]:
            pusher.enqueue(m)
        async with grpc.aio.insecure_channel(address) as ch:
            async with asyncio.timeout(WAIT_S):
                while (await stats(ch)).get("buffer/fragments_received_total") != 10:
                    await asyncio.sleep(0.05)
        assert metrics.counters["actor/fragments_acked_total"] == 0   # the stream is still open
        old.popen.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(old.popen.wait, WAIT_S) == 0
        assert _stopped_line(old.output()) == 10
        assert f"the store works {'on a thread of its own' if store_thread else 'on the event loop'}" in old.output()
        held = sum(m.samples for m in sent[:10])
        fate = "lost with it: no checkpoint" if algorithm == "ppo" else "in its last checkpoint"
        assert f"{held} held ({fate})" in old.output()
        await _until(lambda: metrics.counters["actor/fragments_acked_total"] == 10, "the ack")
        assert pusher.pending == 0
        for m in sent[10:]:
            pusher.enqueue(m)
        new = Service("buffer", tmp_path, config, *args, listen=address)
        new.wait_ready()
        stopping.set()
        await asyncio.wait_for(task, WAIT_S)
        async with grpc.aio.insecure_channel(address) as ch:
            s = await stats(ch)
        assert s["buffer/fragments_duplicate_total"] == 0 and metrics.counters["actor/fragments_resent_total"] == 0
        assert metrics.counters["actor/fragments_acked_total"] == 15
        restored = 0 if algorithm == "ppo" else held
        assert s["buffer/size_samples"] == restored + sum(m.samples for m in sent[10:])
    finally:
        await _tear_down(task, channel, old, new)


async def test_an_actor_pushing_through_a_buffer_replacement_has_each_fragment_stored_once(tmp_path):
    """Fragments cut without pause while the buffer is stopped with SIGTERM and replaced: every one is
    acknowledged, and each is stored by exactly one of the two buffers (none lost, none stored twice)."""
    config = write_config(tmp_path / "exp.yaml", TINY_PPO)
    address, old, channel, pusher, metrics, stopping, task = _pushing_to_a_buffer(
        tmp_path, config, capacity=4096, ack_interval_s=0.05)
    new = None
    cut = 0

    async def cut_until(check) -> None:
        nonlocal cut
        async with asyncio.timeout(WAIT_S):
            while not check():
                pusher.enqueue(frag(cut, incarnation=79))
                cut += 1
                await asyncio.sleep(0.002)

    try:
        # Several ack intervals against the first buffer: acknowledged before it goes.
        await cut_until(lambda: metrics.counters["actor/fragments_acked_total"] >= 20)
        old.popen.send_signal(signal.SIGTERM)
        await cut_until(lambda: old.popen.poll() is not None)   # pushing on through its shutdown
        acked_at_gone = metrics.counters["actor/fragments_acked_total"]
        stored_by_old = _stopped_line(old.output())
        assert 20 <= acked_at_gone <= stored_by_old
        new = Service("buffer", tmp_path, config, listen=address)
        new.wait_ready()
        await cut_until(lambda: metrics.counters["actor/fragments_acked_total"] >= acked_at_gone + 20)
        stopping.set()
        await asyncio.wait_for(task, WAIT_S)
        async with grpc.aio.insecure_channel(address) as ch:
            s = await stats(ch)
        assert metrics.counters["actor/fragments_acked_total"] == cut
        assert metrics.counters["actor/fragments_dropped_total"] == 0
        assert stored_by_old + s["buffer/fragments_received_total"] == cut, (
            f"{cut} cut, the old buffer stored {stored_by_old}, the new {s['buffer/fragments_received_total']}")
        assert acked_at_gone == stored_by_old   # the old buffer's every fragment was acknowledged by it
    finally:
        await _tear_down(task, channel, old, new)
