"""`kuberl up`'s run totals (services/cli/tally.py): restarts, slow polls, losses and formatting.

The actor side is the real EpisodeLog behind the real ActorServicer.GetStats (no gRPC, no clock)."""

from __future__ import annotations

import csv
import io
import json

import pytest

from kuberl.v1 import common_pb2 as pb
from services.actor.episodes import EpisodeLog
from services.actor.servicer import ActorServicer
from services.cli.tally import Tally, fmt_losses, fmt_return, loss_counters
from services.common.stats import Metrics


class FakeActor:
    """One actor process: its counters, its episode log, and GetStats as the servicer answers it."""

    def __init__(self, start: float, kept: int = 65536):
        self.metrics = Metrics("actor", instance_id="actor-0")
        self.metrics.started = start
        self.log = EpisodeLog(self.metrics, kept=kept)
        self.servicer = ActorServicer(self.metrics, self.log)
        self.calls = 0

    def play(self, n: int, steps_each: int = 10) -> None:
        for _ in range(n):
            self.metrics.inc("actor/env_steps_total", steps_each)
            self.log.finish(float(self.log.count + 1), steps_each, int(self.metrics.counters["actor/env_steps_total"]),
                            0, now=float(self.log.count))

    def get_stats(self, after: int, page: int = 0) -> pb.GetStatsResponse:
        """ActorServicer.GetStats, run to completion (it never awaits)."""
        self.calls += 1
        coro = self.servicer.GetStats(pb.GetStatsRequest(episodes_after=after, max_episodes=page), None)
        try:
            coro.send(None)
        except StopIteration as done:
            return done.value
        raise AssertionError("GetStats awaited something")


def poll(tally: Tally, name: str, actor: FakeActor, page: int = 0) -> list:
    """What LocalRun.poll does for one actor: page until caught up, then fold the returns in."""
    out: list = []
    tally.read(name, lambda after: actor.get_stats(after, page), out)
    return tally.record(out)


def test_every_episode_is_read_however_slow_the_poll():
    tally, actor = Tally(return_window=100), FakeActor(start=1000.0)
    actor.play(10_000)  # far more than one page (4096) between two polls
    got = poll(tally, "actor-0", actor)
    assert [e.index for e in got] == list(range(1, 10_001))
    assert actor.calls == 3  # 4096 + 4096 + 1808
    actor.play(5)
    got = poll(tally, "actor-0", actor)
    assert [e.index for e in got] == list(range(10_001, 10_006))
    assert tally.episodes_read == 10_005 and tally.episodes_skipped == 0
    assert tally.total("actor/episodes_total") == 10_005
    assert list(tally.returns) == [float(i) for i in range(9_906, 10_006)]  # the last 100, in order


def test_a_reader_further_behind_than_the_retention_is_told_exactly_how_many_it_missed():
    tally, actor = Tally(return_window=10), FakeActor(start=1000.0, kept=100)
    actor.play(30)
    assert [e.index for e in poll(tally, "actor-0", actor)] == list(range(1, 31))
    actor.play(250)  # episodes 31..280; only 181..280 are still retained
    got = poll(tally, "actor-0", actor, page=40)
    assert [e.index for e in got] == list(range(181, 281))
    assert tally.episodes_skipped == 150
    assert tally.total("actor/episodes_total") == 280 == tally.episodes_read + tally.episodes_skipped
    actor.play(1)
    assert [e.index for e in poll(tally, "actor-0", actor)] == [281]
    assert tally.episodes_skipped == 150  # counted once


def test_totals_survive_a_restart_under_the_same_name():
    tally, old = Tally(return_window=1000), FakeActor(start=1000.0)
    old.play(10)
    poll(tally, "actor-0", old)
    assert tally.total("actor/env_steps_total") == 100
    new = FakeActor(start=2000.0)  # actor-0 restarted: counters from 0, episode indices from 1
    new.play(3)
    got = poll(tally, "actor-0", new)
    assert [e.index for e in got] == [1, 2, 3]
    assert tally.total("actor/env_steps_total") == 130 and tally.total("actor/episodes_total") == 13
    assert tally.episodes_read == 13 and tally.episodes_skipped == 0 and tally.restarts["actor-0"] == 1
    new.play(2)
    assert [e.index for e in poll(tally, "actor-0", new)] == [4, 5]
    assert tally.total("actor/episodes_total") == 15 and tally.restarts["actor-0"] == 1


