"""`kuberl serve`: a checkpoint served over Actor.EnvSession as an inference-only actor. The Python client
and the Node.js example (examples/node-cartpole) get exactly the checkpoint's greedy actions (also
MultiDiscrete actions under masks, and a Box); a hello whose spaces are not the checkpoint policy's is
refused with INVALID_ARGUMENT; health, /metrics and GetStats report; `--follow-learner` swaps in a
learner's new weights (and refuses weights of another network, and older versions); `--stochastic`
samples from a seed drawn per process and logged; tokens work as on an actor; SIGTERM exits 0; a bad
checkpoint path is one line and exit code 2.

The checkpoints are untrained networks (tests/policies.py), made in the test: their greedy actions
still depend on the observation, which is all these tests need.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kuberl.v1 import actor_pb2_grpc, learner_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from kuberl_client import Box, EnvSessionClient, MultiDiscrete, SessionError
from services.cli.trained import load_trained
from services.common.net.grpcutil import start_server
from services.common.models.nets import to_numpy
from services.common.stats import Metrics
from services.common.protocol.weights import encode_weights
from services.learner.publish import WeightsHub
from services.learner.servicer import LearnerServicer
from tests.helpers import ROOT, Service, http_get, stats, wait_for, write_config
from tests.integration.test_node_simulator import EXAMPLES, node_example
from tests.policies import untrained
from tests.unit.cli.test_export import unimportable

CARTPOLE = {"algorithm": "ppo", "seed": 0, "env": {"id": "CartPole-v1"}, "ppo": {"hidden_sizes": [16]}}
# The serving process's own config names another env on purpose: the spaces checked must be the checkpoint's.
SERVE_CONFIG = {"env": {"id": "Acrobot-v1"}, "actor": {"session_timeout_s": 60}}
WAIT_S = 60.0


def start_serve(tmp_path, checkpoint, *args: str) -> Service:
    config = write_config(tmp_path / "serve.yaml", SERVE_CONFIG)
    return Service("serve", tmp_path, config, *args, module=False,
                   python_args=("-m", "services.cli.main", "serve", str(checkpoint)))


def greedy_actions(net: torch.nn.Module, obs: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    with torch.inference_mode():
        return (net(torch.from_numpy(obs)) if mask is None else net(torch.from_numpy(obs), torch.from_numpy(mask))).numpy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return untrained(tmp_path_factory.mktemp("serve") / "run", CARTPOLE)


@pytest.fixture(scope="module")
def greedy(checkpoint):
    return load_trained(checkpoint).greedy()


@pytest.fixture(scope="module")
def served(tmp_path_factory, checkpoint):
    proc = start_serve(tmp_path_factory.mktemp("served"), checkpoint)
    try:
        proc.wait_ready(WAIT_S)
        yield proc
    finally:
        proc.kill()


def _session(address: str, session_id: str, n: int, steps: int, seed: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Drive one session with random observations (and random episode ends); every (obs, actions, version)."""
    rng = np.random.default_rng(seed)
    seen = []
    with EnvSessionClient(address, session_id=session_id, obs_shape=(4,), num_actions=2, num_envs=n,
                          timeout_s=WAIT_S) as client:
        obs = rng.normal(size=(n, 4)).astype(np.float32)
        seen.append((obs, client.reset(obs), client.policy_version))
        for _ in range(steps):
            ended = rng.random(n) < 0.2
            final = rng.normal(size=(int(ended.sum()), 4)).astype(np.float32) if ended.any() else None
            obs = rng.normal(size=(n, 4)).astype(np.float32)
            actions = client.step(obs, np.ones(n, np.float32), ended, np.zeros(n, bool), final)
            seen.append((obs, actions, client.policy_version))
    return seen


