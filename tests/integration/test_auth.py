"""Bearer tokens and session caps (services/common/net/auth.py, docs/security.md), end to end: a real
actor in env.mode external with buffer and learner (processes) and kuberl_client sessions; the planner
in process with the CLI against it; once combined with mutual TLS."""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess

import grpc
import numpy as np
import pytest

from kuberl.v1 import buffer_pb2, buffer_pb2_grpc, planner_pb2, planner_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from kuberl_client import EnvSessionClient, SessionError
from services.cli.main import main as kuberl
from services.config import config_from_dict
from services.common.net.tls import open_channel
from services.planner import main as planner_main
from services.common.stats import Metrics
from services.planner.observe import GrpcStats
from tests.certs import Pki
from tests.helpers import TINY_PPO, Service, write_config
from tests.integration.test_env_session_client import OBS_SHAPE, WAIT_S, Stack, external_config
from tests.integration.test_node_simulator import EXAMPLES, node_example
from tests.integration.test_tls import StaticBackend

GOOD, OLD, NEW = "a" * 64, "b" * 64, "c" * 64
READER, SIM = "d" * 64, "e" * 64


def write_tokens(path, *lines: str) -> str:
    """Replace the token file at once (as the kubelet updates a mounted Secret), with a new mtime."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# kuberl tokens\n" + "".join(f"{line}\n" for line in lines))
    os.replace(tmp, path)
    return str(path)


def session(address: str, session_id: str, **kw) -> EnvSessionClient:
    return EnvSessionClient(address, session_id=session_id, num_envs=1, obs_shape=OBS_SHAPE, num_actions=2,
                            timeout_s=WAIT_S, **kw)


def refusal(address: str, session_id: str, **kw) -> SessionError:
    client = session(address, session_id, **kw)
    try:
        with pytest.raises(SessionError) as err:
            client.reset(np.zeros((1, *OBS_SHAPE), np.float32))
        return err.value
    finally:
        client.close()


def play(address: str, session_id: str, steps: int = 3, **kw) -> None:
    client = session(address, session_id, **kw)
    try:
        client.reset(np.zeros((1, *OBS_SHAPE), np.float32))
        for _ in range(steps):
            client.step(np.zeros((1, *OBS_SHAPE), np.float32), np.zeros(1, np.float32), np.zeros(1, bool), np.zeros(1, bool))
    finally:
        client.close()


@pytest.fixture
def tokens(tmp_path):
    return tmp_path / "tokens"


def test_env_sessions_need_a_token_with_scope_and_tokens_rotate_without_a_restart(tmp_path, tokens):
    write_tokens(tokens, GOOD, f"{READER} read", OLD)
    cfg = external_config()
    cfg["auth"] = {"token_files": [str(tokens)], "max_sessions_per_token": 2}
    s = Stack(tmp_path, cfg)
    try:
        good = session(s.actor, "good", token=GOOD)
        good.reset(np.zeros((1, *OBS_SHAPE), np.float32))   # a good client plays on while others are refused
        assert refusal(s.actor, "none").code == "UNAUTHENTICATED"
        err = refusal(s.actor, "wrong", token="f" * 64)
        assert err.code == "UNAUTHENTICATED" and "f" * 64 not in err.details
        err = refusal(s.actor, "reader", token=READER)
        assert err.code == "PERMISSION_DENIED" and "envsession" in err.details
        play(s.actor, "old", token=OLD)
        # Rotation: add the new token; both work. Remove the old one; it is refused.
        write_tokens(tokens, GOOD, f"{READER} read", OLD, NEW)
        play(s.actor, "new", token=NEW)
        play(s.actor, "old-again", token=OLD)
        write_tokens(tokens, GOOD, f"{READER} read", NEW)
        assert refusal(s.actor, "old-gone", token=OLD).code == "UNAUTHENTICATED"
        (tmp_path / "new.token").write_text(NEW + "\n")
        play(s.actor, "from-file", token_file=str(tmp_path / "new.token"))
        # The cap: GOOD holds one session; a second is allowed, a third refused.
        second = session(s.actor, "good-2", token=GOOD)
        second.reset(np.zeros((1, *OBS_SHAPE), np.float32))
        err = refusal(s.actor, "good-3", token=GOOD)
        assert err.code == "RESOURCE_EXHAUSTED" and "auth.max_sessions_per_token" in err.details
        second.close()
        for _ in range(3):
            good.step(np.zeros((1, *OBS_SHAPE), np.float32), np.zeros(1, np.float32), np.zeros(1, bool), np.zeros(1, bool))
        good.close()
        stats = s.actor_stats()   # GetStats stays open: protect_reads is off
        assert stats["actor/sessions_refused_cap_total"] == 1
        assert stats["actor/auth_refused_total"] == 3 and stats["actor/auth_denied_total"] == 1
    finally:
        s.close()


def test_new_sessions_per_minute_caps_each_peer_without_tokens(tmp_path):
    cfg = external_config()
    cfg["auth"] = {"new_sessions_per_minute": 2}
    s = Stack(tmp_path, cfg)
    try:
        play(s.actor, "one", steps=1)
        play(s.actor, "two", steps=1)
        err = refusal(s.actor, "three")
        assert err.code == "RESOURCE_EXHAUSTED" and "auth.new_sessions_per_minute" in err.details
        assert s.actor_stats()["actor/sessions_refused_rate_total"] == 1
    finally:
        s.close()


def _planner_cfg(tokens, **auth) -> dict:
    data = copy.deepcopy(TINY_PPO)
    data["planner"] = {"enabled": False}
    data["auth"] = {"token_files": [str(tokens)], **auth}
    return data


async def _call(address: str, rpc: str, request, token: str | None = None, tls=None):
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with open_channel(address, tls, aio=True) as ch:
        return await getattr(planner_pb2_grpc.PlannerStub(ch), rpc)(request, timeout=30, metadata=metadata)


async def _code(address: str, rpc: str, request, token: str | None = None, tls=None) -> grpc.StatusCode:
    try:
        await _call(address, rpc, request, token, tls)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def test_planner_writes_need_a_token_and_reads_stay_open_unless_protected(tmp_path, tokens, capsys,
                                                                               monkeypatch):
    write_tokens(tokens, f"{GOOD} planner:write,read", f"{READER} read", SIM + " envsession")
    monkeypatch.delenv("KUBERL_TOKEN", raising=False)
    monkeypatch.delenv("KUBERL_TOKEN_FILE", raising=False)
    backend = StaticBackend(actor="127.0.0.1:1", learner="127.0.0.1:1", buffer="127.0.0.1:1")
    cfg = config_from_dict(_planner_cfg(tokens))
    async with planner_main.serving(cfg, backend, listen="127.0.0.1:0") as (endpoints, planner):
        address = endpoints.grpc
        assert await _code(address, "Pause", planner_pb2.PauseRequest()) == grpc.StatusCode.UNAUTHENTICATED
        assert await _code(address, "Pause", planner_pb2.PauseRequest(), "x") == grpc.StatusCode.UNAUTHENTICATED
        assert await _code(address, "Pause", planner_pb2.PauseRequest(), READER) == grpc.StatusCode.PERMISSION_DENIED
        assert await _code(address, "Pause", planner_pb2.PauseRequest(), SIM) == grpc.StatusCode.PERMISSION_DENIED
        assert not planner.paused
        assert await _code(address, "GetStats", pb.GetStatsRequest()) == grpc.StatusCode.OK
        assert await _code(address, "GetStatus", planner_pb2.GetStatusRequest()) == grpc.StatusCode.OK
        assert (await _call(address, "Pause", planner_pb2.PauseRequest(reason="t"), GOOD)).paused
        # The CLI: refused without a token, done with --token-file or $KUBERL_TOKEN.
        (tmp_path / "cli.token").write_text(f"# mine\n{GOOD} planner:write\n")
        capsys.readouterr()
        assert await asyncio.to_thread(kuberl, ["resume", "--planner", address]) != 0
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert planner.paused
        assert await asyncio.to_thread(kuberl, ["resume", "--planner", address, "--token-file",
                                                str(tmp_path / "cli.token")]) == 0
        assert not planner.paused
        monkeypatch.setenv("KUBERL_TOKEN", GOOD)
        assert await asyncio.to_thread(kuberl, ["pause", "--planner", address]) == 0
        assert planner.paused
    cfg = config_from_dict(_planner_cfg(tokens, protect_reads=True))
    async with planner_main.serving(cfg, backend, listen="127.0.0.1:0") as (endpoints, planner):
        address = endpoints.grpc
        assert await _code(address, "GetStats", pb.GetStatsRequest()) == grpc.StatusCode.UNAUTHENTICATED
        assert await _code(address, "GetStatus", planner_pb2.GetStatusRequest(), SIM) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert await _code(address, "GetStats", pb.GetStatsRequest(), READER) == grpc.StatusCode.OK
        assert await asyncio.to_thread(kuberl, ["stats", address]) == 0   # $KUBERL_TOKEN (scopes all but envsession)


async def test_tokens_with_mutual_tls_and_the_planner_reads_protected_stats(tmp_path, tokens, monkeypatch):
    monkeypatch.delenv("KUBERL_TOKEN", raising=False)
    role = Pki(tmp_path / "pki").issue("role")
    write_tokens(tokens, f"{GOOD} planner:write,read")
    (tmp_path / "role.token").write_text(GOOD + "\n")
    data = {**_planner_cfg(tokens, protect_reads=True, client_token_file=str(tmp_path / "role.token")),
            "tls": role.tls()}
    cfg = config_from_dict(data)
    backend = StaticBackend(actor="127.0.0.1:1", learner="127.0.0.1:1", buffer="127.0.0.1:1")
    async with planner_main.serving(cfg, backend, listen="127.0.0.1:0") as (endpoints, planner):
        address = endpoints.grpc
        assert await _code(address, "Resume", planner_pb2.ResumeRequest(), tls=cfg.tls) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert await _code(address, "Resume", planner_pb2.ResumeRequest(), GOOD, tls=cfg.tls) == grpc.StatusCode.OK
    # The planner reads a role's protected GetStats with auth.client_token_file, over mutual TLS.
    buffer = Service("buffer", tmp_path, write_config(tmp_path / "c.yaml", data))
    try:
        address = buffer.wait_ready(timeout=3 * WAIT_S)
        reader = GrpcStats(cfg, Metrics("planner"))
        try:
            resp = await reader.get_stats("buffer", "buffer-0", address, pb.GetStatsRequest())
            assert resp is not None and resp.role == "buffer"
            (tmp_path / "role.token").write_text("f" * 64 + "\n")   # a token the buffer does not know
            assert await reader.get_stats("buffer", "buffer-0", address, pb.GetStatsRequest()) is None
        finally:
            await reader.close()
    finally:
        buffer.kill()


def test_kuberl_stats_sends_the_token_to_a_role(tmp_path, tokens, capsys, monkeypatch):
    monkeypatch.delenv("KUBERL_TOKEN", raising=False)
    write_tokens(tokens, f"{READER} read")
    cfg = external_config()
    cfg["auth"] = {"token_files": [str(tokens)], "protect_reads": True}
    buffer = Service("buffer", tmp_path, write_config(tmp_path / "c.yaml", cfg))
    try:
        address = buffer.wait_ready(timeout=3 * WAIT_S)
        capsys.readouterr()
        assert kuberl(["stats", address]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().out
        (tmp_path / "r.token").write_text(READER + "\n")
        assert kuberl(["stats", address, "--token-file", str(tmp_path / "r.token")]) == 0
        with grpc.insecure_channel(address) as ch:
            stub = buffer_pb2_grpc.BufferStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetStats(pb.GetStatsRequest(), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Internal RPCs are not asked for a token (mutual TLS guards them): ReportProgress is answered
            # by the buffer itself (this empty report is invalid).
            with pytest.raises(grpc.RpcError) as err:
                stub.ReportProgress(buffer_pb2.LearnerProgress(), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        buffer.kill()


def test_node_simulator_sends_its_token(tmp_path, tokens):
    node = node_example("node-cartpole")
    write_tokens(tokens, f"{SIM} envsession")
    cfg = external_config()
    cfg["auth"] = {"token_files": [str(tokens)]}
    s = Stack(tmp_path, cfg)

    def simulate(**env) -> subprocess.CompletedProcess:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KUBERL_TOKEN")}
        return subprocess.run([node, "cartpole.js", "--actor", s.actor, "--envs", "2", "--steps", "20",
                               "--reply-timeout", str(int(WAIT_S))], cwd=EXAMPLES / "node-cartpole",
                              capture_output=True, text=True, timeout=WAIT_S, env={**clean, **env})
    try:
        run = simulate()
        assert run.returncode == 1 and "UNAUTHENTICATED" in run.stderr, run.stderr
        (tmp_path / "sim.token").write_text(f"# simulator\n{SIM}\n")
        run = simulate(KUBERL_TOKEN_FILE=str(tmp_path / "sim.token"))
        assert run.returncode == 0, run.stderr
        assert "without TLS" in run.stderr
        run = simulate(KUBERL_TOKEN=SIM)
        assert run.returncode == 0, run.stderr
    finally:
        s.close()
