"""How a window of steps of several agent slots is cut into fragments: each slot's runs of steps at
which its agent acted, grouped by their span (`split_runs`), and the final observations re-numbered
within each group (`window_groups`). The rollout (rollout.py) and the EnvSession hub (sessions.py) cut
their windows so: every step an agent took is in exactly one fragment, and no fragment's column holds
a step nobody took."""

from __future__ import annotations

import numpy as np


def split_runs(present: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """The fragments a window of T steps of N agent slots is cut into, as (first step, end step, columns):
    each column's runs of steps at which its agent acted (`present` [T, N]), grouped by their span. The
    columns present throughout come first (one fragment, as with single-agent envs); an agent that
    came or went inside the window makes a shorter one (a run ends only where its agent ended)."""
    T, N = present.shape
    spans: dict[tuple[int, int], list[int]] = {}
    for n in range(N):
        col = present[:, n]
        u = 0
        while u < T:
            if not col[u]:
                u += 1
                continue
            v = u
            while v < T and col[v]:
                v += 1
            spans.setdefault((u, v), []).append(n)
            u = v
    order = sorted(spans, key=lambda span: (span != (0, T), span))
    return [(a, b, np.asarray(spans[(a, b)])) for a, b in order]


def window_groups(present: np.ndarray | None, t: int, N: int, final_index: list[int]
                  ) -> list[tuple[int, int, np.ndarray, list[tuple[int, int]]]]:
    """The fragments a window of t steps of N slots is cut into (`split_runs`; every slot throughout
    when `present` is None), each as (first step, end step, columns, picked): `picked` pairs each final
    observation of the group (its position in `final_index`, whose entries are u * N + n) with its
    index re-numbered within the group ((u - first) * len(columns) + the column's position)."""
    groups = [(0, t, np.arange(N))] if present is None else split_runs(present[:t])
    where = {(i // N, i % N): k for k, i in enumerate(final_index)}   # (step, column) -> its final_obs
    return [(a, b, cols, [(where[(u, n)], (u - a) * len(cols) + c) for u in range(a, b)
                          for c, n in enumerate(cols) if (u, n) in where])
            for a, b, cols in groups]
