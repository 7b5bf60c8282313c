"""`kuberl up` with the planner off and a group of two learners: one SIGKILLed while the group trains
breaks the group, and `kuberl up` records it, stops the other, forms the group again (a fresh
rendezvous, rank 0 back on its address, resuming from rank 0's checkpoint) and the run goes on to its
step budget. Nothing is judged by time, but the budget must outlast the re-form: the actor is capped at
ACTOR_STEPS_PER_S, so the budget is 40 s of stepping (on 2 cores the kill came 9 s after the launch and
the re-formed group trained 5 s after the kill; the whole test took about 50 s)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

from bench.chaos import ready, stats, wait_for
from kuberl.v1.learner_pb2_grpc import LearnerStub
from tests.helpers import ROOT, TINY_PPO, run_logs, write_config

ACTOR_STEPS_PER_S = 50
BUDGET = 40 * ACTOR_STEPS_PER_S  # env steps


def version(address: str) -> float:
    return stats(address, LearnerStub).get("learner/policy_version", 0)


def checkpointed(run) -> int:
    """The newest checkpoint's version (-1: none yet)."""
    return max((int(p.stem.split("-")[1]) for p in (run / "checkpoints").glob("ckpt-*.pt")), default=-1)


def test_a_killed_learner_breaks_the_group_which_is_formed_again_and_trains_on_to_the_budget(tmp_path):
    config = write_config(tmp_path / "c.yaml", {
        **TINY_PPO, "topology": {"actors": 1, "learners": 2}, "planner": {"enabled": False},
        "actor": {**TINY_PPO["actor"], "max_env_steps_per_s": ACTOR_STEPS_PER_S},
        "learner": {"checkpoint_interval_s": 1},
        "run": {"target_return": None, "max_env_steps": BUDGET, "poll_interval_s": 0.2}})
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.main", "up", str(config), "--run-dir", str(tmp_path),
                             "--name", "run", "--quiet"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        old = {n: wait_for(f"{n} serving", lambda n=n: ready(run, n), proc) for n in ("learner-0", "learner-1")}
        rank0 = old["learner-0"]["address"]
        wait_for("the group trained and checkpointed", lambda: version(rank0) >= 3 and checkpointed(run) >= 1, proc)
        os.kill(old["learner-1"]["pid"], signal.SIGKILL)
        # A round cannot complete without learner-1: learner-0's version now is the group's last.
        at_kill = max(version(rank0), checkpointed(run))
        new = {n: wait_for(f"{n} serving again", lambda n=n: (i := ready(run, n)) and i["pid"] != old[n]["pid"] and i,
                           proc) for n in old}
        assert new["learner-0"]["address"] == rank0  # where the actor takes weights from
        wait_for(f"the re-formed group training past version {at_kill}", lambda: version(rank0) > at_kill, proc)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out[-5000:] + run_logs(run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["reason"] == "max_env_steps" and summary["env_steps"] >= BUDGET, summary
    assert "learner-1 exited with code -9 (SIGKILL); re-forming the group of 2 learners in 1 s" in out
    assert "the group of 2 learners re-formed (re-form 1, rendezvous 127.0.0.1:" in out
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    exited = events[0]
    assert (exited["name"], exited["event"], exited["code"]) == ("learner-1", "exited", -signal.SIGKILL)
    assert exited["group"] == "learners" and exited["group_size"] == 2 and exited["reform_in_s"] == 1.0
    re_formed = [e for e in events if e["event"] == "re-formed"]
    assert re_formed and all(e["name"] == "learners" for e in re_formed)
    assert summary["process_restarts"] == {"learners": len(re_formed)}
    # Every formation met at a rendezvous of its own, and the new rank 0 resumed from a checkpoint.
    log0 = (run / "logs" / "learner-0.log").read_text()
    rendezvous = re.findall(r"joining a group of 2 learners as rank 0 \(rendezvous (\S+)\)", log0)
    assert len(rendezvous) == 1 + len(re_formed) == len(set(rendezvous)), rendezvous
    assert rendezvous[1:] == [e["rendezvous"] for e in re_formed]
    restored = re.findall(r"restored \S+ at version (\d+)", log0)
    assert restored and int(restored[-1]) >= 1, log0[-3000:]
    assert summary["exit_codes"] == {name: 0 for name in ("buffer-0", "learner-0", "learner-1", "actor-0")}
