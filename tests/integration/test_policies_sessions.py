"""Several policies over EnvSession, end to end (config `policies` with env.mode: external): a simulator
whose agents two policies play, each with spaces of its own, opens one session per policy
(`EnvHello.policy`) and steps them together. Each policy's steps reach its own buffer table and its own
learner, whose weights come back to the actor's copy of that policy; misuse (no policy named, an
unknown one, the other policy's spaces, an agent the config maps to the other policy) is refused with
INVALID_ARGUMENT naming the field, and the actor goes on serving the sessions that behave. Then
`kuberl serve` of the run answers each policy's sessions with that policy's checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import subprocess
import sys

import grpc
import numpy as np
import pytest

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from kuberl_client import EnvSessionClient, SessionError
from services.actor import main as actor_main
from services.buffer import main as buffer_main
from services.config import config_from_dict
from services.learner import main as learner_main
from tests.helpers import ROOT, TINY_PPO, Service, stats, write_config
from tests.integration.test_pipeline import _stats, _until

WAIT_S = 120.0
RED = ["red-0", "red-1"]          # CartPole's spaces (the env's): Box[4], Discrete(2)
BLUE = ["blue-0"]                 # its own: Box[6], Discrete(3)
STEPS = 60


def config_dict() -> dict:
    cfg = copy.deepcopy(TINY_PPO)
    cfg["env"] = {"id": "CartPole-v1", "mode": "external"}
    cfg["planner"] = {"enabled": False}
    cfg["actor"].update({"queue_fragments": 8192, "session_timeout_s": 60})
    cfg["policies"] = {"red": {"agents": ["red-*"]},
                       "blue": {"agents": ["blue-*"], "observation_shape": [6], "num_actions": 3}}
    return cfg


def red_client(address: str, session_id: str, **kw) -> EnvSessionClient:
    return EnvSessionClient(address, session_id=session_id, **{"policy": "red", "agent_ids": RED, "obs_shape": (4,),
                                                                "num_actions": 2, "timeout_s": WAIT_S, **kw})


def blue_client(address: str, session_id: str, **kw) -> EnvSessionClient:
    return EnvSessionClient(address, session_id=session_id, **{"policy": "blue", "agent_ids": BLUE, "obs_shape": (6,),
                                                                "num_actions": 3, "timeout_s": WAIT_S, **kw})


def play(address: str, game: str, steps: int = STEPS, seed: int = 0) -> dict[str, list]:
    """One game of both teams, stepped together: each team's session gets its own agents' data. Red's
    agents end their episodes every 10 steps (and act on with the next), blue's every 15. Returns every
    action each policy's session got, by team."""
    rng = np.random.default_rng(seed)
    got: dict[str, list] = {"red": [], "blue": []}
    with red_client(address, f"{game}/red") as red, blue_client(address, f"{game}/blue") as blue:
        teams = {"red": (red, RED, 4, 10), "blue": (blue, BLUE, 6, 15)}
        for name, (c, agents, size, _) in teams.items():
            got[name].append(c.reset({a: rng.normal(size=size).astype(np.float32) for a in agents}))
        for k in range(1, steps + 1):
            for name, (c, agents, size, every) in teams.items():
                ended = k % every == 0
                actions = c.step({a: rng.normal(size=size).astype(np.float32) for a in agents},
                                 rewards=dict.fromkeys(agents, 1.0), terminated=dict.fromkeys(agents, ended),
                                 truncated=dict.fromkeys(agents, False),
                                 final_observations={a: rng.normal(size=size).astype(np.float32) for a in agents}
                                 if ended else {})
                got[name].append(actions)
    return got


@contextlib.asynccontextmanager
async def stack(cfg, run_dir):
    """A buffer of two tables, a learner per policy (checkpoints as `kuberl up` lays them out) and one
    external-mode actor; yields the actor's, the buffer's and the learners' addresses."""
    async with contextlib.AsyncExitStack() as es:
        buffer = await es.enter_async_context(buffer_main.serving(cfg, listen="127.0.0.1:0"))
        learners = {name: await es.enter_async_context(learner_main.serving(
            cfg, listen="127.0.0.1:0", buffer=buffer.grpc, checkpoint_dir=str(run_dir / "checkpoints" / name),
            policy=name, learner_id=f"learner-{name}")) for name in cfg.policy_names}
        actor = await es.enter_async_context(actor_main.serving(
            cfg, listen="127.0.0.1:0", buffer=buffer.grpc, actor_id="actor-sim",
            learner=",".join(f"{name}={ep.grpc}" for name, ep in learners.items())))
        yield actor.grpc, buffer.grpc, {name: ep.grpc for name, ep in learners.items()}


def refused(address: str, client: EnvSessionClient) -> str:
    with pytest.raises(SessionError) as err:
        with client as c:
            c.hello()
    assert err.value.code == "INVALID_ARGUMENT", err.value
    return err.value.details


