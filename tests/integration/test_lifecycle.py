"""Services as real processes: SIGTERM exits 0, restart from checkpoint, peers down at start-up or
dying mid-stream, a crashing loop ending the process, and a buffer that runs without torch."""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc
from tests.helpers import TINY_DQN, TINY_PPO, Service, stats, wait_for, write_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _counter(address, stub, name):
    try:
        return stats(address, stub).get(name, 0)
    except grpc.RpcError:
        return 0


@pytest.fixture
def trio(tmp_path):
    """A running buffer, learner and actor (tiny PPO); terminated at the end if still alive."""
    config = write_config(tmp_path / "c.yaml", TINY_PPO)
    procs = {}
    procs["buffer"] = Service("buffer", tmp_path, config)
    buffer = procs["buffer"].wait_ready()
    procs["learner"] = Service("learner", tmp_path, config, "--buffer", buffer, "--checkpoint-dir", str(tmp_path / "ck"))
    learner = procs["learner"].wait_ready()
    procs["actor"] = Service("actor", tmp_path, config, "--buffer", buffer, "--learner", learner)
    procs["actor"].wait_ready()
    yield procs, config
    for p in procs.values():
        p.kill()


def test_sigterm_exits_zero_for_every_service_and_the_learner_restores(trio, tmp_path):
    procs, config = trio
    learner = procs["learner"].address
    wait_for(lambda: _counter(learner, learner_pb2_grpc.LearnerStub, "learner/updates_total") >= 2,
             what="learner updates")
    for role in ("actor", "learner", "buffer"):  # the order `kuberl up` uses
        assert procs[role].terminate() == 0, procs[role].output()
    assert "stopped cleanly" in procs["learner"].output()
    ckpts = sorted((tmp_path / "ck").glob("ckpt-*.pt"))
    saved = int(ckpts[-1].stem.split("-")[1])
    assert saved >= 2
    # A new learner on the same checkpoint directory continues from the saved version.
    buffer = Service("buffer", tmp_path, config)
    again = Service("learner", tmp_path, config, "--buffer", buffer.wait_ready(), "--checkpoint-dir", str(tmp_path / "ck"))
    try:
        assert stats(again.wait_ready(), learner_pb2_grpc.LearnerStub)["learner/policy_version"] == saved
    finally:
        assert again.terminate() == 0 and buffer.terminate() == 0


def test_peers_down_at_startup_are_waited_for(tmp_path):
    config = write_config(tmp_path / "c.yaml", TINY_PPO)
    bport, lport = _free_port(), _free_port()
    actor = Service("actor", tmp_path, config, "--buffer", f"127.0.0.1:{bport}", "--learner", f"127.0.0.1:{lport}")
    buffer = learner = None
    try:
        address = actor.wait_ready()
        assert stats(address, actor_pb2_grpc.ActorStub).get("actor/env_steps_total", 0) == 0  # no weights yet
        buffer = Service("buffer", tmp_path, config, listen=f"127.0.0.1:{bport}")
        buffer.wait_ready()
        learner = Service("learner", tmp_path, config, "--buffer", f"127.0.0.1:{bport}",
                          "--checkpoint-dir", str(tmp_path / "ck"), listen=f"127.0.0.1:{lport}")
        learner.wait_ready()
        wait_for(lambda: _counter(buffer.address, buffer_pb2_grpc.BufferStub, "buffer/fragments_received_total") > 0,
                 what="fragments reaching the late buffer")
        wait_for(lambda: _counter(address, actor_pb2_grpc.ActorStub, "actor/policy_version") >= 1,
                 what="trained weights reaching the actor")
    finally:
        for p in (actor, learner, buffer):
            if p is not None:
                assert p.terminate() == 0, p.output()


def test_buffer_dying_mid_stream_does_not_stop_the_actor(trio, tmp_path):
    procs, config = trio
    actor, buffer = procs["actor"].address, procs["buffer"].address
    wait_for(lambda: _counter(buffer, buffer_pb2_grpc.BufferStub, "buffer/fragments_received_total") > 2,
             what="fragments flowing")
    procs["buffer"].kill()  # SIGKILL: no goodbye on the open streams
    steps = stats(actor, actor_pb2_grpc.ActorStub)["actor/env_steps_total"]
    wait_for(lambda: stats(actor, actor_pb2_grpc.ActorStub)["actor/push_stream_errors_total"] >= 1,
             what="the actor noticing the broken stream")
    wait_for(lambda: stats(actor, actor_pb2_grpc.ActorStub)["actor/env_steps_total"] > steps,
             what="the actor stepping on while the buffer is down")
    # A replacement buffer on the same address gets fragments again, and the learner trains again.
    procs["buffer"] = Service("buffer", tmp_path, config, listen=buffer)
    procs["buffer"].wait_ready()
    wait_for(lambda: _counter(buffer, buffer_pb2_grpc.BufferStub, "buffer/fragments_received_total") > 0,
             what="fragments reaching the replacement buffer")
    wait_for(lambda: _counter(buffer, buffer_pb2_grpc.BufferStub, "buffer/batches_served_total") > 0,
             what="the learner streaming from the replacement buffer")
    assert procs["actor"].popen.poll() is None and procs["learner"].popen.poll() is None


