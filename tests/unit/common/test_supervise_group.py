"""services/common/local/supervise.py's learner groups with trivial processes in place of learners: a member's
death stops the others and forms the group again after the backoff, with a fresh rendezvous and rank 0 on
its address; a member that ignores SIGTERM is killed first; a group that keeps breaking is given up on.
Times are passed explicitly (`check(now)`), never slept on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from services.common.local import supervise
from services.common.local.procs import ServiceProcess
from services.common.local.supervise import (LEARNERS, MAX_FAILURES, RESTART_BACKOFF_S, STOP_TIMEOUT_S, Supervisor,
                                       format_event, learner_specs)

# Writes its ready file (after ignoring SIGTERM, if asked), then sleeps: a learner that never trains.
SLEEPER = """import json, signal, sys, time
if sys.argv[2] == "ignore-sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1], "w").write(json.dumps({"address": "127.0.0.1:1"}))
time.sleep(120)
"""
RANK0 = "127.0.0.1:5000"


class FakeSpawn:
    """Stands in for procs.spawn: records each start's flags and runs SLEEPER instead of the service."""

    def __init__(self):
        self.calls: list[tuple[str, str, list[str]]] = []
        self.popens: list[subprocess.Popen] = []
        self.sigterm = "obey"

    def __call__(self, role, name, run_dir, config, listen, extra) -> ServiceProcess:
        self.calls.append((name, listen, list(extra)))
        ready, log = run_dir / f"{name}-{len(self.calls)}.json", run_dir / f"{name}.log"
        popen = subprocess.Popen([sys.executable, "-c", SLEEPER, str(ready), self.sigterm])
        self.popens.append(popen)
        return ServiceProcess(role, name, popen, log, ready)

    def rendezvous(self, name: str) -> str:
        """The --group flag of `name`'s latest start."""
        extra = next(extra for n, _, extra in reversed(self.calls) if n == name)
        return extra[extra.index("--group") + 1]


@pytest.fixture
def fake(monkeypatch):
    fake = FakeSpawn()
    monkeypatch.setattr(supervise, "spawn", fake)
    yield fake
    for p in fake.popens:
        if p.poll() is None:
            p.kill()
        p.wait()


def group_of_two(tmp_path) -> tuple[Supervisor, list[str]]:
    restarted: list[str] = []
    ports = iter(range(20001, 20100))
    sup = Supervisor(tmp_path, tmp_path / "c.yaml", on_restart=restarted.append, log_events=False)
    sup.start_group(LEARNERS, 2, learner_specs(tmp_path, 2, buffer="127.0.0.1:1", listen=RANK0),
                    port=lambda: next(ports))
    for p in sup.procs.values():  # serving: SIGTERM is handled as asked from here on
        wait_ready(p)
    return sup, restarted


def wait_ready(p: ServiceProcess) -> None:
    deadline = time.monotonic() + 60
    while not p.poll_ready():
        assert p.alive and time.monotonic() < deadline, f"{p.name} never wrote its ready file"
        time.sleep(0.01)


def events(sup: Supervisor) -> list[dict]:
    return [json.loads(line) for line in sup.events_path.read_text().splitlines()]


