"""Several agents in one env: PettingZoo envs as a vector of agent *slots* that one policy steps.

`env.id: pettingzoo:<module>` names a PettingZoo env module (`mpe2.simple_spread_v3`,
`pettingzoo.butterfly.pistonball_v6`, `kuberl_envs.tron`, or any module of your own that follows the
API): its `parallel_env(**env.kwargs)`, or its AEC `env(**env.kwargs)` through PettingZoo's
`aec_to_parallel` where the AEC env says it can be stepped so; a turn-based game (tic-tac-toe, connect
four) through services/common/turns.py, where the agents off their turn pass.

`ParallelVectorEnv` runs `num_envs` copies and gives each of the env's `possible_agents` a slot per
copy: N = num_envs * len(possible_agents) columns, agent j of copy k in column k * S + j. Every agent
is stepped by the same policy (parameter sharing), so every agent must have the same observation and
action space. (A run of several policies, config `policies`, splits the agents into a group per policy
instead, each group with its own spaces and slots, and everything below per group: `SlotGroup`.) It
steps like a gymnasium vector env in SAME_STEP autoreset mode, with two additions in `info`:
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
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
        with warnings.catch_warnings():
            # PettingZoo 1.27's own env modules warn on import that their API will move to a registry.
            warnings.filterwarnings("ignore", "The old environment creation API", DeprecationWarning)
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"env.id: {env_id!r}: module {module_name!r} cannot be imported ({err})") from None
    kw = dict(kwargs or {})
    if callable(getattr(module, "parallel_env", None)):
        return lambda: module.parallel_env(**kw)
    if callable(getattr(module, "env", None)):
        if not _parallelizable(module_name, tuple(sorted(kw.items()))):   # a turn-based game: turns.py
            from services.common.turns import TurnBased
            return lambda: TurnBased(module.env(**kw), env_id)
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


def policy_of(policies: Mapping[str, Sequence[str]], agent: str) -> str | None:
    """The policy that plays `agent`: the first, in config order, with a pattern (`fnmatch`, case-sensitive)
    that matches its id; None where none does."""
    return next((name for name, patterns in policies.items() if any(fnmatch.fnmatchcase(agent, p) for p in patterns)),
                None)


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
        if (owner := policy_of(policies, agent)) is None:
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


@dataclass
class SlotGroup:
    """The agents one policy plays (all of them, in a run of one), as slots: agent `agents[j]` of copy k
    in slot k * len(agents) + j, with its group's spaces and arrays."""
    name: str
    agents: list[str]
    observation_space: Any
    action_space: Any
    mask_space: Any | None
    obs: np.ndarray = field(init=False)       # [slots, *shape]: each slot's observation now (zeros: absent)
    last: np.ndarray = field(init=False)      # each slot's last observation
    present: np.ndarray = field(init=False)   # [slots] bool: the slots whose agent acts now
    mask: np.ndarray | None = field(init=False)

    def allocate(self, copies: int) -> None:
        n = copies * len(self.agents)
        shape, dtype = self.observation_space.shape, self.observation_space.dtype
        self.obs, self.last = np.zeros((n, *shape), dtype), np.zeros((n, *shape), dtype)
        self.present = np.zeros(n, bool)
        self.mask = None if self.mask_space is None else np.ones(
            (n, int(getattr(self.mask_space, "n", 0) or np.prod(self.mask_space.shape))), dtype=np.bool_)