async def test_each_policys_session_steps_reach_its_learner_and_misuse_is_refused(tmp_path):
    cfg = config_from_dict(config_dict())
    async with stack(cfg, tmp_path) as (actor, buffer, learners):
        # Misuse: each refused with the field named; nothing of it is recorded.
        assert "policy: this run trains several policies (red, blue): name the one that plays" in await \
            asyncio.to_thread(refused, actor, red_client(actor, "x-0", policy=""))
        assert "policy: 'green' is not one of this actor's policies (red, blue)" in await \
            asyncio.to_thread(refused, actor, red_client(actor, "x-1", policy="green"))
        assert "observation_space: expected Box[6] float32, got Box[4] float32" in await \
            asyncio.to_thread(refused, actor, red_client(actor, "x-2", policy="blue", agent_ids=BLUE))
        assert ("agent_ids[1]: 'blue-0' is played by policy 'blue' (policies.blue.agents), not this session's "
                "policy 'red'") in await asyncio.to_thread(refused, actor, red_client(actor, "x-3",
                                                                                      agent_ids=["red-0", "blue-0"]))
        # Two games at once, each a session per team.
        games = await asyncio.gather(*(asyncio.to_thread(play, actor, f"game-{g}", seed=g) for g in range(2)))
        for got in games:   # each team's actions in its own policy's space
            assert all(set(a) == set(RED) and all(v in (0, 1) for v in a.values()) for a in got["red"])
            assert all(set(a) == set(BLUE) and all(v in (0, 1, 2) for v in a.values()) for a in got["blue"])
        # Every agent step of each team reached its own table, exactly (the sessions closed: all flushed).
        want = {"red": 2 * STEPS * len(RED), "blue": 2 * STEPS * len(BLUE)}
        b = await _until(lambda: _received(buffer, want), timeout=WAIT_S)
        assert b["buffer/samples_received_total"] == sum(want.values())
        assert b["buffer/fragments_invalid_total"] == 0
        # Each learner trained on its own table's steps, and its weights came back to the actor.
        a = await _until(lambda: _versions(actor, 1), timeout=WAIT_S)
        for name, address in learners.items():
            trained = await _stats(address, learner_pb2_grpc.LearnerStub)
            assert 0 < trained["learner/samples_total"] <= b[f"buffer/policies/{name}/samples_served_total"]
        assert a["actor/env_steps_total"] == sum(want.values())
        assert a["actor/sessions_refused_total"] == 4 and a["actor/sessions_total"] == 4
        assert a["actor/fragments_dropped_total"] == 0
        # Episodes carry their policy: red's agents ended 6 each per game, blue's 4.
        async with grpc.aio.insecure_channel(actor) as ch:
            episodes = (await actor_pb2_grpc.ActorStub(ch).GetStats(pb.GetStatsRequest(), timeout=10)).episodes
        assert sorted((e.policy, e.length) for e in episodes) == sorted(
            [("red", 10)] * 2 * 6 * len(RED) + [("blue", 15)] * 2 * 4 * len(BLUE))
    for name in ("red", "blue"):
        assert list((tmp_path / "checkpoints" / name).glob("ckpt-*.pt"))

    # `kuberl serve` of the run: each policy answers its own sessions, with its own spaces.
    config = write_config(tmp_path / "serve.yaml", {"actor": {"session_timeout_s": 60}})
    serve = Service("serve", tmp_path, config, module=False,
                    python_args=("-m", "services.cli.main", "serve", str(tmp_path)))
    try:
        address = await asyncio.to_thread(serve.wait_ready, timeout=WAIT_S)
        got = await asyncio.to_thread(play, address, "served", 12)
        assert all(set(a) == set(BLUE) and all(v in (0, 1, 2) for v in a.values()) for a in got["blue"])
        assert "policy: this run trains several policies (red, blue)" in await \
            asyncio.to_thread(refused, address, red_client(address, "x-4", policy=""))
        served = await asyncio.to_thread(stats, address, actor_pb2_grpc.ActorStub, timeout=30)
        assert served["actor/env_steps_total"] == 12 * (len(RED) + len(BLUE))
    finally:
        serve.kill()
    # A learner to follow for each policy, or a clear refusal before serving.
    bad = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "services.cli.main", "serve", str(tmp_path),
                                                   "--follow-learner", "red=127.0.0.1:1"],
                                  capture_output=True, text=True, timeout=WAIT_S, cwd=ROOT)
    assert bad.returncode == 2, bad
    assert "kuberl serve: --follow-learner: names red; this run's policies are red, blue" in bad.stderr, bad.stderr


async def _received(buffer: str, want: dict[str, int]):
    b = await _stats(buffer, buffer_pb2_grpc.BufferStub)
    done = all(b.get(f"buffer/policies/{name}/samples_received_total", 0) >= n for name, n in want.items())
    if done:
        assert all(b[f"buffer/policies/{name}/samples_received_total"] == n for name, n in want.items()), b
    return b if done else None


async def _versions(actor: str, floor: int):
    a = await _stats(actor, actor_pb2_grpc.ActorStub)
    return a if all(a.get(f"actor/policies/{name}/policy_version", 0) >= floor for name in ("red", "blue")) else None


def test_a_policy_declares_its_spaces_only_for_simulators():
    local = config_dict() | {"env": {"id": "CartPole-v1"}}
    with pytest.raises(ValueError, match=r"policies: \['red', 'blue'\] is invalid: several policies .* in envs of "
                                         r"several agents \(env.id pettingzoo:<module>, or simulators over EnvSession"):
        config_from_dict(local)
    both = config_dict()
    both["policies"]["blue"].pop("num_actions")
    with pytest.raises(ValueError, match=r"policies.blue.action_space: None is invalid: declare the observation "
                                         r"space .* and the action space .* together"):
        config_from_dict(both)

