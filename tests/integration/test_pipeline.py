"""Buffer, learner and actor in one event loop over real gRPC on 127.0.0.1:0: data and weights flow."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.actor import main as actor_main
from services.buffer import main as buffer_main
from services.config import config_from_dict
from services.learner import main as learner_main
from tests.helpers import TINY_DQN, TINY_PPO, TINY_SAC


async def _stats(address: str, stub_cls) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as ch:
        return dict((await stub_cls(ch).GetStats(pb.GetStatsRequest(), timeout=5)).metrics)


async def _until(predicate, timeout: float = 60.0):
    async with asyncio.timeout(timeout):
        while not (value := await predicate()):
            await asyncio.sleep(0.1)
    return value


async def _services(address: str) -> set[str]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        async for resp in call:
            return {s.name for s in resp.list_services_response.service}
    return set()


async def _health(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return resp.status


@contextlib.asynccontextmanager
async def stack(cfg, ckpt, **actor_kwargs):
    """A buffer, a learner and an actor in this event loop; yields their gRPC addresses."""
    async with buffer_main.serving(cfg, listen="127.0.0.1:0") as buffer:
        async with learner_main.serving(cfg, listen="127.0.0.1:0", buffer=buffer.grpc,
                                        checkpoint_dir=str(ckpt)) as learner:
            async with actor_main.serving(cfg, listen="127.0.0.1:0", buffer=buffer.grpc, learner=learner.grpc,
                                          **actor_kwargs) as actor:
                yield buffer.grpc, learner.grpc, actor.grpc


@pytest.mark.parametrize("algo", [TINY_PPO, TINY_DQN, TINY_SAC], ids=["ppo", "dqn", "sac"])
async def test_push_batch_train_and_weights_reach_the_actor(tmp_path, algo):
    cfg = config_from_dict(algo)
    async with stack(cfg, tmp_path / "ckpt", actor_id="actor-pipeline") as (buffer, learner, actor):
        # New weights, trained on this actor's own fragments, come back to it.
        a = await _until(lambda: _stat_at_least(actor, actor_pb2_grpc.ActorStub, "actor/policy_version", 2))
        b = await _stats(buffer, buffer_pb2_grpc.BufferStub)
        lrn = await _stats(learner, learner_pb2_grpc.LearnerStub)
        assert a["actor/fragments_pushed_total"] >= 1 and a["actor/env_steps_total"] > 0
        assert b["buffer/fragments_received_total"] >= 1 and b["buffer/samples_served_total"] > 0
        assert lrn["learner/updates_total"] >= 2 and lrn["learner/samples_total"] > 0
        assert lrn["learner/weights_sent_total"] >= 1
        assert b["buffer/fragments_invalid_total"] == 0 and a["actor/fragments_dropped_total"] == 0
        for address, name in ((buffer, "kuberl.v1.Buffer"), (learner, "kuberl.v1.Learner"),
                              (actor, "kuberl.v1.Actor")):
            assert await _health(address, "") == health_pb2.HealthCheckResponse.SERVING
            assert await _health(address, name) == health_pb2.HealthCheckResponse.SERVING
            assert {name, "grpc.health.v1.Health"} <= await _services(address)
    # The learner wrote a checkpoint on the way out.
    assert list((tmp_path / "ckpt").glob("ckpt-*.pt"))


async def _stat_at_least(address, stub_cls, name, value):
    s = await _stats(address, stub_cls)
    return s if s.get(name, 0) >= value else None


async def test_actor_episodes_feed_has_a_cursor(tmp_path):
    cfg = config_from_dict(TINY_PPO)
    async with stack(cfg, tmp_path) as (_, _, actor):
        async with grpc.aio.insecure_channel(actor) as ch:
            stub = actor_pb2_grpc.ActorStub(ch)

            async def episodes(after):
                return (await stub.GetStats(pb.GetStatsRequest(episodes_after=after), timeout=5)).episodes

            first = await _until(lambda: episodes(0))
            indexes = [e.index for e in first]
            assert indexes == list(range(1, len(indexes) + 1))
            assert all(e.episode_return == e.length > 0 for e in first)  # CartPole: +1 per step
            later = await _until(lambda: episodes(indexes[-1]))
            assert later[0].index == indexes[-1] + 1


async def test_a_crashed_rollout_ends_serving_with_the_error_and_no_server_left_behind(tmp_path, monkeypatch):
    """The rollout thread's exception comes out of `serving()` (the process would exit 1), and every
    server is stopped even though the actor's shutdown sequence was cut short by it."""
    from services.actor.policy import Policy

    def crash(self, obs, env_steps=0, mask=None, state=None):
        raise ZeroDivisionError("policy exploded")

    monkeypatch.setattr(Policy, "act", crash)
    cfg = config_from_dict(TINY_PPO)
    addresses = []
    with pytest.raises(ExceptionGroup) as err:
        async with stack(cfg, tmp_path) as (buffer, learner, actor):
            addresses += [buffer, learner, actor]
            await asyncio.sleep(30)  # the crash ends this sooner
    assert err.group_contains(ZeroDivisionError, match="policy exploded")
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert gone.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_readiness_goes_not_serving_before_each_server_stops(tmp_path):
    """Kubernetes stops routing to a pod when its readiness probe fails: each service's shutdown sequence
    flips grpc.health.v1 to NOT_SERVING first, which a Health.Watch opened while serving receives."""
    cfg = config_from_dict(TINY_PPO)
    seen: dict[str, list[int]] = {}

    async def watch(address: str, ch: grpc.aio.Channel) -> None:
        try:
            async for resp in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="")):
                seen[address].append(resp.status)
        except grpc.aio.AioRpcError:
            pass  # the server went away after its last word

    async with contextlib.AsyncExitStack() as channels:
        watchers = []
        async with stack(cfg, tmp_path) as addresses:
            for address in addresses:
                seen[address] = []
                ch = await channels.enter_async_context(grpc.aio.insecure_channel(address))
                watchers.append(asyncio.create_task(watch(address, ch)))
            await _until(lambda: _all_serving(seen))
        await asyncio.wait_for(asyncio.gather(*watchers), 30)
    for address, statuses in seen.items():
        assert statuses[0] == health_pb2.HealthCheckResponse.SERVING, address
        assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, (address, statuses)


async def _all_serving(seen: dict[str, list[int]]) -> bool:
    return all(s and s[0] == health_pb2.HealthCheckResponse.SERVING for s in seen.values())


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "kuberl_envs:MaskedChoice-v0"], ids=["box", "multidiscrete-masked"])
async def test_every_action_space_flows_actor_to_buffer_to_learner_and_back(tmp_path, env_id):
    """Box actions (float32, unclipped in fragments) and MultiDiscrete actions with masks go through
    every service's validation and come back as trained weights."""
    cfg = config_from_dict({**TINY_PPO, "env": {"id": env_id, "num_envs": 2}})
    async with stack(cfg, tmp_path / "ckpt", actor_id="actor-spaces") as (buffer, learner, actor):
        a = await _until(lambda: _stat_at_least(actor, actor_pb2_grpc.ActorStub, "actor/policy_version", 2))
        b = await _stats(buffer, buffer_pb2_grpc.BufferStub)
        lrn = await _stats(learner, learner_pb2_grpc.LearnerStub)
    assert a["actor/fragments_pushed_total"] >= 1 and a["actor/env_steps_total"] > 0
    assert b["buffer/fragments_invalid_total"] == 0 and lrn["learner/batches_invalid_total"] == 0
    assert lrn["learner/updates_total"] >= 2 and lrn["learner/samples_total"] > 0
