"""What `kuberl up` shows and records of a run as it goes: the progress line, the columns of
metrics.csv (one row per poll) and episodes.csv (one row per finished episode), and the share of
time the actors were held."""

from __future__ import annotations

from collections.abc import Mapping

from services.cli.tally import LOSS_REASONS, fmt_losses, fmt_return

CSV_COLUMNS = ["wall_s", "env_steps", "episodes", "episodes_skipped", "return_mean", "actor_env_steps_per_s",
               "actor_fragments_dropped_total", "actor_fragments_rejected_total", "samples_lost_total",
               *(f"samples_lost_{r}" for r in LOSS_REASONS), "buffer_size_samples", "buffer_samples_per_insert",
               "learner_updates_per_s", "learner_samples_per_s", "learner_policy_version",
               "learner_policy_lag_mean", "replay_ratio_target", "actors_held_share", "actors", "learners",
               "planner_ratio", "process_restarts"]
EPISODE_COLUMNS = ["wall_s", "env_steps", "return", "length", "policy_version"]


class HeldShare:
    """The share of the actors' time between two rows that they were held (the rate limiter or on-policy
    pacing: the sum of their `actor/pace_wait_seconds_total`)."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None   # (when, the actors' held seconds) at the last row

    def update(self, now: float, held_s: float, actors: int) -> float | None:
        """The share since the last call, in [0, 1]; None on the first call or without actors."""
        last, self._last = self._last, (now, held_s)
        if last is None or not actors or now <= last[0]:
            return None
        return min(1.0, max(0.0, (held_s - last[1]) / ((now - last[0]) * actors)))


def progress_line(row: dict, window: int, policies: Mapping[str, float | None] | None = None) -> str:
    """The console line of a metrics.csv row; `window`: the episodes the mean return is over; `policies`:
    a run's several (config `policies`), each shown with its return (against its target, where it has
    one: `red 3.2/5`) and version."""
    def f(v, spec=",.0f"):
        return "-" if v is None else format(v, spec)
    skipped = f" ({row['episodes_skipped']:,} skipped)" if row["episodes_skipped"] else ""
    # The replay ratio held against its target, and how much of the time the actors were held for it.
    ratio = (f" ratio {f(row['buffer_samples_per_insert'], ',.1f')}/{row['replay_ratio_target']:g}"
             if row["replay_ratio_target"] else "")
    held = f" held {row['actors_held_share']:.0%}" if row["actors_held_share"] is not None else ""
    return (f"[{row['wall_s']:7.1f}s] steps {row['env_steps']:>10,} ({f(row['actor_env_steps_per_s'])}/s,"
            f" {row['actors']} actor{'s' if row['actors'] != 1 else ''})"
            f" | episodes {row['episodes']:>6,}{skipped} | return {fmt_return(row['return_mean'])}"
            f" (last {window}) | {'learner' if row['learners'] <= 1 else str(row['learners']) + ' learners'}"
            f" v{f(row['learner_policy_version'])}"
            f" {f(row['learner_updates_per_s'], ',.1f')} upd/s {f(row['learner_samples_per_s'])} smp/s"
            f" lag {f(row['learner_policy_lag_mean'], '.1f')} | buffer {f(row['buffer_size_samples'])}"
            f"{ratio}{held}"
            f" | lost {fmt_losses({r: row[f'samples_lost_{r}'] for r in LOSS_REASONS})}"
            + ("" if not policies else " | " + ", ".join(
                f"{name} {fmt_return(row.get(f'return_mean_{name}'))}{'' if target is None else f'/{target:g}'}"
                f" v{f(row.get(f'policy_version_{name}'))}" for name, target in policies.items())))