def test_a_successor_already_past_the_old_cursor_is_read_from_its_first_episode():
    tally, old = Tally(return_window=1000), FakeActor(start=1000.0)
    old.play(5)
    poll(tally, "actor-0", old)
    old.play(2)  # 6 and 7 are counted by the old process but never read: it dies before the next poll
    out: list = []
    tally.read("actor-0", lambda after: old.get_stats(after, page=1), out, max_pages=1)  # reads 6 only
    assert [e.index for e in tally.record(out)] == [6]
    new = FakeActor(start=2000.0)
    new.play(8)  # indices 1..8: a page after the old cursor (6) would hold only 7 and 8
    got = poll(tally, "actor-0", new)
    assert [e.index for e in got] == list(range(1, 9))
    assert tally.total("actor/episodes_total") == 15 and tally.episodes_read == 14
    assert tally.episodes_skipped == 1  # episode 7 of the old process: counted, never readable


def test_restart_detected_without_a_start_time_by_uptime_or_a_counter_going_down():
    tally = Tally(return_window=10)
    tally.observe("learner-0", {"learner/samples_total": 500.0}, uptime_s=100.0)
    tally.observe("learner-0", {"learner/samples_total": 900.0}, uptime_s=102.0)
    assert tally.total("learner/samples_total") == 900 and not tally.restarts
    tally.observe("learner-0", {"learner/samples_total": 50.0}, uptime_s=3.0)  # uptime went down
    assert tally.total("learner/samples_total") == 950 and tally.restarts["learner-0"] == 1
    tally.observe("learner-0", {"learner/samples_total": 10.0}, uptime_s=None)  # counter went down
    assert tally.total("learner/samples_total") == 960 and tally.restarts["learner-0"] == 2


def test_same_process_is_never_banked_twice():
    tally = Tally(return_window=10)
    for i in range(1, 6):  # a wall-clock step would change uptime; the start time stays the same
        tally.observe("buffer-0", {"buffer/samples_received_total": 100.0 * i}, start=1000.0,
                      uptime_s=50.0 - i * 10)
    assert tally.total("buffer/samples_received_total") == 500 and not tally.restarts


def test_processes_add_up_and_a_retired_one_keeps_counting():
    tally = Tally(return_window=10)
    tally.observe("actor-0", {"actor/env_steps_total": 100.0}, start=1.0)
    tally.observe("actor-1", {"actor/env_steps_total": 40.0}, start=2.0)
    assert tally.total("actor/env_steps_total") == 140
    tally.observe("actor-0", {"actor/env_steps_total": 150.0}, start=1.0)  # actor-1 is no longer polled
    assert tally.total("actor/env_steps_total") == 190
    tally.observe("actor-1", {"actor/env_steps_total": 5.0}, start=3.0)    # started again later
    assert tally.total("actor/env_steps_total") == 195


def test_losses_by_reason_in_samples_and_banked_across_restarts():
    actor = {"actor/fragments_dropped_total": 3.0, "actor/fragments_rejected_total": 1.0,
             "actor/fragments_pushed_total": 10.0, "actor/samples_pushed_total": 1280.0}
    buffer = {"buffer/samples_evicted_total": 12_000.0, "buffer/samples_dropped_stale_total": 200.0,
              "buffer/batches_unsent_total": 1.0}   # (taken back: nothing lost)
    learner = {"learner/samples_dropped_stale_total": 45.0}
    tally = Tally(return_window=10)
    for name, m in (("actor-0", actor), ("buffer-0", buffer), ("learner-0", learner)):
        tally.observe(name, m, start=1.0)
    assert tally.losses() == {"dropped": 384, "rejected": 128, "evicted": 12_000, "stale": 245}
    assert fmt_losses(tally.losses()) == "12,757 (dropped 384, rejected 128, evicted 12,000, stale 245)"
    tally.observe("buffer-0", {"buffer/samples_evicted_total": 10.0}, start=2.0)  # the buffer restarted
    assert tally.losses()["evicted"] == 12_010 and tally.losses()["stale"] == 245


def test_actor_losses_before_any_push_use_env_steps_per_fragment_and_exact_samples_win():
    assert loss_counters({"actor/fragments_dropped_total": 2.0, "actor/fragments_total": 4.0,
                          "actor/env_steps_total": 512.0})["lost/dropped_samples_total"] == 256
    assert loss_counters({"actor/fragments_dropped_total": 2.0, "actor/samples_dropped_total": 7.0,
                          "actor/fragments_total": 4.0, "actor/env_steps_total": 512.0}
                         )["lost/dropped_samples_total"] == 7