class ParallelVectorEnv:
    """`num_envs` copies of a PettingZoo parallel env as agent slots (see the module's docstring).

    `policies` (policy name -> patterns of agent ids, config `policies`): the agents split among the
    policies of a run of several (`map_agents`); each group's agents must share their spaces, the
    groups' may differ, and observations, rewards and the rest come per group, as dicts by policy name
    (actions go in so too). Without `policies`, one group of every agent, and arrays."""

    def __init__(self, make: Callable[[], Any], num_envs: int, env_id: str = "pettingzoo env",
                 policies: Mapping[str, Sequence[str]] | None = None):
        self.env_id = env_id
        self.copies = [make() for _ in range(num_envs)]
        first = self.copies[0]
        self.agents: list[str] = list(first.possible_agents)
        if not self.agents:
            raise ValueError(f"env.id: {env_id}: possible_agents is empty")
        self.grouped = bool(policies)
        groups = map_agents(policies, self.agents, "", env_id) if policies else {"": list(range(len(self.agents)))}
        self.groups = [self._group(first, name, [self.agents[j] for j in members]) for name, members in groups.items()]
        self._where: dict[str, tuple[SlotGroup, int]] = {   # agent -> (its group, its place in the group)
            agent: (g, j) for g in self.groups for j, agent in enumerate(g.agents)}
        whole = self.groups[0]
        self.single_observation_space, self.single_action_space = whole.observation_space, whole.action_space
        self.masked = whole.mask_space is not None
        self.slots = len(self.agents)
        self.num_envs = num_envs * self.slots
        for g in self.groups:
            g.allocate(num_envs)

    def _group(self, first: Any, name: str, agents: list[str]) -> SlotGroup:
        """A group's slots; ValueError naming env.id and the agent when its agents' spaces differ."""
        obs0, mask0 = _split_space(first.observation_space(agents[0]))
        act0 = first.action_space(agents[0])
        # (A group of a run of several policies: the key to change is the policy's agents.)
        key, share = ((f"policies.{name}.agents: {self.env_id}", f"they are policy {name!r}'s agents, so their "
                       f"spaces must be the same") if self.grouped
                      else (f"env.id: {self.env_id}", "the agents share one policy, so their spaces must be the same"))
        for agent in agents[1:]:
            obs, mask = _split_space(first.observation_space(agent))
            act = first.action_space(agent)
            for what, mine, theirs in (("observation", obs, obs0), ("action", act, act0)):
                if mine != theirs:
                    raise ValueError(f"{key}: agent {agent!r} has {what} space {mine}, agent {agents[0]!r} "
                                     f"{theirs}; {share}")
            if (mask is None) != (mask0 is None):
                raise ValueError(f"{key}: agent {agent!r} has an action mask and agent {agents[0]!r} does not "
                                 f"(or the other way round)")
        return SlotGroup(name, agents, obs0, act0, mask0)

    def spaces(self, name: str) -> tuple[Any, Any]:
        """(observation space, action space) of group `name`'s agents."""
        g = next(g for g in self.groups if g.name == name)
        return g.observation_space, g.action_space

    def slot(self, k: int, agent: str) -> tuple[SlotGroup, int]:
        try:
            g, j = self._where[agent]
        except KeyError:
            raise ValueError(f"env.id: {self.env_id}: agent {agent!r} is not in possible_agents "
                             f"{self.agents}") from None
        return g, k * len(g.agents) + j

    def _col(self, k: int, agent: str) -> int:
        """(Ungrouped) an agent's slot in copy k."""
        return self.slot(k, agent)[1]

    def _take(self, k: int, observations: dict[str, Any]) -> None:
        """Copy k's observations of its live agents into their slots (zeros for the others)."""
        for g in self.groups:
            block = slice(k * len(g.agents), (k + 1) * len(g.agents))
            g.present[block] = False
            g.obs[block] = 0
        for agent in self.copies[k].agents:
            if agent not in observations:
                raise ValueError(f"env.id: {self.env_id}: agent {agent!r} is live but has no observation")
            g, n = self.slot(k, agent)
            g.obs[n] = self._unpack(g, n, observations[agent])
            g.present[n] = True
        for g in self.groups:
            block = slice(k * len(g.agents), (k + 1) * len(g.agents))
            g.last[block] = g.obs[block]

    @staticmethod
    def _unpack(g: SlotGroup, n: int, observation: Any) -> np.ndarray:
        if g.mask is not None:
            g.mask[n] = np.asarray(observation["action_mask"], bool).reshape(-1)
            observation = observation["observation"]
        return np.asarray(observation)

    def _out(self, arrays: dict[str, Any]) -> Any:
        """Per group: a dict by name (grouped), else the one group's."""
        return arrays if self.grouped else arrays[""]

    def _info(self, final_obs: dict[str, np.ndarray] | None = None, over: np.ndarray | None = None) -> dict[str, Any]:
        info: dict[str, Any] = {"present": self._out({g.name: g.present.copy() for g in self.groups})}
        if final_obs is not None:
            info["final_obs"], info["episode_over"] = self._out(final_obs), over
        masks = {g.name: g.mask.copy() for g in self.groups if g.mask is not None}
        if masks:
            info["action_mask"] = self._out(masks)
        return info

    def reset(self, seed: int | None = None) -> tuple[Any, dict[str, Any]]:
        for k, env in enumerate(self.copies):
            observations, _ = env.reset(seed=None if seed is None else seed + k)
            self._take(k, observations)
        return self._out({g.name: g.obs.copy() for g in self.groups}), self._info()

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        acts = actions if self.grouped else {"": actions}
        rewards = {g.name: np.zeros(len(g.obs), np.float32) for g in self.groups}
        terminated = {g.name: np.zeros(len(g.obs), bool) for g in self.groups}
        truncated = {g.name: np.zeros(len(g.obs), bool) for g in self.groups}
        final_obs = {g.name: np.zeros_like(g.obs) for g in self.groups}
        over = np.zeros(len(self.copies), bool)
        for k, env in enumerate(self.copies):
            acting = list(env.agents)
            slots = {agent: self.slot(k, agent) for agent in acting}
            observations, rew, term, trunc, _ = env.step({a: acts[g.name][n] for a, (g, n) in slots.items()})
            live = set(env.agents)
            for agent, (g, n) in slots.items():
                rewards[g.name][n] = float(rew.get(agent, 0.0))
                ended = terminated[g.name][n] = bool(term.get(agent, False))
                # An agent that leaves the env's agents without terminating is cut short.
                cut = truncated[g.name][n] = not ended and (bool(trunc.get(agent, False)) or agent not in live)
                if ended or cut:
                    final_obs[g.name][n] = (self._unpack(g, n, observations[agent]) if agent in observations
                                            else g.last[n])
            if not env.agents:   # every agent ended: the copy starts its next episode now
                observations, _ = env.reset()
                over[k] = True
            self._take(k, observations)
        return (self._out({g.name: g.obs.copy() for g in self.groups}), self._out(rewards), self._out(terminated),
                self._out(truncated), self._info(final_obs, over))

    def close(self) -> None:
        for env in self.copies:
            env.close()
