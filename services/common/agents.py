"""Several agents in one env: PettingZoo envs as a vector of agent *slots* that one policy steps.

`env.id: pettingzoo:<module>` names a PettingZoo env module (`mpe2.simple_spread_v3`,
`pettingzoo.butterfly.pistonball_v6`, `kuberl_envs.tron`, or any module of your own that follows the
API): its `parallel_env(**env.kwargs)`, or its AEC `env(**env.kwargs)` through PettingZoo's
`aec_to_parallel` where the AEC env says it can be stepped so (turn-based games cannot: refused).

`ParallelVectorEnv` runs `num_envs` copies and gives each of the env's `possible_agents` a slot per
copy: N = num_envs * len(possible_agents) columns, agent j of copy k in column k * S + j. Every agent
is stepped by the same policy (parameter sharing), so every agent must have the same observation and
action space. It steps like a gymnasium vector env in SAME_STEP autoreset mode, with two additions in
`info`:
- `present` [N] bool: the slots whose agent acts at the observation returned. A slot is absent before
  its agent appears and after it ends while the others play on; its observation is zeros and the
  action given for it is ignored. The rollout (services/actor/rollout.py) records only present steps.
- `final_obs` [N, *shape]: an agent's last observation on the step it ended (terminated, truncated, or
  left the env's `agents` without either, which counts as truncated);
- `episode_over` [num_envs] bool (after a step): the copies whose episode ended at it.
When every agent of a copy has ended, the copy is reset at once and its agents' first observations are
returned, as a gymnasium vector env does. An observation that is a dict of `observation` and
`action_mask` (PettingZoo's convention for classic games) gives the observation and `info["action_mask"]`.

Imports pettingzoo lazily; only actors and learners import this module.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

PREFIX = "pettingzoo:"


def is_pettingzoo(env_id: str) -> bool:
    """True for the ids of PettingZoo env modules (`pettingzoo:<module>`)."""
    return env_id.startswith(PREFIX)


def make_parallel(env_id: str, kwargs: dict[str, Any] | None = None) -> Callable[[], Any]:
    """A maker of the PettingZoo parallel env `env_id` names; ValueError naming env.id when its module
    cannot be imported or makes neither a parallel nor an AEC env."""
    module_name = env_id.removeprefix(PREFIX)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"env.id: {env_id!r}: module {module_name!r} cannot be imported ({err})") from None
    kw = dict(kwargs or {})
    if callable(getattr(module, "parallel_env", None)):
        return lambda: module.parallel_env(**kw)
    if callable(getattr(module, "env", None)):
        if not _parallelizable(module_name, tuple(sorted(kw.items()))):
            raise ValueError(f"env.id: {env_id!r} is a turn-based (AEC) env that PettingZoo cannot step as a "
                             f"parallel one (its metadata lacks is_parallelizable); turn-based envs are not "
                             f"supported yet")
        from pettingzoo.utils.conversions import aec_to_parallel  # type: ignore[import-untyped]
        return lambda: aec_to_parallel(module.env(**kw))
    raise ValueError(f"env.id: {env_id!r}: module {module_name!r} has no parallel_env() or env()")


@functools.lru_cache(maxsize=64)
def _parallelizable(module_name: str, kwargs: tuple[tuple[str, Any], ...]) -> bool:
    """Whether the AEC env `module_name`'s env(**kwargs) says PettingZoo can step it in parallel (read
    once per module and kwargs: env_spec, the actor and eval all ask)."""
    probe = importlib.import_module(module_name).env(**dict(kwargs))
    try:
        return bool(getattr(probe, "metadata", {}).get("is_parallelizable", False))
    finally:
        probe.close()


def map_agents(policies: Mapping[str, Sequence[str]], agents: Sequence[str], default: str,
               env_id: str = "the env") -> dict[str, list[int]]:
    """Each policy's agents, as indices into `agents` (an env's possible_agents), in config order: an agent
    goes to the first policy with a pattern (`fnmatch`, case-sensitive) that matches its id. No policies:
    `default` plays every agent. ValueError naming the key when an agent matches no policy's patterns or
    a policy matches no agent."""
    if not policies:
        return {default: list(range(len(agents)))}
    out: dict[str, list[int]] = {name: [] for name in policies}
    for i, agent in enumerate(agents):
        owner = next((name for name, patterns in policies.items()
                      if any(fnmatch.fnmatchcase(agent, p) for p in patterns)), None)
        if owner is None:
            raise ValueError(f"policies: agent {agent!r} of {env_id} matches no policy's agents "
                             f"({'; '.join(f'{n}: {list(p)}' for n, p in policies.items())})")
        out[owner].append(i)
    for name, got in out.items():
        if not got:
            raise ValueError(f"policies.{name}.agents: {list(policies[name])} match none of {env_id}'s agents "
                             f"{list(agents)} (or only agents an earlier policy takes)")
    return out


def game_score(returns: np.ndarray, mine: int) -> float:
    """One agent's result in a finished game, from every agent's return: 1 (a win) when agent `mine`'s
    return is above every other's, 0 (a loss) when below any, else 0.5 (a draw). Self-play and
    `kuberl eval --against` score games by it."""
    best_other = np.delete(returns, mine).max()
    return 1.0 if returns[mine] > best_other else 0.0 if returns[mine] < best_other else 0.5


OUTCOMES = {1.0: "wins", 0.0: "losses", 0.5: "draws"}   # game_score -> its name in counts and metrics


def _split_space(space: Any) -> tuple[Any, Any | None]:
    """(observation space, action-mask space or None) of an agent's observation space."""
    spaces = getattr(space, "spaces", None)
    if isinstance(spaces, dict) and set(spaces) == {"observation", "action_mask"}:
        return spaces["observation"], spaces["action_mask"]
    return space, None