def test_lost_shows_zero_only_when_every_reason_is_zero():
    assert fmt_losses(dict.fromkeys(("dropped", "rejected", "evicted", "stale"), 0.0)) == "0"
    only_stale = {"dropped": 0.0, "rejected": 0.0, "evicted": 0.0, "stale": 1.0}
    assert fmt_losses(only_stale) == "1 (stale 1)"


@pytest.mark.parametrize("value, text", [(0.8512, "0.8512"), (0.85126, "0.8513"), (21.5, "21.5"), (500.0, "500"),
                                         (-0.0123456, "-0.01235"), (1234.56, "1235"), (9999.7, "10,000"),
                                         (123456.0, "123,456"), (None, "-")])
def test_returns_print_with_four_significant_digits(value, text):
    assert fmt_return(value) == text


# --- LocalRun.poll/row on top of the tally (no processes: the fleet's members answer from FakeActor) -------

class FakeStub:
    def __init__(self, actor: FakeActor | None = None, metrics: dict | None = None, start: float = 1.0):
        self.actor, self.metrics, self.start = actor, metrics or {}, start

    def GetStats(self, request, timeout=None):
        if self.actor is not None:
            return self.actor.get_stats(request.episodes_after, request.max_episodes)
        return pb.GetStatsResponse(metrics=self.metrics, process_start_unix_s=self.start)


class FakeBoard:
    def add_scalar(self, *args) -> None:
        pass


def local_run(members, run_dir, cfg=None):
    """A LocalRun over a Fleet whose members answer from fakes: no processes are started."""
    from services.cli.fleet import Fleet
    from services.cli.up import LocalRun
    from services.config import config_from_dict

    cfg = cfg or config_from_dict({"planner": {"enabled": False}})
    fleet = Fleet(cfg, run_dir)
    fleet.members.extend(members)
    run = LocalRun(cfg, fleet, progress=False)
    run.tb = FakeBoard()
    run.started = 0.0
    run.episodes_out = io.StringIO()  # what would be episodes.csv
    run.episode_rows = csv.writer(run.episodes_out)
    return run


def test_progress_line_counts_every_episode_and_loss_across_a_restart(tmp_path):
    from services.cli.progress import CSV_COLUMNS, progress_line
    from services.cli.fleet import Member
    actor = FakeActor(start=1000.0)
    buffer = FakeStub(metrics={"buffer/samples_evicted_total": 12_000.0, "buffer/size_samples": 64.0})
    members = [Member("actor", "actor-0", stub=FakeStub(actor)), Member("buffer", "buffer-0", stub=buffer)]
    run = local_run(members, tmp_path)
    for _ in range(9000):
        actor.log.finish(0.8512, 10, 0, 0, now=1.0)
    actor.metrics.inc("actor/env_steps_total", 90_000)
    run.poll()
    row = run.row()
    assert set(row) == set(CSV_COLUMNS)
    assert row["episodes"] == 9000 and row["env_steps"] == 90_000 and len(run.returns) == 100
    assert row["samples_lost_total"] == 12_000 and row["samples_lost_evicted"] == 12_000
    line = progress_line(row, len(run.returns))
    assert "episodes  9,000 |" in line and "return 0.8512 (last 100)" in line
    assert line.rstrip().endswith("lost 12,000 (evicted 12,000)")

    restarted = FakeActor(start=2000.0)  # actor-0 restarted: counters and indices start again
    restarted.log.finish(1.0, 10, 0, 0, now=2.0)
    restarted.metrics.inc("actor/env_steps_total", 10)
    members[0].stub = FakeStub(restarted)
    run.poll()
    row = run.row()
    assert row["episodes"] == 9001 and row["env_steps"] == 90_010
    assert run.returns[-1] == 1.0 and row["episodes_skipped"] == 0
    # every episode read is one row of episodes.csv: wall_s, env_steps, return, length, policy_version
    rows = list(csv.reader(io.StringIO(run.episodes_out.getvalue())))
    assert len(rows) == run.tally.episodes_read == 9001
    assert rows[-1][1:] == ["90010", "1.0", "10", "0"] and rows[0][2:4] == ["0.8512", "10"]


