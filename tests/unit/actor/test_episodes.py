"""The actor's episode feed (services/actor/episodes.py): a bounded ring read page by page."""

from __future__ import annotations

from services.actor.episodes import DEFAULT_PAGE, MAX_PAGE, EpisodeLog
from services.common.stats import Metrics


def log_of(n: int, kept: int = 65536) -> EpisodeLog:
    log = EpisodeLog(Metrics("actor"), kept=kept)
    for i in range(1, n + 1):
        log.finish(i * 0.5, i, 10 * i, i // 3, now=1000.0 + i)
    return log


def test_an_empty_log_has_nothing_to_page():
    page = log_of(0).page(0)
    assert (page.episodes, page.remaining, page.skipped, page.oldest) == ([], 0, 0, 0)


def test_episodes_round_trip_with_their_fields():
    log = log_of(3)
    page = log.page(0)
    assert [(e.index, e.episode_return, e.length, e.actor_env_steps, e.policy_version, e.end_unix_s)
            for e in page.episodes] == [(1, 0.5, 1, 10, 0, 1001.0), (2, 1.0, 2, 20, 0, 1002.0),
                                        (3, 1.5, 3, 30, 1, 1003.0)]
    assert (page.remaining, page.skipped, page.oldest) == (0, 0, 1)
    assert log.count == 3 and log.metrics.counters["actor/episodes_total"] == 3


def test_pages_follow_the_cursor_and_say_what_remains():
    log = log_of(10)
    page = log.page(0, limit=4)
    assert [e.index for e in page.episodes] == [1, 2, 3, 4] and page.remaining == 6
    page = log.page(4, limit=4)
    assert [e.index for e in page.episodes] == [5, 6, 7, 8] and page.remaining == 2
    page = log.page(8, limit=4)
    assert [e.index for e in page.episodes] == [9, 10] and page.remaining == 0
    page = log.page(10)
    assert page.episodes == [] and page.remaining == 0 and page.skipped == 0


def test_a_cursor_behind_the_ring_learns_how_many_it_missed():
    log = log_of(250, kept=100)  # retains 151..250
    page = log.page(30, limit=40)
    assert [e.index for e in page.episodes] == list(range(151, 191))
    assert (page.skipped, page.remaining, page.oldest) == (120, 60, 151)
    assert log.page(190).skipped == 0
    assert [e.index for e in log.episodes] == list(range(151, 251))


def test_page_size_defaults_and_cap():
    log = log_of(MAX_PAGE + 10)
    assert len(log.page(0).episodes) == DEFAULT_PAGE
    assert len(log.page(0, limit=10 ** 6).episodes) == MAX_PAGE
    assert log.page(0, limit=10 ** 6).remaining == 10


def test_a_cursor_beyond_the_newest_returns_nothing():
    page = log_of(5).page(2 ** 63)
    assert page.episodes == [] and page.remaining == 0 and page.skipped == 0 and page.oldest == 1
