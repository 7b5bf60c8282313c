"""The actor's core: step a gymnasium vector env with the local policy and cut trajectory fragments.

No gRPC and no asyncio here. `Rollout.collect` runs in the actor's rollout thread (loops.py); the only
cross-thread inputs are `offer_weights` (a single-slot handoff, newest wins) and the stop flag.
Weights are swapped in between fragments, so every action of a fragment comes from the one
`policy_version` stamped on it. The policy itself (weights handoff, action selection) is policy.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services import algorithms
from services.common.config import is_atari
from services.config import ExperimentConfig
from services.common.protocol.fragments import EncodedFragment, encode_fragment
from services.actor.episodes import EpisodeLog
from services.actor.finite import Check, check_env_step
from services.actor.limiter import InsertGate
from services.actor.policy import Pace, Policy
from services.actor.seats import Learning, Seats, Slots, Step, Stepper
from services.actor.league import League
from services.actor.selfplay import SelfPlay
from services.actor.windows import window_groups
from services.common.agents import ParallelVectorEnv
from services.common.envs import EnvSpec, group_specs, make_vector_env, spec_of
from services.common.protocol.spaces import check_mask
from services.common.stats import Metrics


class Pacer:
    """Sleeps the calling thread to hold `rate` calls per second (0 = no limit); never bursts to catch up."""

    def __init__(self, rate: float):
        self.interval = 1.0 / rate if rate else 0.0
        self._next = time.monotonic()

    def step(self) -> None:
        if not self.interval:
            return
        now = time.monotonic()
        self._next = max(self._next + self.interval, now - self.interval)
        if self._next > now:
            time.sleep(self._next - now)


@dataclass
class Group:
    """One policy's share of the rollout: its slots (a vector env's copies, or a PettingZoo env's agents of
    the policy, services/actor/seats.py), their spaces, its weights and pacing, who sits in its slots
    (`seats`: the training policy in every one, or self-play's players), its buffer table's rate limiter,
    its own fragment seqs (each table dedupes its own) and its slots' running episodes."""
    name: str                    # the policy's (config `policies`; `default` where the config names none)
    tag: str                     # what its fragments and episodes carry: its name, or "" where the run has one
    spec: EnvSpec
    policy: Policy
    pace: Pace
    gate: InsertGate | None
    check: Check
    label: str                   # how a bad value from its slots is named
    seats: Seats
    slots: int
    seq: int = 0
    ep_return: np.ndarray = field(init=False)
    ep_len: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.ep_return, self.ep_len = np.zeros(self.slots), np.zeros(self.slots, np.int64)


@dataclass
class Window:
    """One policy's recorded steps of a window of T steps of its N slots, until they are cut into fragments."""
    obs: np.ndarray                    # [T + 1, N, *obs]
    actions: np.ndarray                # [T, N, *action]
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    present: np.ndarray | None         # [T, N] bool: the slots recorded at each step (None: every one)
    masks: np.ndarray | None
    extras: dict[str, np.ndarray]
    start: dict[str, np.ndarray]       # a recurrent policy's state at the window's start
    final_obs: list[np.ndarray] = field(default_factory=list)   # where a recorded slot's life ended...
    final_index: list[int] = field(default_factory=list)        # ... at u * N + n

    @classmethod
    def of(cls, g: Group, stepper: Stepper, T: int, steps: tuple[str, ...], start: tuple[str, ...]) -> Window:
        """An empty window of T steps of group g's slots, from their observations and recurrent state now."""
        N, spec, action = g.slots, g.spec, g.spec.action
        state = g.seats.learning.state
        w = cls(np.empty((T + 1, N, *spec.obs_shape), dtype=spec.obs_dtype),
                np.empty((T, N, *action.shape), dtype=action.dtype), np.empty((T, N), dtype=np.float32),
                np.empty((T, N), dtype=bool), np.empty((T, N), dtype=bool),
                np.empty((T, N), bool) if stepper.present[g.name] is not None else None,
                np.empty((T, N, action.mask_width), dtype=bool) if stepper.mask[g.name] is not None else None,
                {name: np.empty((T, N), dtype=np.float32) for name in steps},
                {} if state is None else {name: state.copy() for name in start})
        w.obs[0] = stepper.obs[g.name]
        return w


class Rollout:
    def __init__(self, cfg: ExperimentConfig, actor_id: str, actor_index: int, metrics: Metrics, incarnation: int = 0,
                 gates: Mapping[str, InsertGate] | None = None):
        """`gates`: each policy's buffer table's rate limiter (limiter.py), by policy name (none: never held)."""
        torch.set_num_threads(cfg.actor.torch_threads)
        self.cfg, self.actor_id, self.metrics, self.incarnation = cfg, actor_id, metrics, incarnation
        self.algorithm = algorithms.get(cfg.algorithm)
        names = cfg.policy_names
        # A PettingZoo env's agents go to the policies' groups by config `policies` (one group of all where
        # it names none, services/common/agents.py); a gymnasium env's copies are the one policy's slots.
        self.envs = make_vector_env(cfg.env, policies={k: v.agents for k, v in cfg.policies.items()} or None)
        grouped = isinstance(self.envs, ParallelVectorEnv) and self.envs.grouped
        specs = group_specs(self.envs) if grouped else {names[0]: spec_of(cfg.env)}
        slots = Slots(self.envs, names[0], {name: spec.action for name, spec in specs.items()})
        self.spec = specs[names[0]]   # (the first policy's)
        # Atari: fragments carry sign(r) (Mnih et al. 2015); episode returns are logged unclipped.
        self.clip_rewards = is_atari(cfg.env.id) and cfg.env.atari.clip_rewards
        seed = cfg.env.seed + 1000 * actor_index
        self._pending: deque[EncodedFragment] = deque()   # fragments cut with the last one, not yet handed on
        gates = gates or {}
        self.groups: list[Group] = []
        for k, (name, spec) in enumerate(specs.items()):
            policy = Policy(cfg, spec, seed + k, metrics, name=cfg.tag(name))
            space = self.envs.groups[k].observation_space if grouped else self.envs.single_observation_space
            self.groups.append(Group(
                name, cfg.tag(name), spec, policy, Pace(cfg, policy, metrics), gates.get(name),
                # NaN, infinity (and out of bounds, if asked) never reach a fragment or the policy (finite.py).
                Check.from_gymnasium(space, spec.obs_keys, cfg.actor.check_obs_bounds),
                f"{cfg.env.id} (policy {name}'s agents)" if grouped else cfg.env.id,
                Seats(Learning(policy, slots.sizes[name])), slots.sizes[name]))
        self.policies = {g.name: g.policy for g in self.groups}
        self.policy = self.groups[0].policy   # (the run's policy, where it has one)
        # Self-play: one learning agent per copy, the others played by snapshots (selfplay.py); with several
        # policies a league, each policy's side played by its newest weights or its own snapshots (league.py).
        self.selfplay: SelfPlay | League | None = None
        if cfg.selfplay.enabled:
            copies, rng = self.envs.num_envs // self.envs.slots, np.random.default_rng(seed + 1)
            if len(self.groups) > 1:   # sides are groups (a league), else slots of the one group
                self.selfplay = League(cfg, {g.name: (g.seats.learning, len(self.envs.groups[k].agents))
                                             for k, g in enumerate(self.groups)}, copies, metrics, rng)
                for g in self.groups:
                    g.seats = self.selfplay.seats[g.name]
            else:
                self.selfplay = SelfPlay(cfg, self.groups[0].seats.learning, copies, self.envs.slots, metrics, rng)
                self.groups[0].seats = self.selfplay
        # Action masks: an env that reports `info["action_mask"]` ([N, M] bool) is masked throughout, for
        # an algorithm that takes masks (the learner re-applies them from the fragment). Atari's episodic
        # life (EpisodicLifeEnv of SB3/CleanRL): a lost life is a terminal step for learning while the
        # game goes on; the episode log still records whole games.
        self.stepper = Stepper(slots, {g.name: g.seats for g in self.groups},
                               {name: self.algorithm.uses_masks(spec.action) for name, spec in specs.items()},
                               lambda name, mask, n: self._mask_of(mask, specs[name], n), seed,
                               episodic_life=is_atari(cfg.env.id) and cfg.env.atari.episodic_life)
        self.extras = self.algorithm.extras(cfg)
        self.env_steps = 0
        self.episodes = EpisodeLog(metrics)
        self._pace = Pacer(cfg.actor.max_env_steps_per_s / sum(g.slots for g in self.groups)
                           if cfg.actor.max_env_steps_per_s else 0.0)
        metrics.track_rate("actor/env_steps_per_s", "actor/env_steps_total")
        metrics.track_rate("actor/fragments_per_s", "actor/fragments_total")

    @property
    def policy_version(self) -> int | None:
        return self.policy.version

    @property
    def seq(self) -> int:
        """The next fragment's seq (the first policy's, where there are several)."""
        return self.groups[0].seq

    def collect(self, stop: threading.Event | None = None) -> EncodedFragment | None:
        """Step every env T times (fewer if `stop` is set meanwhile) and return the first fragment, serialized.

        Blocking; call from the worker thread. Returns None only if stopped before any step. Every policy
        acts for its slots (`Group.seats`) in one batched call per player, the env steps them all at once
        (`Stepper`), and each policy's recorded steps are cut apart into its fragments. Where agents were
        not there for the whole window (`split_runs`), or there are several policies, the fragments after
        the first are handed out by the next calls before any more stepping.
        """
        if self._pending:
            return self._pending.popleft()
        for g in self.groups:
            if g.gate is not None:
                g.gate.wait(stop)  # the buffer's rate limiter: hold while the learner is behind
        for g in self.groups:
            g.policy.swap()
            if self._wait_for_the_learner(g, stop):
                g.policy.swap()
            g.pace.rebase(g.seq)  # the weights this fragment is cut with count from here
            g.seats.swapped()
        T, stepper = self.cfg.rollout_steps, self.stepper
        windows = [Window.of(g, stepper, T, self.extras.steps, self.extras.start) for g in self.groups]
        if self.env_steps == 0:   # the first reset's observations
            for g in self.groups:
                check_env_step(g.label, g.check, self.metrics, stepper.obs[g.name])
        t = 0
        while t < T and not (stop is not None and stop.is_set()):
            for g, w in zip(self.groups, windows):
                if w.present is not None:   # (the steps recorded: with self-play, the learning agents' only)
                    w.present[t] = g.seats.recorded(stepper.present[g.name])
                if w.masks is not None:
                    w.masks[t] = stepper.mask[g.name]
            acted = stepper.act(self.env_steps)
            for g, w in zip(self.groups, windows):
                w.actions[t], recorded = acted[g.name]
                for name, arr in w.extras.items():
                    arr[t] = recorded.get(name, 0.0)   # (self-play: none where the policy played no slot)
            steps = stepper.step({name: a for name, (a, _) in acted.items()})
            stepped = 0
            for g, w in zip(self.groups, windows):
                stepped += self._record(g, w, t, steps[g.name])
            self._stepped(stepped)
            t += 1
        if t == 0:
            return None
        for g, w in zip(self.groups, windows):
            self._cut_window(g, w, t)
        return self._pending.popleft()

    def _record(self, g: Group, w: Window, t: int, s: Step) -> int:
        """Record step t of group g's slots in its window and move its episodes on; the agent steps recorded."""
        check_env_step(g.label, g.check, self.metrics, s.obs, s.rewards, {"final_obs": s.final_obs}, s.ended)
        recorded, done = None if w.present is None else w.present[t], s.done   # (done: a lost life too)
        w.terminated[t], w.truncated[t] = s.term, s.trunc
        w.rewards[t] = np.sign(s.rewards) if self.clip_rewards else s.rewards
        g.ep_return += s.rewards
        g.ep_len += 1 if recorded is None else recorded
        if recorded is not None:   # a slot not recorded (an opponent's) ends unrecorded
            gone = s.ended & ~recorded
            g.ep_return[gone], g.ep_len[gone] = 0.0, 0
        for i in np.flatnonzero(done if recorded is None else done & recorded):
            # After a lost life the next observation is the true one (nothing was reset).
            w.final_obs.append(s.final_obs[i] if s.ended[i] else s.obs[i])
            w.final_index.append(t * g.slots + int(i))
            if s.ended[i]:
                self.episodes.finish(g.ep_return[i], g.ep_len[i], self.env_steps, g.policy.version, policy=g.tag)
                g.ep_return[i], g.ep_len[i] = 0.0, 0
        w.obs[t + 1] = s.obs
        return g.slots if recorded is None else int(recorded.sum())

    def _stepped(self, agent_steps: int) -> None:
        """A step of every env copy is done: count the agent steps recorded, and keep the pace."""
        self.env_steps += agent_steps
        self.metrics.inc("actor/env_steps_total", agent_steps)
        self._pace.step()

    def _cut_window(self, g: Group, w: Window, t: int) -> None:
        """Cut a policy's window of t steps into fragments: its slots' runs of steps (`window_groups`),
        each with the final observations of its lives that ended."""
        for a, b, cols, picked in window_groups(None if w.present is None else w.present[:t], t, w.rewards.shape[1],
                                                w.final_index):
            self._cut(g, encode_fragment(
                actor_id=self.actor_id, incarnation=self.incarnation, seq=g.seq,
                policy_version=g.policy.version or 0, algorithm=self.algorithm.code, env_ids=cols.tolist(),
                obs=w.obs[a:b + 1, cols], actions=w.actions[a:b, cols], rewards=w.rewards[a:b, cols],
                terminated=w.terminated[a:b, cols], truncated=w.truncated[a:b, cols],
                final_obs=(np.stack([w.final_obs[k] for k, _ in picked]) if picked
                           else np.empty((0, *g.spec.obs_shape), g.spec.obs_dtype)),
                final_index=np.asarray([i for _, i in picked], dtype=np.int64),
                action_mask=None if w.masks is None else w.masks[a:b, cols],
                extras={**{name: arr[a:b, cols] for name, arr in w.extras.items()},
                        # (a run that starts after the first step is an agent's new life: a fresh state)
                        **{name: arr[cols] if a == 0 else np.zeros_like(arr[cols]) for name, arr in w.start.items()}},
                release_gil=True))   # this thread copies the payload beside the event loop: without the GIL

    def take_pending(self) -> list[EncodedFragment]:
        """The fragments already cut that `collect` has not handed out yet (several agents per env)."""
        out = list(self._pending)
        self._pending.clear()
        return out

    def _cut(self, g: Group, msg: EncodedFragment) -> None:
        if g.gate is not None:
            g.gate.cut(g.seq, msg.samples)
        g.seq += 1
        self.metrics.inc("actor/fragments_total")
        self._pending.append(msg if not g.tag else dataclasses.replace(msg, policy=g.tag))

    def _wait_for_the_learner(self, g: Group, stop: threading.Event | None) -> bool:
        """On-policy pacing (`Pace`): hold this thread for a policy's newer weights once its quota is cut;
        True if it waited."""
        if not g.pace.due(g.seq):
            return False
        start = last = time.monotonic()
        while not g.policy.newer_weights.wait(timeout=0.1):
            now = time.monotonic()
            g.pace.held(now - last)
            last = now
            if (stop is not None and stop.is_set()) or now - start >= g.pace.timeout_s:
                break
        g.pace.held(time.monotonic() - last)
        g.pace.waited(g.seq, stopped=stop is not None and stop.is_set())
        return True

    def _mask_of(self, mask: Any, spec: EnvSpec, n: int) -> np.ndarray:
        """An env's `info["action_mask"]` (of n slots) as [n, M] bool; ValueError naming env.id if malformed."""
        mask = np.asarray(mask, dtype=bool)  # 0/1 masks as well as bool
        try:
            check_mask(spec.action, mask, (n,))
        except ValueError as err:
            raise ValueError(f"env.id: {self.cfg.env.id} reports a bad info['action_mask']: {err}") from None
        return mask

    def close(self) -> None:
        self.envs.close()
