"""The algorithm seam: services ask the algorithm, never its name.

Each algorithm is a package here. Its `__init__` holds the torch-free `Algorithm` (its settings, what
its fragments carry, how the buffer keeps and serves them, the batch size, what the planner balances);
`config.py` its settings (the config section named after it), `networks.py` its networks, `acting.py`
how actors act (exploration) and `learner.py` how learners decode batches and update. Adding one = a
new package + an entry in `_ALGORITHMS`: services/config.py gives every registered algorithm its section.
"""

from __future__ import annotations

from typing import Any

from services.algorithms.base import Algorithm, FifoTable, ReplayTable
from services.algorithms.dqn import DQN
from services.algorithms.ppo import PPO
from services.algorithms.sac import SAC

_ALGORITHMS: tuple[Algorithm[Any], ...] = (PPO(), DQN(), SAC())
REGISTRY: dict[str, Algorithm[Any]] = {a.name: a for a in _ALGORITHMS}
BY_CODE: dict[int, Algorithm[Any]] = {a.code: a for a in _ALGORITHMS}

__all__ = ["Algorithm", "FifoTable", "ReplayTable", "REGISTRY", "BY_CODE", "get", "name_of"]


def get(name: str) -> Algorithm[Any]:
    """The algorithm called `name`; ValueError naming `algorithm` for an unknown one."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"algorithm: {name!r} is not one of {', '.join(sorted(REGISTRY))}") from None


def name_of(code: int) -> str:
    """A kuberl.v1.Algorithm code's name, for messages (the number itself when unknown)."""
    algo = BY_CODE.get(code)
    return algo.name if algo is not None else str(code)