def test_a_dead_member_stops_the_others_and_the_group_is_formed_again_after_its_backoff(tmp_path, fake):
    sup, restarted = group_of_two(tmp_path)
    first = dict(sup.procs)
    assert [(n, listen) for n, listen, _ in fake.calls] == [("learner-0", RANK0), ("learner-1", "127.0.0.1:0")]
    old_rendezvous = fake.rendezvous("learner-0")
    assert fake.rendezvous("learner-1") == old_rendezvous
    t0 = time.monotonic()
    first["learner-1"].popen.kill()
    first["learner-1"].popen.wait()
    assert [p.name for p in sup.check(t0 + 0.5)] == ["learner-1"]
    assert first["learner-0"].popen.wait(30) == -signal.SIGTERM  # the survivor is stopped
    assert not sup.procs  # nothing of the group runs while it waits
    sup.check(t0 + 0.5 + RESTART_BACKOFF_S[0] / 2)
    assert len(fake.calls) == 2 and not restarted  # still backing off
    sup.check(t0 + 0.5 + RESTART_BACKOFF_S[0])
    assert len(fake.calls) == 4 and restarted == [LEARNERS] and sup.restarts == {LEARNERS: 1}
    assert [(n, listen) for n, listen, _ in fake.calls[2:]] == [("learner-0", RANK0), ("learner-1", "127.0.0.1:0")]
    new_rendezvous = fake.rendezvous("learner-0")
    assert new_rendezvous != old_rendezvous and fake.rendezvous("learner-1") == new_rendezvous
    assert all(sup.procs[n].popen.pid != first[n].popen.pid for n in first)
    assert sup.exit_codes == {"learner-1": -signal.SIGKILL, "learner-0": -signal.SIGTERM}
    shown = [format_event(e) for e in events(sup)]
    assert shown == ["learner-1 exited with code -9 (SIGKILL); re-forming the group of 2 learners in 1 s",
                     f"the group of 2 learners re-formed (re-form 1, rendezvous {new_rendezvous})"]
    assert sup.check(t0 + 2.0) == []  # running again
    codes = sup.stop(["learner-1"], 30.0)  # one member takes its group along
    assert codes == {"learner-0": -signal.SIGTERM, "learner-1": -signal.SIGTERM} and not sup.groups


def test_a_member_ignoring_sigterm_is_killed_before_the_group_forms_again(tmp_path, fake):
    fake.sigterm = "ignore-sigterm"
    sup, restarted = group_of_two(tmp_path)
    survivor = sup.procs["learner-1"]
    t0 = time.monotonic()
    sup.procs["learner-0"].popen.kill()
    sup.procs["learner-0"].popen.wait()
    sup.check(t0)
    sup.check(t0 + RESTART_BACKOFF_S[-1])  # the backoff is over, but learner-1 still runs
    assert survivor.alive and len(fake.calls) == 2 and not restarted
    sup.check(t0 + STOP_TIMEOUT_S)
    assert survivor.popen.wait(30) == -signal.SIGKILL
    sup.check(t0 + STOP_TIMEOUT_S + 0.1)
    assert restarted == [LEARNERS] and sorted(sup.procs) == ["learner-0", "learner-1"]
    # Stopping a broken group takes the members still exiting too.
    survivor = sup.procs["learner-1"]
    wait_ready(survivor)
    sup.procs["learner-0"].popen.kill()
    sup.procs["learner-0"].popen.wait()
    sup.check(t0 + STOP_TIMEOUT_S + 1)
    assert sup.release(["learner-0"]) == [survivor] and not sup.groups and survivor.alive


def test_a_group_that_keeps_breaking_is_given_up_on(tmp_path, fake):
    sup, restarted = group_of_two(tmp_path)
    now = time.monotonic()
    for attempt in range(1, MAX_FAILURES + 1):
        members = dict(sup.procs)
        members["learner-1"].popen.kill()
        members["learner-1"].popen.wait()
        now += 1.0  # it ran for less than STABLE_S: a failure in a row
        assert [p.name for p in sup.check(now)] == ["learner-1"]
        members["learner-0"].popen.wait(30)
        now += RESTART_BACKOFF_S[-1]
        sup.check(now)
        if attempt < MAX_FAILURES:
            assert sorted(sup.procs) == ["learner-0", "learner-1"] and restarted == [LEARNERS] * attempt
    assert not sup.procs and not sup.groups and sup.restarts[LEARNERS] == MAX_FAILURES - 1
    assert "learner-1" in sup.given_up and f"broke {MAX_FAILURES} times in a row" in sup.given_up["learner-1"]
    assert format_event(events(sup)[-1]) == (f"learner-1 exited with code -9 (SIGKILL); not re-forming the group "
                                             f"of 2 learners after it broke {MAX_FAILURES} times in a row")
    sup.check(now + 3600)
    assert len(fake.calls) == 2 * MAX_FAILURES  # never formed again