class ParallelVectorEnv:
    """`num_envs` copies of a PettingZoo parallel env as N agent slots (see the module's docstring)."""

    def __init__(self, make: Callable[[], Any], num_envs: int, env_id: str = "pettingzoo env"):
        self.env_id = env_id
        self.copies = [make() for _ in range(num_envs)]
        first = self.copies[0]
        self.agents: list[str] = list(first.possible_agents)
        if not self.agents:
            raise ValueError(f"env.id: {env_id}: possible_agents is empty")
        obs0, mask0 = _split_space(first.observation_space(self.agents[0]))
        act0 = first.action_space(self.agents[0])
        for agent in self.agents[1:]:
            obs, mask = _split_space(first.observation_space(agent))
            act = first.action_space(agent)
            for what, mine, theirs in (("observation", obs, obs0), ("action", act, act0)):
                if mine != theirs:
                    raise ValueError(
                        f"env.id: {env_id}: agent {agent!r} has {what} space {mine}, agent {self.agents[0]!r} "
                        f"{theirs}; the agents share one policy, so their spaces must be the same")
            if (mask is None) != (mask0 is None):
                raise ValueError(f"env.id: {env_id}: agent {agent!r} has an action mask and agent "
                                 f"{self.agents[0]!r} does not (or the other way round)")
        self.single_observation_space, self.single_action_space = obs0, act0
        self.masked = mask0 is not None
        self.slots = len(self.agents)
        self.num_envs = num_envs * self.slots
        shape, dtype = obs0.shape, obs0.dtype
        self._obs = np.zeros((self.num_envs, *shape), dtype)
        self._last = np.zeros((self.num_envs, *shape), dtype)   # each slot's last observation
        self._present = np.zeros(self.num_envs, bool)
        self._mask: np.ndarray | None = None
        if mask0 is not None:
            self._mask = np.ones((self.num_envs, int(getattr(mask0, "n", 0) or np.prod(mask0.shape))), dtype=np.bool_)

    def _col(self, k: int, agent: str) -> int:
        try:
            return k * self.slots + self.agents.index(agent)
        except ValueError:
            raise ValueError(f"env.id: {self.env_id}: agent {agent!r} is not in possible_agents "
                             f"{self.agents}") from None

    def _take(self, k: int, observations: dict[str, Any]) -> None:
        """Copy k's observations of its live agents into their slots (zeros for the others)."""
        base = k * self.slots
        self._present[base:base + self.slots] = False
        self._obs[base:base + self.slots] = 0
        for agent in self.copies[k].agents:
            if agent not in observations:
                raise ValueError(f"env.id: {self.env_id}: agent {agent!r} is live but has no observation")
            n = self._col(k, agent)
            self._obs[n] = self._unpack(n, observations[agent])
            self._present[n] = True
        self._last[base:base + self.slots] = self._obs[base:base + self.slots]

    def _unpack(self, n: int, observation: Any) -> np.ndarray:
        if self._mask is not None:
            self._mask[n] = np.asarray(observation["action_mask"], bool).reshape(-1)
            observation = observation["observation"]
        return np.asarray(observation)

    def _info(self, final_obs: np.ndarray | None = None, over: np.ndarray | None = None) -> dict[str, Any]:
        info: dict[str, Any] = {"present": self._present.copy()}
        if final_obs is not None:
            info["final_obs"], info["episode_over"] = final_obs, over
        if self._mask is not None:
            info["action_mask"] = self._mask.copy()
        return info

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        for k, env in enumerate(self.copies):
            observations, _ = env.reset(seed=None if seed is None else seed + k)
            self._take(k, observations)
        return self._obs.copy(), self._info()

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        n_all = self.num_envs
        rewards = np.zeros(n_all, np.float32)
        terminated, truncated = np.zeros(n_all, bool), np.zeros(n_all, bool)
        final_obs = np.zeros_like(self._obs)
        over = np.zeros(len(self.copies), bool)
        for k, env in enumerate(self.copies):
            acting = list(env.agents)
            observations, rew, term, trunc, _ = env.step({a: actions[self._col(k, a)] for a in acting})
            live = set(env.agents)
            for agent in acting:
                n = self._col(k, agent)
                rewards[n] = float(rew.get(agent, 0.0))
                terminated[n] = bool(term.get(agent, False))
                # An agent that leaves the env's agents without terminating is cut short.
                truncated[n] = not terminated[n] and (bool(trunc.get(agent, False)) or agent not in live)
                if terminated[n] or truncated[n]:
                    final_obs[n] = self._unpack(n, observations[agent]) if agent in observations else self._last[n]
            if not env.agents:   # every agent ended: the copy starts its next episode now
                observations, _ = env.reset()
                over[k] = True
            self._take(k, observations)
        return self._obs.copy(), rewards, terminated, truncated, self._info(final_obs, over)

    def close(self) -> None:
        for env in self.copies:
            env.close()
