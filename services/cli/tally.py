"""`kuberl up`'s run totals: counters summed over every process the run had, across restarts, and the
actors' episode feeds read page by page without missing or double-counting an episode.

Pure (no gRPC, no clock): `LocalRun.poll` feeds it every GetStats answer, tests feed it made-up ones.

- A process is known by its name (actor-0, learner-1, buffer-0, ...). Its `_total` counters start at 0
  again when it restarts under that name, and its episode indices at 1. A restart is detected by a new
  GetStatsResponse.process_start_unix_s (or, from a server without it, by uptime or a counter going
  down); the old process's last counters are then banked, so run totals never go backwards, and the
  episode cursor starts over.
- Episodes: each answer holds one page after the cursor; `more` says to ask again at once
  (episodes_remaining > 0). Episodes a slow reader can no longer get (the actor retains a bounded
  number; GetStatsResponse.episodes_skipped) and episodes a dead process counted but never handed
  out are counted in `episodes_skipped`, never dropped silently. The episode count itself comes from
  the exact counter `actor/episodes_total`, not from the feed.
- Losses: samples lost before training, by reason (`loss_counters`), banked like any counter.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

# Without process_start_unix_s, uptime going down by more than this means a new process.
UPTIME_SLACK_S = 1.0

# A reader catches up at most this many pages per poll (16 x 4096 covers an actor's whole retention);
# anything left is read at the next poll.
MAX_PAGES_PER_POLL = 64

# Why samples were lost before training, in the order the progress line lists them.
LOSS_REASONS = ("dropped", "rejected", "evicted", "stale")
LOSS_LABELS = {"dropped": "dropped", "rejected": "rejected", "evicted": "evicted", "stale": "stale"}


def _loss_key(reason: str) -> str:
    return f"lost/{reason}_samples_total"


def loss_counters(metrics: dict[str, float]) -> dict[str, float]:
    """One process's samples lost before training, by reason, from its own counters (any role).

    - dropped: the actor's send queue was full (or the buffer unreachable at shutdown);
    - rejected: the buffer refused them as malformed;
    - evicted: pushed out of a full PPO FIFO before being served;
    - stale: PPO fragments older than ppo.max_policy_lag, dropped by the buffer or the learner.

    (A batch whose learner went away before it was sent loses nothing: the buffer takes it back,
    buffer/batches_unsent_total.)

    Actors count dropped and rejected fragments, not samples (unless they report
    `actor/samples_{dropped,rejected}_total`): those are converted at the actor's own samples per
    fragment (samples pushed / fragments pushed; env steps / fragments cut before its first push),
    which is exact for local actors, whose fragments all hold rollout_steps x num_envs samples."""
    get = metrics.get
    out = dict.fromkeys((_loss_key(r) for r in LOSS_REASONS), 0.0)
    if get("actor/fragments_pushed_total", 0) > 0:
        per_fragment = get("actor/samples_pushed_total", 0.0) / get("actor/fragments_pushed_total")
    elif get("actor/fragments_total", 0) > 0:
        per_fragment = get("actor/env_steps_total", 0.0) / get("actor/fragments_total")
    else:
        per_fragment = 0.0
    for reason in ("dropped", "rejected"):
        samples = get(f"actor/samples_{reason}_total")
        if samples is None:
            samples = round(get(f"actor/fragments_{reason}_total", 0.0) * per_fragment)
        out[_loss_key(reason)] += samples
    out[_loss_key("evicted")] += get("buffer/samples_evicted_total", 0.0)
    out[_loss_key("stale")] += (get("buffer/samples_dropped_stale_total", 0.0)
                                + get("learner/samples_dropped_stale_total", 0.0))
    return out


def fmt_return(value: float | None) -> str:
    """A return with 4 significant digits ("0.8512", "21.5", "500"); whole numbers from 10,000 up."""
    if value is None:
        return "-"
    text = format(value, ".4g")
    if "e" in text and abs(value) >= 1:
        text = format(value, ",.0f")
    return text


def fmt_losses(losses: dict[str, float]) -> str:
    """`0`, or `12,345 (dropped 100, evicted 12,000, stale 245)`: the total and every non-zero reason."""
    total = sum(losses.values())
    if not total:
        return "0"
    parts = [f"{LOSS_LABELS[r]} {losses[r]:,.0f}" for r in LOSS_REASONS if losses.get(r)]
    return f"{total:,.0f} ({', '.join(parts)})"


@dataclass
class _Process:
    """What the tally knows of the process now running under one name."""
    start: float = 0.0                 # process_start_unix_s (0 = not reported)
    uptime_s: float | None = None
    counters: dict[str, float] = field(default_factory=dict)   # its `_total` counters and losses
    cursor: int = 0                    # index of the last episode read from it


class Tally:
    def __init__(self, return_window: int):
        self.returns: deque[float] = deque(maxlen=return_window)
        self.policy_returns: dict[str, deque[float]] = {}   # each policy's, of a run of several
        self.episodes_read = 0          # episodes whose returns went through `record`
        self.episodes_skipped = 0       # counted by an actor but never readable (see the module doc)
        self.restarts: dict[str, int] = defaultdict(int)   # name -> restarts seen
        self._banked: dict[str, float] = defaultdict(float)  # counters of processes that are gone
        self._procs: dict[str, _Process] = {}

    # -- feeding -----------------------------------------------------------------------------------
    def cursor(self, name: str) -> int:
        """The `episodes_after` to ask `name` for."""
        proc = self._procs.get(name)
        return proc.cursor if proc is not None else 0

    def observe_response(self, name: str, resp) -> tuple[list, bool]:
        """`observe` a GetStatsResponse that was requested with `episodes_after=self.cursor(name)`."""
        return self.observe(name, dict(resp.metrics), start=resp.process_start_unix_s, uptime_s=resp.uptime_s,
                            episodes=list(resp.episodes), remaining=resp.episodes_remaining,
                            skipped=resp.episodes_skipped)

    def observe(self, name: str, metrics: dict[str, float], *, start: float = 0.0, uptime_s: float | None = None,
                episodes=(), remaining: int = 0, skipped: int = 0) -> tuple[list, bool]:
        """Take one GetStats answer of `name`, requested with `episodes_after=self.cursor(name)`.

        Returns (the new episodes, oldest first; whether to ask again at once). Pass the episodes of
        every process polled to `record` to fold their returns into the window."""
        proc = self._procs.get(name)
        if proc is None:
            proc = self._procs[name] = _Process()
        elif self._restarted(proc, metrics, start, uptime_s):
            self._bank(name, proc)
            asked_after = proc.cursor
            proc = self._procs[name] = _Process(start=start, uptime_s=uptime_s, counters=self._counters(metrics))
            if asked_after:  # the page was cut after the old process's cursor: read the new one from its start
                return [], True
        proc.start, proc.uptime_s, proc.counters = start, uptime_s, self._counters(metrics)
        new = [e for e in episodes if e.index > proc.cursor]
        self.episodes_skipped += skipped
        proc.cursor = max(new[-1].index if new else 0, proc.cursor + skipped)
        return new, bool(remaining) and bool(new or skipped)

    def read(self, name: str, fetch, out: list, max_pages: int = MAX_PAGES_PER_POLL):
        """Page through `name`'s new episodes until caught up: `fetch(episodes_after)` is one GetStats
        call. Appends the new episodes to `out` page by page (so a failed call keeps what was read
        before it; its exception propagates) and returns the last response."""
        resp = None
        for _ in range(max_pages):
            resp = fetch(self.cursor(name))
            episodes, more = self.observe_response(name, resp)
            out.extend(episodes)
            if not more:
                break
        return resp

    def record(self, episodes) -> list:
        """Fold episodes (from any processes) into the return window, in order of their end time;
        returns them in that order."""
        ordered = sorted(episodes, key=lambda e: e.end_unix_s)
        self.returns.extend(e.episode_return for e in ordered)
        for e in ordered:
            if e.policy:   # (a run of several policies: each its own window too)
                self.policy_returns.setdefault(e.policy, deque(maxlen=self.returns.maxlen)).append(e.episode_return)
        self.episodes_read += len(ordered)
        return ordered

    # -- reading -----------------------------------------------------------------------------------
    def total(self, counter: str) -> float:
        """`counter` summed over every process ever seen: the ones gone (their last value) and the live."""
        return self._banked.get(counter, 0.0) + sum(p.counters.get(counter, 0.0) for p in self._procs.values())

    def losses(self) -> dict[str, float]:
        """Samples lost before training over the whole run, by reason (LOSS_REASONS)."""
        return {r: self.total(_loss_key(r)) for r in LOSS_REASONS}

    @property
    def mean_return(self) -> float | None:
        return sum(self.returns) / len(self.returns) if self.returns else None

    # -- internals ---------------------------------------------------------------------------------
    @staticmethod
    def _counters(metrics: dict[str, float]) -> dict[str, float]:
        out = {k: float(v) for k, v in metrics.items() if k.endswith("_total")}
        out.update(loss_counters(metrics))
        return out

    @staticmethod
    def _restarted(proc: _Process, metrics: dict[str, float], start: float, uptime_s: float | None) -> bool:
        if start and proc.start:
            return start != proc.start
        if uptime_s is not None and proc.uptime_s is not None and uptime_s < proc.uptime_s - UPTIME_SLACK_S:
            return True
        if metrics.get("actor/episodes_total", proc.cursor) < proc.cursor:
            return True
        return any(k.endswith("_total") and not k.startswith("lost/") and metrics.get(k, v) < v
                   for k, v in proc.counters.items())

    def _bank(self, name: str, proc: _Process) -> None:
        for k, v in proc.counters.items():
            self._banked[k] += v
        # Episodes the old process counted but nobody read: gone with it.
        self.episodes_skipped += max(0, int(proc.counters.get("actor/episodes_total", 0)) - proc.cursor)
        self.restarts[name] += 1
