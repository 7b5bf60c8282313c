"""Who acts where: every env the actor steps as groups of slots, and the players that sit in them.

The rollout (rollout.py), self-play (selfplay.py) and evaluation (services/cli/evaluate.py) step envs
through these, so there is one answer to "which slots does this call act for, and how do its actions
reach the env":

- **Slots.** `Slots` shows any vector env as groups of slots by policy name: a gymnasium vector env
  (classic control, MuJoCo, Atari) is one group whose slots are its copies, every one acting at every
  step; a PettingZoo env (services/common/agents.py) is a group per policy of the run (config
  `policies`; one group of every agent where it names none), its slots the agents of each copy, with
  `present` saying which act now. Reset and step speak dicts by group name either way, and `step`
  clips a Box action to its bounds (`to_env`) in this one place.
- **Players.** A `Player` acts for a batch of slots: `act(obs, mask, env_steps)` returns their actions
  and the extras the algorithm records (only the training policy records any). The training policy
  (`Learning`), a frozen snapshot of it (`Frozen`), a scripted `module:function` (`Scripted`,
  services/common/players.py) and the uniformly random player (`Uniform`) are players; so is a
  policy acting greedily (`Learning` of a greedy `Policy`). A recurrent policy keeps its state per
  slot (`Learning.state`), zeroed where a slot's episode ends (`ended`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from services.actor.policy import Policy
from services.common.agents import ParallelVectorEnv
from services.common.players import load_player
from services.common.protocol.spaces import ActionSpace, Box, random_actions

NO_EXTRAS: dict[str, np.ndarray] = {}   # what every player but the training policy records
NONE: dict[str, Any] = {}   # (an env's info without a per-group key; never written)


def to_env(space: ActionSpace, actions: np.ndarray) -> np.ndarray:
    """Actions as an env takes them: a Box's clipped to its bounds (a Gaussian's sample is not), others as
    they are. Every action the actor, self-play and evaluation send to an env goes through here."""
    return space.clip(actions) if isinstance(space, Box) else actions


class Slots:
    """A vector env as groups of slots by name (module docstring). `names`: the groups' names for a
    gymnasium vector env (one: the run's policy) or an ungrouped PettingZoo env (one); a grouped
    PettingZoo env names its own (`policies=` when it was made). `spaces`: each group's action space, by
    name, for `to_env`.

    `reset` and `step` return what the env does, per group: observations, rewards, terminated and
    truncated as dicts by name, and `info` with `present` (by name; a group of a gymnasium env has none:
    every slot acts), `final_obs` (by name, indexable by slot where it ended), `action_mask` (by name,
    where the env reports masks) and the env-wide `episode_over` and `lives`, where the env has them."""

    def __init__(self, envs: Any, name: str, spaces: dict[str, ActionSpace]):
        self.envs, self.spaces = envs, spaces
        self.grouped = isinstance(envs, ParallelVectorEnv) and envs.grouped
        self.names = [g.name for g in envs.groups] if self.grouped else [name]
        self.sizes = ({g.name: len(g.obs) for g in envs.groups} if self.grouped
                      else {name: envs.num_envs})

    def _by_group(self, value: Any) -> dict[str, Any]:
        return value if self.grouped else {self.names[0]: value}

    def _info(self, info: dict[str, Any]) -> dict[str, Any]:
        out = {key: self._by_group(info[key]) for key in ("present", "final_obs", "action_mask") if key in info}
        out.update({key: info[key] for key in ("episode_over", "lives") if key in info})
        return out

    def reset(self, seed: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        obs, info = self.envs.reset(seed=seed)
        return self._by_group(obs), self._info(info)

    def step(self, actions: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray],
                                                             dict[str, np.ndarray], dict[str, np.ndarray],
                                                             dict[str, Any]]:
        sent = {name: to_env(self.spaces[name], a) for name, a in actions.items()}
        obs, r, term, trunc, info = self.envs.step(sent if self.grouped else sent[self.names[0]])
        return self._by_group(obs), self._by_group(r), self._by_group(term), self._by_group(trunc), self._info(info)

    def close(self) -> None:
        self.envs.close()


class Player(Protocol):
    """Acts for a batch of slots: their actions in the action space's layout (unclipped: `to_env` clips
    what reaches the env) and the per-step extras the algorithm records with them (empty for every
    player but the training policy's). `rows`: which of the slots it may play these are (a player
    keeping a state per slot reads and moves theirs; None: all of them, in order)."""

    def act(self, obs: np.ndarray, mask: np.ndarray | None, env_steps: int, rows: np.ndarray | None = None
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]: ...


@dataclass(eq=False)
class Learning:
    """A `Policy` (the training policy, or a trained one evaluated or served) in n slots, with its recurrent
    state per slot where it has one (zeros at an episode's start: `ended`). `act` takes rows of the n slots
    (`rows`; None: all of them), so one call acts for whichever of them it plays. `greedy`: the most likely
    actions (True), sampled as actors act (False), or as the policy was made (None)."""
    policy: Policy
    n: int
    greedy: bool | None = None
    state: np.ndarray | None = field(init=False)

    def __post_init__(self) -> None:
        self.state = self.policy.initial_state(self.n)

    def act(self, obs: np.ndarray, mask: np.ndarray | None, env_steps: int, rows: np.ndarray | None = None
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        state = None if self.state is None else self.state if rows is None else self.state[rows]
        actions, extras, after = (self.policy.act(obs, env_steps, mask, state) if self.greedy is None
                                  else self.policy.act(obs, env_steps, mask, state, greedy=self.greedy))
        if after is not None and self.state is not None:
            if rows is None:
                self.state = after
            else:
                self.state[rows] = after
        return actions, extras

    def ended(self, done: np.ndarray) -> None:
        """The slots whose episode (or life) ended at the last step start the next one from a fresh state."""
        if self.state is not None:
            self.state[done] = 0.0


@dataclass(eq=False)
class Frozen:
    """A frozen copy of a policy's acting part (a self-play snapshot): acts as that version did. A recurrent
    one keeps its own state for each of `slots` slots it may play (`rows` of `act`), zeroed where a slot's
    episode ends (`ended`)."""
    version: int
    acting: Any
    slots: int = field(default=0, kw_only=True)
    state: np.ndarray | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        size = int(getattr(self.acting, "state_size", 0) or 0)
        if size:
            self.state = np.zeros((self.slots, size), np.float32)

    @torch.inference_mode()
    def act(self, obs: np.ndarray, mask: np.ndarray | None, env_steps: int, rows: np.ndarray | None = None
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        x = torch.from_numpy(np.ascontiguousarray(obs))
        m = None if mask is None else torch.from_numpy(np.ascontiguousarray(mask))
        if self.state is not None:
            at = np.arange(len(obs)) if rows is None else rows
            actions, _, after = self.acting.act(x, self.version, env_steps, mask=m,
                                                state=np.ascontiguousarray(self.state[at]))
            self.state[at] = after
            return actions, NO_EXTRAS
        return (self.acting.act(x, self.version, env_steps) if m is None
                else self.acting.act(x, self.version, env_steps, mask=m))[0], NO_EXTRAS

    def ended(self, done: np.ndarray) -> None:
        if self.state is not None:
            self.state[done] = 0.0


@dataclass(eq=False)
class Uniform:
    """The uniformly random player: each move uniform over what its mask allows, a Box uniform within its
    bounds (`random_actions`)."""
    space: ActionSpace
    rng: np.random.Generator

    def __post_init__(self) -> None:
        if isinstance(self.space, Box) and not self.space.bounded:
            raise ValueError(f"the random player acts uniformly within the action space's bounds, and {self.space} "
                             f"has none")

    def act(self, obs: np.ndarray, mask: np.ndarray | None, env_steps: int, rows: np.ndarray | None = None
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return random_actions(self.space, len(obs), None if mask is None else np.asarray(mask, bool), self.rng), NO_EXTRAS


@dataclass(eq=False)
class Scripted:
    """A fixed player `module:function` (services/common/players.py): one slot's observation (and mask) at a
    time."""
    name: str
    space: ActionSpace

    def __post_init__(self) -> None:
        self.play = load_player(self.name)

    def act(self, obs: np.ndarray, mask: np.ndarray | None, env_steps: int, rows: np.ndarray | None = None
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        out = np.zeros((len(obs), *self.space.shape), self.space.dtype)
        for i in range(len(obs)):
            out[i] = self.play(obs[i], None if mask is None else mask[i])
        return out, NO_EXTRAS


class Seats:
    """Who plays a group's slots: its training policy in every one (`Learning`, with a recurrent policy's
    state per slot), every step of every present slot recorded. Self-play (selfplay.py `SelfPlay`) seats
    other players beside it and records only the training policy's side."""

    def __init__(self, learning: Learning):
        self.learning = learning

    def recorded(self, present: np.ndarray | None) -> np.ndarray | None:
        """[slots] bool: the steps about to be taken that the group's window records (None: all of them)."""
        return present

    def act(self, obs: np.ndarray, present: np.ndarray | None, mask: np.ndarray | None, env_steps: int
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return self.learning.act(obs, mask, env_steps)

    def stepped(self, rewards: np.ndarray, ended: np.ndarray, over: np.ndarray | None) -> None:
        """After a step: `ended` the slots whose episode (or Atari life) ended, `over` the copies whose game did."""
        self.learning.ended(ended)

    def swapped(self) -> None:
        """The training policy swapped weights in (before a window)."""


@dataclass
class Step:
    """One group's side of an env step: what its slots saw (`obs`, `present` and `mask` now hold the next
    step's), with `term` counting a lost Atari life as an end (`episodic_life`) and `ended` only true ends."""
    obs: np.ndarray
    rewards: np.ndarray
    term: np.ndarray
    trunc: np.ndarray
    ended: np.ndarray
    done: np.ndarray             # term | trunc: where a slot's episode (or life) ended
    final_obs: Any               # indexable by slot where `ended`
    over: np.ndarray | None      # the copies whose game ended (an env of several agents)


class Stepper:
    """The one stepping loop's body: each group's seats act for its slots, `Slots.step` steps the env with
    every group's actions at once, and each group's slots move on (their observations, which act now, their
    action masks, a recurrent player's state at an end). The rollout records what it returns; evaluation
    tallies it.

    `seats`: each group's, by name (`Slots.names`). `masked`: whether a group's player takes action masks
    where the env reports them (the algorithm's `uses_masks`). `check_mask(name, mask, n)`: a reported
    mask as [n, M] bool, or an error naming the env. `episodic_life` (Atari): a lost life ends the
    slot's episode for learning (`Step.term`, and a recurrent state), while the game goes on."""

    def __init__(self, slots: Slots, seats: dict[str, Seats], masked: dict[str, bool],
                 check_mask: Callable[[str, Any, int], np.ndarray], seed: int | None, episodic_life: bool = False):
        self.slots, self.seats, self._check_mask = slots, seats, check_mask
        obs, info = slots.reset(seed=seed)
        self.obs = obs
        self.present: dict[str, np.ndarray | None] = {
            name: None if "present" not in info else np.asarray(info["present"][name], bool) for name in slots.names}
        masks = info.get("action_mask", {})
        self._masked = {name: masked[name] and name in masks for name in slots.names}
        self.mask: dict[str, np.ndarray | None] = {name: self._mask(name, masks) for name in slots.names}
        self._lives = np.asarray(info["lives"]) if episodic_life else None

    def _mask(self, name: str, masks: dict[str, Any]) -> np.ndarray | None:
        return self._check_mask(name, masks.get(name), self.slots.sizes[name]) if self._masked[name] else None

    def act(self, env_steps: int) -> dict[str, tuple[np.ndarray, dict[str, np.ndarray]]]:
        """Every group's actions for its slots now, and the extras its training policy recorded."""
        return {name: seats.act(self.obs[name], self.present[name], self.mask[name], env_steps)
                for name, seats in self.seats.items()}

    def step(self, actions: dict[str, np.ndarray]) -> dict[str, Step]:
        """Step the env with every group's actions; each group's `Step`."""
        obs, r, term, trunc, info = self.slots.step(actions)
        over, final, masks = info.get("episode_over"), info.get("final_obs", NONE), info.get("action_mask")
        out = {}
        for name, seats in self.seats.items():
            t = term[name]
            done = ended = t | trunc[name]
            if self._lives is not None:   # (Atari: one group, a slot per copy)
                lives = np.asarray(info["lives"])
                t = t | (~ended & (lives < self._lives))  # a life lost, the game continues
                done = t | trunc[name]
                self._lives = lives
            out[name] = Step(obs[name], r[name], t, trunc[name], ended, done, final.get(name), over)
            seats.stepped(r[name], done, over)
            self.obs[name] = obs[name]
            if self.present[name] is not None:
                self.present[name] = np.asarray(info["present"][name], bool)
            if self._masked[name]:
                self.mask[name] = self._mask(name, masks or NONE)
        return out


class Against(Seats):
    """A policy at one slot (`mine`) and `other` at the rest, as `kuberl eval --against` plays a game (one
    env copy of several agents). The policy acts for every slot in one call, so a recurrent state moves
    on as in training; `other`'s moves replace it where its agents act."""

    def __init__(self, learning: Learning, other: Player, mine: int = 0):
        super().__init__(learning)
        self.other, self.mine = other, mine

    def act(self, obs: np.ndarray, present: np.ndarray | None, mask: np.ndarray | None, env_steps: int
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        actions, extras = self.learning.act(obs, mask, env_steps)
        rows = np.ones(len(obs), bool) if present is None else present.copy()
        rows[self.mine] = False
        if rows.any():
            actions = actions.copy()
            actions[rows] = self.other.act(obs[rows], None if mask is None else mask[rows], env_steps)[0]
        return actions, extras
