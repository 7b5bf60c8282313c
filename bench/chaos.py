"""Chaos: a `kuberl up` PPO CartPole run whose actor, learner, buffer and planner are each killed with
SIGKILL, beside the same run left alone, in one invocation.

    .venv/bin/python -m bench.chaos [--seeds 3] [--target 300] [--budget 500000] [--json docs/chaos.json]

The kills come in order, each once its victim's successor serves: the actor (the planner's local
backend restarts it under the same actor id, with a new incarnation), the learner (restarted, it
resumes from its newest checkpoint) and the buffer (`kuberl up` restarts it on the same address; the
actors re-send what it had not acknowledged). The buffer is frozen (SIGSTOP) before it is killed, so
the actors' acknowledged counts at that moment can be read exactly: nothing acknowledges while it is
frozen. Last the planner: `kuberl up` restarts it; its actor and learner get SIGTERM as it dies,
drain, and the new planner starts new ones.

Accounting: at the end (a clean stop: actors drain first), the actor processes that stopped cleanly
(the one alive when the buffer was killed and the one the new planner started; the one killed first
logs nothing) say what they had acknowledged in all; the new buffer must have stored exactly the part
acknowledged after the buffer's kill, less what it counted as too old to dedupe.

Reports per run: reached or not, wall seconds and env steps to the target, kills per role, stored
vs acknowledged; and the median over seeds of time and steps with kills / without.
tests/learning/test_chaos.py runs one chaos run and asserts on it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml

from kuberl.v1 import actor_pb2_grpc, learner_pb2_grpc
from kuberl.v1 import common_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 300.0   # bounds on each wait, for a busy machine; nothing here judges speed
NO_EPISODES = 1 << 62
STOPPED = re.compile(r"actor \S+ stopped: (\d+) fragments cut, (\d+) acknowledged, (\d+) dropped, (\d+) rejected")


class RunEnded(AssertionError):
    pass


def chaos_config(target: float, budget: int, seed: int = 0) -> dict:
    """configs/cartpole_ppo.yaml, one actor (the restarts are under test, not scaling), checkpoints
    every 5 s (a killed learner loses at most that much). The actor is capped at 1,500 env steps/s (a
    user's cap, actor.max_env_steps_per_s): the kills follow each other in wall time, and on an idle
    machine an uncapped run reached the target 14 s in, before the last kill (clean-clone make test,
    2026-11-26: 89,784 env steps); capped, reaching it takes a minute or more."""
    cfg = yaml.safe_load((ROOT / "configs" / "cartpole_ppo.yaml").read_text())
    cfg["seed"] = seed
    cfg["run"] = {"target_return": target, "return_window": 100, "max_env_steps": budget, "poll_interval_s": 0.5}
    cfg["learner"] = {**cfg["learner"], "checkpoint_interval_s": 5}
    cfg["planner"] = {"actor": {"min": 1, "max": 1}}
    cfg["actor"] = {**cfg.get("actor", {}), "max_env_steps_per_s": 1500}
    return cfg


def ready(run: Path, name: str) -> dict | None:
    try:
        return json.loads((run / "ready" / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def wait_for(what: str, cond, up: subprocess.Popen, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise RunEnded(f"kuberl up exited ({up.returncode}) while waiting for {what}")
        if value := cond():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def stats(address: str, stub=actor_pb2_grpc.ActorStub) -> dict[str, float]:
    """A service's metrics, or {} if it does not answer (yet)."""
    try:
        with grpc.insecure_channel(address) as ch:
            return dict(stub(ch).GetStats(pb.GetStatsRequest(episodes_after=NO_EPISODES), timeout=5.0).metrics)
    except grpc.RpcError:
        return {}


def settled_acks(address: str) -> float | None:
    """The actor's acknowledged count once two reads a second apart agree (acks already on the wire
    when the buffer froze are counted first)."""
    first = stats(address).get("actor/fragments_acked_total")
    time.sleep(1.0)
    second = stats(address).get("actor/fragments_acked_total")
    return second if first is not None and first == second else None


def kill_and_wait_back(run: Path, name: str, up: subprocess.Popen) -> dict:
    old = ready(run, name)
    os.kill(old["pid"], signal.SIGKILL)
    return wait_for(f"{name} back after SIGKILL", lambda: (i := ready(run, name)) and i["pid"] != old["pid"] and i, up)


def inflict(run: Path, up: subprocess.Popen) -> dict:
    """Kill actor, learner, buffer and planner in turn; returns the kills and the actors'
    acknowledged count when the buffer died."""
    kills: dict[str, int] = {}
    actor = wait_for("actor-0 serving", lambda: ready(run, "actor-0"), up)
    wait_for("5k env steps", lambda: stats(actor["address"]).get("actor/env_steps_total", 0) >= 5_000, up)
    actor = kill_and_wait_back(run, "actor-0", up)
    kills["actor"] = 1

    learner = wait_for("learner-0 serving", lambda: ready(run, "learner-0"), up)
    lstats = learner_pb2_grpc.LearnerStub
    version = stats(learner["address"], lstats).get("learner/policy_version", 0)
    wait_for("five more updates", lambda: stats(learner["address"], lstats).get("learner/policy_version", 0)
             >= version + 5, up)
    kill_and_wait_back(run, "learner-0", up)
    kills["learner"] = 1

    wait_for("the new actor to have fragments acknowledged",
             lambda: stats(actor["address"]).get("actor/fragments_acked_total", 0) > 0, up)
    buffer = ready(run, "buffer-0")
    os.kill(buffer["pid"], signal.SIGSTOP)  # nothing acknowledges while it is frozen
    acked_before = wait_for("the actor's acknowledged count to settle", lambda: settled_acks(actor["address"]), up)
    os.kill(buffer["pid"], signal.SIGKILL)
    new_buffer = wait_for("buffer-0 back", lambda: (i := ready(run, "buffer-0")) and i["pid"] != buffer["pid"] and i,
                          up)
    if new_buffer["address"] != buffer["address"]:
        raise AssertionError(f"buffer-0 came back on {new_buffer['address']}, not {buffer['address']}")
    kills["buffer"] = 1

    wait_for("an actor push acknowledged by the new buffer",
             lambda: stats(actor["address"]).get("actor/fragments_acked_total", 0) > acked_before, up)
    kill_and_wait_back(run, "planner-0", up)
    wait_for("a new actor-0 from the new planner", lambda: (i := ready(run, "actor-0")) and i["pid"] != actor["pid"],
             up)
    kills["planner"] = 1
    return {"kills": kills, "acked_before_buffer_kill": acked_before}


def run_once(workdir: Path, cfg: dict, chaos: bool) -> dict:
    """One `kuberl up` run in `workdir` (with the kills if `chaos`); returns what it measured."""
    path = workdir / "chaos.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = workdir / "run"
    with open(workdir / "up.out", "w") as out:
        up = subprocess.Popen([sys.executable, "-m", "services.cli.main", "up", str(path), "--run-dir", str(workdir),
                               "--name", "run", "--quiet"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        result: dict = {"chaos": chaos, "kills": {}}
        try:
            if chaos:
                result.update(inflict(run, up))
            up.wait(timeout=900)
        finally:
            if up.poll() is None:
                up.send_signal(signal.SIGINT)
                try:
                    up.wait(timeout=150)
                except subprocess.TimeoutExpired:
                    up.kill()
                    up.wait()
    summary = json.loads((run / "summary.json").read_text())
    result.update(returncode=up.returncode, console=(workdir / "up.out").read_text(), summary=summary,
                  reached=summary["reason"] == "target_return", seconds=summary["wall_s"],
                  env_steps=summary["env_steps"], mean_return=summary["mean_return"])
    if chaos:
        lines = STOPPED.findall((run / "logs" / "actor-0.log").read_text())
        final = summary["last_stats"]["buffer-0"]
        result.update(actor_stop_lines=len(lines),
                      acked_after_buffer_kill=sum(int(line[1]) for line in lines) - result["acked_before_buffer_kill"],
                      stored=final["buffer/fragments_received_total"], too_old=final["buffer/fragments_too_old_total"])
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--target", type=float, default=300.0)
    p.add_argument("--budget", type=int, default=500_000)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    rows = []
    for seed in range(args.seeds):
        for chaos in (False, True):
            with tempfile.TemporaryDirectory(prefix="kuberl-chaos-") as tmp:
                r = run_once(Path(tmp), chaos_config(args.target, args.budget, seed), chaos)
            r.pop("console"), r.pop("summary")
            r["seed"] = seed
            rows.append(r)
            print(json.dumps(r), flush=True)
    ratios = {}
    for key in ("seconds", "env_steps"):
        pairs = [(a[key], b[key]) for a, b in zip(rows[0::2], rows[1::2]) if a["reached"] and b["reached"]]
        ratios[key] = statistics.median(b / a for a, b in pairs) if pairs else None
    print(f"with kills / without (median over {args.seeds} seeds): time {ratios['seconds']}, "
          f"env steps {ratios['env_steps']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "ratio_with_kills": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