def test_held_share_is_the_actors_held_seconds_over_their_time_between_rows():
    from services.cli.progress import HeldShare
    held = HeldShare()
    assert held.update(10.0, 0.0, actors=2) is None            # the first row has no interval
    assert held.update(20.0, 5.0, actors=2) == 0.25            # 5 of 2 x 10 actor-seconds
    assert held.update(30.0, 45.0, actors=2) == 1.0            # capped (counters read at different times)
    assert held.update(40.0, 45.0, actors=0) is None           # no actors: no share


def test_progress_line_says_lost_0_only_when_nothing_was_lost(tmp_path):
    from services.cli.progress import progress_line
    from services.cli.fleet import Member
    run = local_run([Member("buffer", "buffer-0", stub=FakeStub(metrics={"buffer/samples_evicted_total": 0.0}))],
                    tmp_path)
    run.poll()
    assert progress_line(run.row(), len(run.returns)).endswith("| lost 0")


def test_process_restarts_are_the_restarts_and_group_re_forms_events_jsonl_records(tmp_path, capsys):
    from services.cli.fleet import Member
    run = local_run([Member("buffer", "buffer-0", stub=FakeStub(metrics={"buffer/size_samples": 0.0}))], tmp_path)
    fleet = run.fleet
    records = [{"name": "buffer-0", "event": "exited", "code": -9, "restart_in_s": 1.0},
               {"name": "buffer-0", "event": "restarted", "restarts": 1},
               {"name": "learner-1", "event": "exited", "code": -9, "group": "learners", "group_size": 2,
                "reform_in_s": 1.0},
               {"name": "learners", "event": "re-formed", "size": 2, "restarts": 1, "rendezvous": "127.0.0.1:9"}]
    partial = json.dumps({"name": "actor-0", "event": "restarted", "restarts": 1})[:20]  # still being written
    fleet.sup.events_path.write_text("".join(json.dumps(r) + "\n" for r in records) + partial)
    fleet.print_events()
    run.poll()
    assert fleet.restarts == {"buffer-0": 1, "learners": 1} and run.row()["process_restarts"] == 2
    assert capsys.readouterr().out.splitlines() == [
        "buffer-0 exited with code -9 (SIGKILL); restarting it in 1 s", "buffer-0 restarted (restart 1)",
        "learner-1 exited with code -9 (SIGKILL); re-forming the group of 2 learners in 1 s",
        "the group of 2 learners re-formed (re-form 1, rendezvous 127.0.0.1:9)"]


def test_a_run_of_several_policies_ends_when_every_policy_with_a_target_reached_it(tmp_path):
    """policies.<name>.target_return: each policy's agents' own mean return against its own target (the
    run's mean mixes teams whose rewards differ in scale); a policy without one is not waited for, and
    run.target_return is then not watched. The progress line shows each against its target; summary
    fields per policy."""
    from services.cli.fleet import Member
    from services.cli.progress import progress_line
    from services.config import config_from_dict

    cfg = config_from_dict({"env": {"id": "pettingzoo:kuberl_envs.relay"}, "planner": {"enabled": False},
                            "run": {"return_window": 4, "target_return": -1000.0},
                            "policies": {"hunters": {"agents": ["a"], "target_return": 5.0},
                                         "prey": {"agents": ["b"], "target_return": 1.0},
                                         "crowd": {"agents": ["*"]}}})
    actor = FakeActor(start=1.0)
    run = local_run([Member("actor", "actor-0", stub=FakeStub(actor))], tmp_path, cfg)

    def play(policy: str, episode_return: float, n: int = 4) -> None:
        for _ in range(n):
            actor.log.finish(episode_return, 10, 0, 0, now=float(actor.log.count), policy=policy)

    play("crowd", -50.0)
    play("hunters", 6.0)
    run.poll()
    assert run.mean_return >= cfg.run.target_return       # (run.target_return is not watched)
    assert run.stop_reason() is None                      # prey has not played yet
    play("prey", 0.5)
    run.poll()
    assert run.stop_reason() is None                      # prey's 0.5 < 1.0
    line = progress_line(run.row(), len(run.returns), {n: p.target_return for n, p in cfg.policies.items()})
    assert "hunters 6/5 v-" in line and "prey 0.5/1 v-" in line and "crowd -50 v-" in line
    play("prey", 2.0)
    run.poll()
    assert run.stop_reason() == "target_return"           # crowd has no target: not waited for
    summary = run.policies_summary()
    assert summary["prey"] == {"policy_version": None, "mean_return": 2.0, "return_window": 4, "target_return": 1.0}
    assert summary["crowd"]["target_return"] is None
