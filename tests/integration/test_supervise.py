"""services/common/local/supervise.py with real service processes: a SIGKILLed process is started again
on the same address after its backoff, and one that cannot start is reported with its log and given up
on. Times are passed explicitly (`check(now)`), never slept on. Learner groups:
tests/unit/common/test_supervise_group.py and tests/integration/test_learner_group_restart.py."""

from __future__ import annotations

import json
import os
import signal
import time

import grpc

from kuberl.v1 import buffer_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.common.local.procs import free_port
from services.common.local.supervise import MAX_FAILURES, RESTART_BACKOFF_S, Spec, Supervisor, format_event
from tests.helpers import TINY_PPO, write_config

WAIT_S = 120.0


def wait_ready(sup: Supervisor, name: str) -> str:
    deadline = time.monotonic() + WAIT_S
    while not sup.procs[name].poll_ready():
        assert sup.procs[name].alive, sup.procs[name].log_tail()
        assert time.monotonic() < deadline, f"{name} not serving after {WAIT_S} s"
        time.sleep(0.05)
    return sup.procs[name].address


def wait_dead(sup: Supervisor, name: str) -> None:
    sup.procs[name].popen.wait(WAIT_S)


def events(sup: Supervisor) -> list[dict]:
    return [json.loads(line) for line in sup.events_path.read_text().splitlines()]


def test_a_killed_process_comes_back_on_the_same_address_after_its_backoff(tmp_path):
    sup = Supervisor(tmp_path, write_config(tmp_path / "exp.yaml", TINY_PPO))
    address = f"127.0.0.1:{free_port()}"
    sup.start(Spec("buffer", "buffer-0", address))
    try:
        assert wait_ready(sup, "buffer-0") == address
        first = sup.procs["buffer-0"]
        os.kill(first.popen.pid, signal.SIGKILL)
        wait_dead(sup, "buffer-0")
        now = time.monotonic()
        died = sup.check(now)
        assert [p.name for p in died] == ["buffer-0"] and sup.exit_codes["buffer-0"] == -signal.SIGKILL
        assert sup.check(now + RESTART_BACKOFF_S[0] / 2) == [] and sup.procs["buffer-0"] is first  # backing off
        sup.check(now + RESTART_BACKOFF_S[0] + 0.01)
        assert sup.procs["buffer-0"] is not first and sup.restarts["buffer-0"] == 1
        assert wait_ready(sup, "buffer-0") == address
        with grpc.insecure_channel(address) as ch:
            assert buffer_pb2_grpc.BufferStub(ch).GetStats(pb.GetStatsRequest(), timeout=10).role == "buffer"
        kinds = [(e["name"], e["event"]) for e in events(sup)]
        assert kinds == [("buffer-0", "exited"), ("buffer-0", "restarted")]
        assert format_event(events(sup)[0]) == "buffer-0 exited with code -9 (SIGKILL); restarting it in 1 s"
    finally:
        sup.stop(["buffer-0"], 30.0)
    assert sup.exit_codes["buffer-0"] == 0 and "buffer-0" not in sup.procs  # a stop is never restarted


def test_a_process_that_cannot_start_is_reported_with_its_log_and_given_up_on(tmp_path):
    sup = Supervisor(tmp_path, write_config(tmp_path / "exp.yaml", TINY_PPO))
    address = f"127.0.0.1:{free_port()}"
    sup.start(Spec("buffer", "buffer-0", address))
    try:
        wait_ready(sup, "buffer-0")
        sup.start(Spec("buffer", "buffer-1", address))             # the port is taken: it cannot bind
        wait_dead(sup, "buffer-1")
        now = time.monotonic()
        assert [p.name for p in sup.check(now)] == ["buffer-1"]
        exited = events(sup)[0]
        assert exited["code"] not in (0, None) and "restart_in_s" in exited
        shown = format_event(exited)
        assert shown.startswith("buffer-1 exited with code") and "\n    " in shown  # with its last log lines
        sup.check(now + 60.0)
        assert sup.restarts.get("buffer-1") == 1
        # It fails the same way every time: after MAX_FAILURES starts in a row it is given up on.
        for attempt in range(2, MAX_FAILURES + 1):
            wait_dead(sup, "buffer-1")
            now = time.monotonic()  # it ran for less than STABLE_S: a failure in a row
            assert [p.name for p in sup.check(now)] == ["buffer-1"]
            if attempt < MAX_FAILURES:
                sup.check(now + RESTART_BACKOFF_S[-1])  # restarted after its backoff
        assert "buffer-1" not in sup.specs and sup.restarts["buffer-1"] == MAX_FAILURES - 1
        assert f"failed {MAX_FAILURES} times in a row" in sup.given_up["buffer-1"]
        shown = format_event(events(sup)[-1])
        # (A taken --listen is a refused setting: exit code 2, one line naming the flag, shown with the log.)
        assert shown.startswith(f"buffer-1 exited with code 2; not restarting it after {MAX_FAILURES} failed "
                                f"starts in a row") and f"--listen: {address} cannot be served on" in shown
    finally:
        sup.stop(list(sup.specs), 30.0)
        for p in sup.procs.values():
            if p.alive:
                p.popen.kill()