def test_learner_dying_mid_stream_does_not_stop_the_actor(trio):
    procs, _ = trio
    actor = procs["actor"].address
    wait_for(lambda: _counter(actor, actor_pb2_grpc.ActorStub, "actor/weights_received_total") >= 2, what="weights")
    procs["learner"].kill()
    wait_for(lambda: stats(actor, actor_pb2_grpc.ActorStub).get("actor/weights_stream_errors_total", 0) >= 1,
             what="the actor noticing the lost learner")
    steps = stats(actor, actor_pb2_grpc.ActorStub)["actor/env_steps_total"]
    wait_for(lambda: stats(actor, actor_pb2_grpc.ActorStub)["actor/env_steps_total"] > steps, what="stepping on")
    assert procs["actor"].terminate() == 0


def test_a_crashing_loop_ends_the_process_loudly(tmp_path):
    """A learner whose buffer serves another algorithm cannot work: it must exit 1, saying why."""
    dqn = write_config(tmp_path / "dqn.yaml", TINY_DQN)
    ppo = write_config(tmp_path / "ppo.yaml", TINY_PPO)
    buffer = Service("buffer", tmp_path, dqn)
    learner = Service("learner", tmp_path, ppo, "--buffer", buffer.wait_ready(), "--checkpoint-dir", str(tmp_path))
    try:
        assert learner.popen.wait(60) == 1
        assert "refused this learner's batch request" in learner.output()
    finally:
        learner.kill()
        assert buffer.terminate() == 0


def test_bad_config_exits_with_an_error_naming_the_key(tmp_path):
    config = write_config(tmp_path / "bad.yaml", {"ppo": {"clip_coeff": 0.1}})
    buffer = Service("buffer", tmp_path, config)
    assert buffer.popen.wait(60) == 2   # as a bad flag: nothing a restart could fix
    assert "buffer cannot start: ppo.clip_coeff: unknown key" in buffer.output()


def test_a_taken_address_is_one_line_naming_its_flag_and_exit_code_2(tmp_path):
    """Two roles on one machine with the default --metrics-listen: the second cannot bind the port.
    It says so in one line naming the address and the flag, no traceback, exit code 2 (as a bad flag);
    a --listen address in use likewise names --listen."""
    config = write_config(tmp_path / "c.yaml", TINY_PPO)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = f"127.0.0.1:{held.getsockname()[1]}"
        learner = Service("learner", tmp_path, config, "--buffer", f"127.0.0.1:{_free_port()}",
                          "--checkpoint-dir", str(tmp_path / "ck"), "--metrics-listen", taken)
        buffer = Service("buffer", tmp_path, config, listen=taken)
        try:
            assert learner.popen.wait(60) == 2, learner.output()
            assert buffer.popen.wait(60) == 2, buffer.output()
        finally:
            learner.kill()
            buffer.kill()
    for service, flag in ((learner, "--metrics-listen"), (buffer, "--listen")):
        out = service.output()
        lines = [line for line in out.splitlines() if "cannot start" in line]
        assert len(lines) == 1 and "Traceback" not in out and " failed: " not in out, out
        assert f"{flag}: {taken} cannot be served on ([Errno 98] Address already in use)" in lines[0], out
        assert f"{flag} HOST:PORT" in lines[0], out
    assert "or '' to turn the metrics endpoint off" in learner.output()


def test_buffer_runs_without_torch_or_gymnasium(tmp_path):
    """Block both imports outright, then run the buffer module as its entrypoint would."""
    config = write_config(tmp_path / "c.yaml", TINY_PPO)
    block = ("import sys, runpy; sys.modules['torch'] = None; sys.modules['gymnasium'] = None; "
             "sys.argv[0] = 'buffer'; runpy.run_module('services.buffer', run_name='__main__')")
    buffer = Service("buffer", tmp_path, config, python_args=("-c", block), module=False)
    try:
        address = buffer.wait_ready()
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kuberl.v1.Buffer"),
                                                          timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert buffer.terminate() == 0, buffer.output()