def sessions_at_once(session, prefix: str) -> None:
    """Run `session(session_id, num_envs, seed)` for two sessions (3 and 5 envs) in threads at once;
    fail on any error either met."""
    errors: list[BaseException] = []

    def run(*args) -> None:
        try:
            session(*args)
        except BaseException as err:  # noqa: BLE001 - reported by the test thread below
            errors.append(err)
    threads = [threading.Thread(target=run, args=(f"{prefix}-{k}", n, k)) for k, n in enumerate((3, 5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    assert not errors, errors


def test_python_clients_get_the_checkpoints_greedy_actions(served, greedy):
    """Two sessions at once, every action checked."""
    results: dict[str, list] = {}

    def run(sid: str, n: int, seed: int):
        results[sid] = _session(served.address, sid, n, steps=40, seed=seed)
    sessions_at_once(run, "py")
    for sid, seen in results.items():
        for obs, actions, version in seen:
            assert actions.dtype == np.int64 and version == 0, sid
            np.testing.assert_array_equal(actions, greedy_actions(greedy, obs), err_msg=sid)
    assert sum(len({int(a) for a in np.concatenate([s[1] for s in seen])}) for seen in results.values()) > 2, \
        "the policy should not answer one action to everything"

    a = wait_for(lambda: (s := stats(served.address, actor_pb2_grpc.ActorStub))["actor/sessions_active"] == 0 and s,
                 timeout=WAIT_S, what="both sessions to close")
    assert a["actor/sessions_total"] >= 2 and a["actor/env_steps_total"] >= 40 * (3 + 5), a
    assert a["actor/policy_version"] == 0, a
    assert "actor/fragments_total" not in a and "actor/fragments_pushed_total" not in a, a  # nothing recorded


def test_a_session_of_agents_gets_every_agents_greedy_action(served, greedy):
    """`kuberl serve` answers each agent of a session of several agents (hello.agent_ids) as it acts."""
    rng = np.random.default_rng(5)
    ids = ["p0", "p1", "p2"]
    with EnvSessionClient(served.address, session_id="agents", agent_ids=ids, obs_shape=(4,), num_actions=2,
                          timeout_s=WAIT_S) as client:
        acting = ["p0", "p2"]
        observations = {a: rng.normal(size=4).astype(np.float32) for a in acting}
        actions = client.reset(observations)
        for _ in range(12):
            assert list(actions) == acting
            want = greedy_actions(greedy, np.stack([observations[a] for a in acting]))
            assert [actions[a] for a in acting] == want.tolist()
            nxt = ["p0", "p1", "p2"]   # p1 comes in on step 1 (its first step needs no join)
            observations = {a: rng.normal(size=4).astype(np.float32) for a in nxt}
            actions = client.step(observations, rewards=dict.fromkeys(acting, 0.0),
                                  terminated=dict.fromkeys(acting, False), truncated=dict.fromkeys(acting, False))
            acting = nxt


@pytest.mark.parametrize("kwargs, text", [
    ({"obs_shape": (6,), "num_actions": 2}, "observation_space: expected Box[4] float32, got Box[6] float32"),
    ({"obs_shape": (4,), "num_actions": 3}, "action_space: expected Discrete(2), got Discrete(3)"),
    ({"obs_shape": (4,), "action_space": Box.of((1,), -1.0, 1.0)}, "action_space: expected Discrete(2), got Box"),
])
def test_a_hello_with_other_spaces_gets_invalid_argument(served, kwargs, text):
    client = EnvSessionClient(served.address, session_id="wrong", num_envs=1, timeout_s=WAIT_S, **kwargs)
    with pytest.raises(SessionError) as err:
        client.hello()
    client.cancel()
    assert err.value.code == "INVALID_ARGUMENT" and text in str(err.value), err.value


def test_a_nan_observation_gets_invalid_argument_never_nan_actions(served):
    refused = stats(served.address, actor_pb2_grpc.ActorStub).get("actor/steps_refused_nonfinite_total")
    obs = np.zeros((2, 4), np.float32)
    obs[1, 3] = np.nan
    client = EnvSessionClient(served.address, session_id="nan", obs_shape=(4,), num_actions=2, num_envs=2,
                              timeout_s=WAIT_S)
    with pytest.raises(SessionError) as err:
        client.reset(obs)
    client.cancel()
    assert err.value.code == "INVALID_ARGUMENT", err.value
    assert err.value.details == "step 0: observations[3] of env 1 is nan (NaN and infinity are refused)"
    assert stats(served.address, actor_pb2_grpc.ActorStub)["actor/steps_refused_nonfinite_total"] == refused + 1


@pytest.mark.parametrize("greedy_actions_served", [True, False], ids=["deterministic", "stochastic"])
async def test_serve_refuses_infinity_in_one_session_and_answers_the_others(checkpoint, greedy_actions_served):
    """`kuberl serve` and `kuberl serve --stochastic` (the same `serving`, in this process): an infinite
    observation or reward ends its session with INVALID_ARGUMENT; a session beside it goes on."""
    from services.actor.serve import serving, serving_config
    from services.config import config_from_dict

    metrics = Metrics("actor")
    trained = load_trained(checkpoint, seed=3, greedy=greedy_actions_served, metrics=metrics)
    cfg = serving_config(trained.policy.cfg, config_from_dict(SERVE_CONFIG))
    n = 3
    good, zero, done = np.ones((n, 4), np.float32), np.zeros(n, np.float32), np.zeros(n, bool)

    def session(sid: str, first: np.ndarray, then: tuple | None = None):
        with EnvSessionClient(address, session_id=sid, obs_shape=(4,), num_actions=2, num_envs=n,
                              timeout_s=WAIT_S) as client:
            actions = [client.reset(first)]
            if then is not None:
                actions.append(client.step(*then))
            return actions

    async with serving({trained.name: trained.policy}, cfg, metrics, listen="127.0.0.1:0") as endpoints:
        address = endpoints.grpc
        beside = EnvSessionClient(address, session_id="beside", obs_shape=(4,), num_actions=2, num_envs=n,
                                  timeout_s=WAIT_S)
        try:  # (its blocking calls in a thread: the server runs on this event loop)
            await asyncio.to_thread(beside.reset, good)
            bad_obs = good.copy()
            bad_obs[0, 2] = -np.inf
            with pytest.raises(SessionError) as err:
                await asyncio.to_thread(session, "bad-obs", bad_obs)
            assert err.value.code == "INVALID_ARGUMENT"
            assert err.value.details.startswith("step 0: observations[2] of env 0 is -inf")
            inf_reward = np.array([0.0, np.inf, 0.0], np.float32)
            with pytest.raises(SessionError) as err:
                await asyncio.to_thread(session, "bad-reward", good, (good, inf_reward, done, done))
            assert err.value.code == "INVALID_ARGUMENT"
            assert err.value.details.startswith("step 1: rewards of env 1 is inf")
            actions = await asyncio.to_thread(beside.step, good, zero, done, done)
            assert actions.dtype == np.int64 and actions.shape == (n,) and set(actions.tolist()) <= {0, 1}
            await asyncio.to_thread(beside.close)
        finally:
            beside.cancel()
    assert metrics.counters["actor/steps_refused_nonfinite_total"] == 2
    assert metrics.counters["actor/sessions_total"] == 3


def test_health_reflection_metrics_and_probes(served):
    with grpc.insecure_channel(served.address) as ch:
        got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kuberl.v1.Actor"), timeout=10)
        assert got.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert "kuberl.v1.Actor" in names, names
    status, body = http_get(served.metrics, "/metrics")
    assert status == 200 and "kuberl_actor_sessions_active" in body and "kuberl_actor_policy_version" in body
    assert http_get(served.metrics, "/readyz")[0] == 200 and http_get(served.metrics, "/livez")[0] == 200
    with grpc.insecure_channel(served.address) as ch:
        reply = actor_pb2_grpc.ActorStub(ch).GetStats(pb.GetStatsRequest(), timeout=10)
    assert reply.role == "actor" and reply.instance_id.startswith("serve-"), reply.instance_id



@pytest.mark.parametrize("cfg, space", [
    # MultiDiscrete actions under the simulator's masks: the greedy choice among the allowed values.
    ({"algorithm": "ppo", "env": {"id": "kuberl_envs:MaskedChoice-v0"}, "ppo": {"hidden_sizes": [16]}},
     MultiDiscrete((4, 3))),
    # A Box action: SAC's squashed mean, float32 within the bounds.
    ({"algorithm": "sac", "env": {"id": "Pendulum-v1"}, "sac": {"hidden_sizes": [16]}}, Box.of((1,), -2.0, 2.0)),
], ids=["masked-multidiscrete", "box"])
def test_masked_and_box_policies_are_served_greedy(tmp_path, cfg, space):
    trained = load_trained(untrained(tmp_path / "run", cfg))
    net, (obs_dim,) = trained.greedy(), trained.spec.obs_shape
    proc = start_serve(tmp_path, trained.checkpoint)
    rng = np.random.default_rng(0)
    n = 6
    try:
        client = EnvSessionClient(proc.wait_ready(WAIT_S), session_id="spaces", obs_shape=(obs_dim,),
                                  action_space=space, num_envs=n, timeout_s=WAIT_S)
        with client:
            for k in range(10):
                obs = rng.random((n, obs_dim), dtype=np.float32)
                mask = None
                if space.mask_width:
                    mask = rng.random((n, space.mask_width)) < 0.5
                    mask[:, 0] = mask[:, 4] = True  # at least one allowed value per choice
                if k == 0:
                    actions = client.reset(obs, action_masks=mask)
                else:
                    actions = client.step(obs, np.zeros(n, np.float32), np.zeros(n, bool), np.zeros(n, bool),
                                          action_masks=mask)
                want = greedy_actions(net, obs, mask)
                if isinstance(space, Box):
                    assert actions.dtype == np.float32 and np.all(np.abs(actions) <= 2.0)
                    np.testing.assert_allclose(actions, want, rtol=1e-6, atol=1e-6)
                else:
                    assert actions.dtype == np.int64
                    np.testing.assert_array_equal(actions, want)
                    allowed = np.concatenate([mask[:, :4][np.arange(n), actions[:, 0]][:, None],
                                              mask[:, 4:][np.arange(n), actions[:, 1]][:, None]], axis=1)
                    assert allowed.all(), "a masked-out value was chosen"
    finally:
        proc.kill()


# -- the Node.js example ------------------------------------------------------------------------------
def _mulberry32(seed: int):
    """examples/node-common/envsession.js's rng(): the simulator's seeded initial states."""
    m, a = 0xFFFFFFFF, seed & 0xFFFFFFFF

    def draw() -> float:
        nonlocal a
        a = (a + 0x6D2B79F5) & m
        t = ((a ^ (a >> 15)) * (a | 1)) & m
        t ^= (t + (((t ^ (t >> 7)) * (t | 61)) & m)) & m
        return ((t ^ (t >> 14)) & m) / 4294967296
    return draw


def _node_cartpole_episodes(greedy, n: int, steps: int, seed: int) -> list[int]:
    """What examples/node-cartpole does with the greedy policy's actions, in Python: its copies' initial
    states from its rng, stepped by gymnasium's CartPole (whose arithmetic the example repeats), reset
    in env order after each lockstep step. The episode lengths (= returns) in the order they end."""
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv

    draw = _mulberry32(seed)
    envs, elapsed, lengths = [CartPoleEnv() for _ in range(n)], [0] * n, []

    def reset(i: int) -> None:
        envs[i].state = np.array([draw() * 0.1 - 0.05 for _ in range(4)])
        envs[i].steps_beyond_terminated = None
        elapsed[i] = 0
    for i in range(n):
        reset(i)
    for _ in range(steps):
        obs = np.stack([np.asarray(e.state, np.float32) for e in envs])
        actions = greedy_actions(greedy, obs)
        ended = []
        for i, env in enumerate(envs):
            _, _, terminated, _, _ = env.step(int(actions[i]))
            elapsed[i] += 1
            if terminated or elapsed[i] >= 500:
                ended.append(i)
        for i in ended:
            lengths.append(elapsed[i])
            reset(i)
    return lengths


def test_the_node_example_gets_the_checkpoints_greedy_actions(served, greedy):
    node = node_example("node-cartpole")
    envs, steps, seed = 4, 1500, 7  # (this untrained policy balances for 250-500 steps: 12 episodes)
    cursor = stats(served.address, actor_pb2_grpc.ActorStub).get("actor/episodes_total", 0)
    run = subprocess.run([node, "cartpole.js", "--actor", served.address, "--envs", str(envs), "--steps", str(steps),
                          "--seed", str(seed), "--session", "node-serve", "--reconnect-every", "0",
                          "--reply-timeout", str(int(WAIT_S))], cwd=EXAMPLES / "node-cartpole",
                         capture_output=True, text=True, timeout=WAIT_S * 2)
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    expected = _node_cartpole_episodes(greedy, envs, steps, seed)
    assert result["env_steps"] == envs * steps and result["policy_version_last"] == 0, result
    assert result["episodes"] == len(expected) >= 8, (result, expected)
    assert result["mean_return_first_100"] == pytest.approx(float(np.mean(expected[:100]))), (result, expected)

    # The served side saw the same episodes, in the same order.
    wait_for(lambda: stats(served.address, actor_pb2_grpc.ActorStub)["actor/sessions_active"] == 0,
             timeout=WAIT_S, what="the Node session to close")
    with grpc.insecure_channel(served.address) as ch:
        reply = actor_pb2_grpc.ActorStub(ch).GetStats(pb.GetStatsRequest(episodes_after=int(cursor)), timeout=10)
    assert [int(e.length) for e in reply.episodes] == expected
    assert [e.episode_return for e in reply.episodes] == [float(n) for n in expected]


# -- following a learner, SIGTERM, refusals -----------------------------------------------------------
async def _learner(hub: WeightsHub):
    return await start_server("127.0.0.1:0", lambda s: learner_pb2_grpc.add_LearnerServicer_to_server(
        LearnerServicer(hub, Metrics("learner")), s), ["kuberl.v1.Learner"], max_message_bytes=64 << 20)


async def test_follow_learner_swaps_in_new_versions_and_sigterm_exits_0(tmp_path, checkpoint, greedy):
    """Also with tokens (--auth-token-files, as the actor takes them): a hello without one is refused."""
    token = "f" * 64
    (tmp_path / "tokens").write_text(f"{token}\n")
    newer = load_trained(untrained(tmp_path / "newer", {**CARTPOLE, "seed": 1}))  # other weights, same network
    other = load_trained(untrained(tmp_path / "other", {**CARTPOLE, "ppo": {"hidden_sizes": [8]}}))
    hub = WeightsHub()
    srv = await _learner(hub)
    proc = start_serve(tmp_path, checkpoint, "--follow-learner", srv.address,
                       "--auth-token-files", str(tmp_path / "tokens"))
    client = None
    try:
        address = await asyncio.to_thread(proc.wait_ready, WAIT_S)
        anonymous = EnvSessionClient(address, session_id="anonymous", obs_shape=(4,), num_actions=2, num_envs=1,
                                     timeout_s=WAIT_S)
        with pytest.raises(SessionError) as err:
            await asyncio.to_thread(anonymous.hello)
        anonymous.cancel()
        assert err.value.code == "UNAUTHENTICATED", err.value
        n = 32
        client = EnvSessionClient(address, session_id="follow", obs_shape=(4,), num_actions=2, num_envs=n,
                                  timeout_s=WAIT_S, token=token)
        obs = np.random.default_rng(0).normal(size=(n, 4)).astype(np.float32)
        zero, done = np.zeros(n, np.float32), np.zeros(n, bool)
        actions = await asyncio.to_thread(client.reset, obs)
        assert client.policy_version == 0
        np.testing.assert_array_equal(actions, greedy_actions(greedy, obs))

        async def served_stats():
            return await asyncio.to_thread(stats, address, actor_pb2_grpc.ActorStub)

        async def refused(version: int, net: torch.nn.Module, counter: str, serving: int, acting) -> None:
            """Publish `version`; once `counter` counts it, the session still gets version `serving`'s actions."""
            want = (await served_stats()).get(counter, 0) + 1
            hub.publish(encode_weights(version, to_numpy(net)))
            for _ in range(int(WAIT_S / 0.05)):
                if (await served_stats()).get(counter, 0) >= want:
                    break
                await asyncio.sleep(0.05)
            actions = await asyncio.to_thread(client.step, obs, zero, done, done)
            assert client.policy_version == serving
            np.testing.assert_array_equal(actions, greedy_actions(acting, obs))

        async def swapped(version: int, trained) -> None:
            """Publish `version`; it is swapped in between two batches and its greedy actions come back."""
            hub.publish(encode_weights(version, to_numpy(trained.policy.net)))
            for _ in range(int(WAIT_S / 0.05)):
                actions = await asyncio.to_thread(client.step, obs, zero, done, done)
                if client.policy_version == version:
                    break
                await asyncio.sleep(0.05)
            assert client.policy_version == version
            np.testing.assert_array_equal(actions, greedy_actions(trained.greedy(), obs))

        # Weights of another network: refused and counted; the checkpoint's stay.
        await refused(5, other.policy.net, "actor/weights_invalid_total", 0, greedy)
        # A new version of this network: swapped in between two batches.
        await swapped(7, newer)
        assert not np.array_equal(greedy_actions(newer.greedy(), obs), greedy_actions(greedy, obs)), \
            "the two policies should differ on these observations"
        a = await served_stats()
        assert a["actor/policy_version"] == 7 and a["actor/weights_invalid_total"] == 1, a
        # An older version (a learner restored from an earlier checkpoint): refused and counted, version
        # 7 stays; the next newer version is taken again.
        original = load_trained(checkpoint)
        await refused(6, original.policy.net, "actor/weights_older_total", 7, newer.greedy())
        await swapped(8, original)
        a = await served_stats()
        assert a["actor/weights_older_total"] == 1 and a["actor/weights_invalid_total"] == 1, a
        assert "refusing weights version 6" in proc.output() and "after 1 older versions refused" in proc.output()

        # SIGTERM with a session open: the session ends, the process exits 0.
        assert await asyncio.to_thread(proc.terminate) == 0, proc.output()
        with pytest.raises(SessionError):
            await asyncio.to_thread(client.step, obs, zero, done, done)
        assert "serve stopped cleanly" in proc.output()
    finally:
        if client is not None:
            client.cancel()
        proc.kill()
        hub.close()
        await srv.server.stop(None)


def test_stochastic_serving_samples_from_a_seed_of_its_own(tmp_path, checkpoint, greedy):
    """Without --seed the process draws one and logs it (replicas must not all sample alike); the
    actions are the sampling policy's under that seed."""
    import re

    proc = start_serve(tmp_path, checkpoint, "--stochastic")
    try:
        address = proc.wait_ready(WAIT_S)
        seed = int(re.search(r"stochastic \(seed (\d+)\)", proc.output()).group(1))
        n = 64
        obs = np.random.default_rng(3).normal(size=(n, 4)).astype(np.float32)
        with EnvSessionClient(address, session_id="sampled", obs_shape=(4,), num_actions=2, num_envs=n,
                              timeout_s=WAIT_S) as client:
            first = client.reset(obs)
            second = client.step(obs, np.zeros(n, np.float32), np.zeros(n, bool), np.zeros(n, bool))
    finally:
        proc.kill()
    local = load_trained(checkpoint, seed=seed).policy
    np.testing.assert_array_equal(first, local.act(obs)[0])
    np.testing.assert_array_equal(second, local.act(obs)[0])
    assert not np.array_equal(first, second) and not np.array_equal(first, greedy_actions(greedy, obs)), \
        "sampled actions should vary"
    assert seed != 0


def test_a_policy_whose_env_cannot_be_imported_here_is_served_from_the_checkpoint(tmp_path):
    """A user's `module:EnvId` need not be importable where the policy is served: the checkpoint holds
    the policy's spaces, and sessions get its greedy actions."""
    gone = unimportable(untrained(tmp_path / "run", CARTPOLE))
    greedy = load_trained(gone).greedy()
    proc = start_serve(tmp_path, gone)
    try:
        address = proc.wait_ready(WAIT_S)
        assert "kuberl_gone_module:Gone-v0" in proc.output()   # (the description of what is served)
        for obs, actions, _ in _session(address, "gone", 3, 4, seed=0):
            np.testing.assert_array_equal(actions, greedy_actions(greedy, obs))
        assert proc.terminate() == 0, proc.output()
    finally:
        proc.kill()


def test_a_bad_checkpoint_path_is_one_line_and_exit_code_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "services.cli.main", "serve", str(tmp_path / "nowhere"),
                          "--listen", "127.0.0.1:0", "--metrics-listen", ""], cwd=ROOT, capture_output=True,
                         text=True, timeout=WAIT_S)
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"kuberl serve: {tmp_path / 'nowhere'}: no such run directory or checkpoint file\n"


def test_a_recurrent_policy_is_served_with_each_envs_state_reset_at_its_episodes_end(tmp_path):
    """ppo.recurrent: `kuberl serve` keeps each session env's state, starts it afresh where the
    simulator reports an episode's end, and keeps it across a handover (same session_id, step 0
    re-sending the observations the dropped actions were chosen on). Two sessions at once; every
    action is the local greedy policy's stepped with the same state, and the actions depend on it."""
    def louder(algo):
        with torch.no_grad():
            algo.net.actor.weight.mul_(300.0)
    cfg = {**CARTPOLE, "ppo": {"hidden_sizes": [16], "recurrent": "lstm", "recurrent_size": 8}}
    checkpoint = untrained(tmp_path / "run", cfg, louder)
    net = load_trained(checkpoint).greedy()
    proc = start_serve(tmp_path, checkpoint)

    def session(sid: str, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        state = np.zeros((n, 16), np.float32)

        def expect(obs, got):
            nonlocal state
            with torch.inference_mode():
                want, after = net(torch.from_numpy(obs), torch.from_numpy(state))
            np.testing.assert_array_equal(got, want.numpy())
            return after.numpy().copy()
        obs = rng.normal(size=(n, 4)).astype(np.float32)
        with EnvSessionClient(proc.address, session_id=sid, obs_shape=(4,), num_actions=2, num_envs=n,
                              timeout_s=WAIT_S) as client:
            acted_from, state = state, expect(obs, client.reset(obs))
            for _ in range(30):
                ended = rng.random(n) < 0.15
                final = rng.normal(size=(int(ended.sum()), 4)).astype(np.float32) if ended.any() else None
                obs = rng.normal(size=(n, 4)).astype(np.float32)
                state[ended] = 0.0
                actions = client.step(obs, np.ones(n, np.float32), ended, np.zeros(n, bool), final)
                acted_from, state = state.copy(), expect(obs, actions)
        # A handover: the same session_id resumes from the state the last actions were chosen from.
        state = acted_from
        with EnvSessionClient(proc.address, session_id=sid, obs_shape=(4,), num_actions=2, num_envs=n,
                              timeout_s=WAIT_S) as client:
            state = expect(obs, client.reset(obs))
            assert client.resumed
    try:
        proc.wait_ready(WAIT_S)
        sessions_at_once(session, "rec")
    finally:
        proc.kill()
    # The state matters: from the zero state the same observations give other actions somewhere.
    obs = np.random.default_rng(9).normal(size=(64, 4)).astype(np.float32)
    with torch.inference_mode():
        a, s = net(torch.from_numpy(obs), torch.zeros(64, 16))
        b, _ = net(torch.from_numpy(obs), s)
    assert not torch.equal(a, b)
