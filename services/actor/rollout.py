"""The actor's core: step a gymnasium vector env with the local policy and cut trajectory fragments.

No gRPC and no asyncio here. `Rollout.collect` runs in the actor's worker thread; the only
cross-thread inputs are `offer_weights` (a single-slot handoff, newest wins) and the stop flag.
Weights are swapped in between fragments, so every action of a fragment comes from the one
`policy_version` stamped on it. The policy itself (weights handoff, action selection) is policy.py.
"""

from __future__ import annotations

import dataclasses
import logging
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
from services.actor.selfplay import SelfPlay
from services.actor.windows import window_groups
from services.common.envs import EnvSpec, group_specs, make_vector_env, spec_of
from services.common.protocol.spaces import Box, check_mask
from services.common.stats import Metrics

log = logging.getLogger(__name__)


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
    """One policy's share of the rollout: its agents' slots (a run of several policies: the vector env's
    group of that name, services/common/agents.py), their spaces, its weights and pacing, its buffer
    table's rate limiter and its own fragment seqs (each table dedupes its own)."""
    name: str                    # the policy's ("" where the run has one)
    spec: EnvSpec
    policy: Policy
    pace: Pace
    gate: InsertGate | None
    check: Check
    slots: int
    mask: np.ndarray | None = None   # its slots' action masks now, where it takes them
    seq: int = 0
    ep_return: np.ndarray = field(init=False)   # (a run of several policies: its slots' running episodes)
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
    def empty(cls, T: int, N: int, spec: EnvSpec, masked: bool, steps: tuple[str, ...], has_present: bool,
              start: dict[str, np.ndarray] | None = None) -> Window:
        action = spec.action
        return cls(np.empty((T + 1, N, *spec.obs_shape), dtype=spec.obs_dtype),
                   np.empty((T, N, *action.shape), dtype=action.dtype), np.empty((T, N), dtype=np.float32),
                   np.empty((T, N), dtype=bool), np.empty((T, N), dtype=bool),
                   np.empty((T, N), bool) if has_present else None,
                   np.empty((T, N, action.mask_width), dtype=bool) if masked else None,
                   {name: np.empty((T, N), dtype=np.float32) for name in steps}, start or {})


class Rollout:
    def __init__(self, cfg: ExperimentConfig, actor_id: str, actor_index: int, metrics: Metrics, incarnation: int = 0,
                 gate: InsertGate | Mapping[str, InsertGate] | None = None):
        """`gate`: the buffer's rate limiter (limiter.py; None: never held by it); with several policies
        (config `policies`), each policy's table's, by policy name."""
        torch.set_num_threads(cfg.actor.torch_threads)
        self.cfg, self.actor_id, self.metrics, self.incarnation = cfg, actor_id, metrics, incarnation
        self.algorithm = algorithms.get(cfg.algorithm)
        several = cfg.several_policies
        # Several policies: the env's agents in a group per policy, observed and stepped per group.
        self.envs = make_vector_env(cfg.env, policies={k: v.agents for k, v in cfg.policies.items()}
                                    if several else None)
        n = self.envs.num_envs   # env copies, or agent slots for a PettingZoo env (services/common/agents.py)
        specs = group_specs(self.envs) if several else {"": spec_of(cfg.env)}
        self.spec = next(iter(specs.values()))   # (the run's, where it has one policy)
        # Atari: fragments carry sign(r) (Mnih et al. 2015); episode returns are logged unclipped.
        self.clip_rewards = is_atari(cfg.env.id) and cfg.env.atari.clip_rewards
        # Atari episodic life (EpisodicLifeEnv of SB3/CleanRL): a lost life is a terminal step for
        # learning while the game goes on; the episode log still records whole games.
        self.episodic_life = is_atari(cfg.env.id) and cfg.env.atari.episodic_life
        seed = cfg.env.seed + 1000 * actor_index
        self.obs, info = self.envs.reset(seed=seed)
        # Several agents per env: which slots act now (the others are recorded nowhere); None: every env acts.
        self.present = (None if "present" not in info else info["present"] if several
                        else np.asarray(info["present"], bool))
        self._pending: deque[EncodedFragment] = deque()   # fragments cut with the last one, not yet handed on
        # Action masks: an env that reports `info["action_mask"]` ([N, M] bool) is masked throughout,
        # for an algorithm that takes masks (the learner re-applies them from the fragment).
        self.masked = "action_mask" in info and not several and self.algorithm.uses_masks(self.spec.action)
        self.mask = self._mask_of(info["action_mask"], self.spec, n) if self.masked else None
        self._lives = np.asarray(info["lives"]) if self.episodic_life else None
        # Each policy's share (one policy: every slot): its spaces, weights, pacing and rate limiter.
        gates = gate if isinstance(gate, Mapping) else {"": gate}
        self.groups = []
        for k, (name, spec) in enumerate(specs.items()):
            policy = Policy(cfg, spec, seed + k, metrics, name=name)
            space = self.envs.groups[k].observation_space if several else self.envs.single_observation_space
            masks = info.get("action_mask", {}) if several else {}
            self.groups.append(Group(
                name, spec, policy, Pace(cfg, policy, metrics), gates.get(name),
                # NaN, infinity (and out of bounds, if asked) never reach a fragment or the policy (finite.py).
                Check.from_gymnasium(space, spec.obs_keys, cfg.actor.check_obs_bounds),
                len(self.obs[name]) if several else n,
                mask=self._mask_of(masks[name], spec, len(self.obs[name]))
                if name in masks and self.algorithm.uses_masks(spec.action) else None))
        self.policies = {g.name: g.policy for g in self.groups}
        self.policy = self.groups[0].policy   # (the run's policy, where it has one)
        # Self-play: one learning agent per copy, the others played by snapshots (selfplay.py).
        self.selfplay = (SelfPlay(cfg, self.policy, self.envs.num_envs // self.envs.slots, self.envs.slots, metrics,
                                  np.random.default_rng(seed + 1)) if cfg.selfplay.enabled else None)
        self.extras = self.algorithm.extras(cfg)
        # A recurrent policy's state per env (zeroed where an episode starts); None: feed-forward.
        self.state = self.policy.initial_state(n)
        self._check = self.groups[0].check
        self.env_steps = 0
        self.episodes = EpisodeLog(metrics)
        self._ep_return = np.zeros(n)
        self._ep_len = np.zeros(n, dtype=np.int64)
        self._pace = Pacer(cfg.actor.max_env_steps_per_s / n if cfg.actor.max_env_steps_per_s else 0.0)
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
        """Step every env T times (fewer if `stop` is set meanwhile) and return the fragment, serialized.

        Blocking; call from the worker thread. Returns None only if stopped before any step.
        With several agents per env, the agents that were not there for the whole of it make fragments of
        their own (`split_runs`), handed out by the next calls before any more stepping.
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
        if self.selfplay is not None:
            self.selfplay.swapped()
        if len(self.groups) > 1:
            return self._collect_groups(stop)
        T, N = self.cfg.rollout_steps, self.envs.num_envs
        space = self.spec.action
        w = Window.empty(T, N, self.spec, self.masked, self.extras.steps, self.present is not None,
                         {} if self.state is None else {name: self.state.copy() for name in self.extras.start})
        present = w.present
        w.obs[0] = self.obs
        t = 0
        while t < T and not (stop is not None and stop.is_set()):
            if t == 0 and self.env_steps == 0:  # the first reset's observations
                check_env_step(self.cfg.env.id, self._check, self.metrics, self.obs)
            if present is not None:   # (the steps recorded: with self-play, the learning agents' only)
                present[t] = self.present if self.selfplay is None else self.present & self.selfplay.recorded()
            if self.selfplay is None:
                a, recorded, state = self.policy.act(self.obs, self.env_steps, self.mask, self.state)
            else:   # (the training policy acts only for the slots it plays; a self-play policy is feed-forward)
                (a, recorded), state = self.selfplay.act(self.policy, self.obs, self.present, self.mask,
                                                         self.env_steps), None
            obs, r, term, trunc, info = self.envs.step(space.clip(a) if isinstance(space, Box) else a)
            check_env_step(self.cfg.env.id, self._check, self.metrics, obs, r, info, term | trunc)
            if self.selfplay is not None:
                self.selfplay.stepped(r, info.get("episode_over"))
            if w.masks is not None:
                w.masks[t] = self.mask
                self.mask = self._mask_of(info.get("action_mask"), self.spec, N)
            ended = term | trunc
            if self.episodic_life:
                lives = np.asarray(info["lives"])
                term = term | (~ended & (lives < self._lives))  # a life lost, the game continues
                self._lives = lives
            w.actions[t], w.terminated[t], w.truncated[t] = a, term, trunc
            w.rewards[t] = np.sign(r) if self.clip_rewards else r
            for name, arr in w.extras.items():
                arr[t] = recorded.get(name, 0.0)   # (self-play: none where the policy played no slot)
            if state is not None:   # the next step starts an episode where this one ended (a lost life too)
                state[term | trunc] = 0.0
                self.state = state
            self._ep_return += r
            self._ep_len += 1 if present is None else present[t]
            if present is not None:   # a slot not recorded (an opponent's) ends unrecorded
                gone = (term | trunc) & ~present[t]
                self._ep_return[gone], self._ep_len[gone] = 0.0, 0
            for i in np.flatnonzero((term | trunc) if present is None else (term | trunc) & present[t]):
                # After a lost life the next observation is the true one (nothing was reset).
                w.final_obs.append(info["final_obs"][i] if ended[i] else obs[i])
                w.final_index.append(t * N + i)
                if ended[i]:
                    self._finish_episode(i)
            w.obs[t + 1] = obs
            self.obs = obs
            stepped = N if present is None else int(present[t].sum())
            if present is not None:
                self.present = np.asarray(info["present"], bool)
            t += 1
            self._stepped(stepped)
        return self._cut_windows(t, [(self.groups[0], w)])

    def _collect_groups(self, stop: threading.Event | None) -> EncodedFragment | None:
        """`collect` for a run of several policies: every policy acts for its agents' slots in one batched
        call, the env steps them all at once, and each policy's steps are recorded and cut apart (a
        feed-forward policy, no self-play, no Atari: the config refuses the rest)."""
        T = self.cfg.rollout_steps
        # (a bad value names the policy whose slots it is in: the index it gives is within them)
        labels = {g.name: f"{self.cfg.env.id} (policy {g.name}'s agents)" for g in self.groups}
        windows = {g.name: Window.empty(T, g.slots, g.spec, g.mask is not None, self.extras.steps, True)
                   for g in self.groups}
        for g in self.groups:
            windows[g.name].obs[0] = self.obs[g.name]
        t = 0
        while t < T and not (stop is not None and stop.is_set()):
            actions = {}
            for g in self.groups:
                w, obs = windows[g.name], self.obs[g.name]
                if t == 0 and self.env_steps == 0:  # the first reset's observations
                    check_env_step(labels[g.name], g.check, self.metrics, obs)
                w.present[t] = self.present[g.name]
                a, recorded, _ = g.policy.act(obs, self.env_steps, g.mask)
                actions[g.name] = g.spec.action.clip(a) if isinstance(g.spec.action, Box) else a
                w.actions[t] = a
                for name, arr in w.extras.items():
                    arr[t] = recorded.get(name, 0.0)
                if w.masks is not None:
                    w.masks[t] = g.mask
            obs_all, r_all, term_all, trunc_all, info = self.envs.step(actions)
            stepped = 0
            for g in self.groups:
                w = windows[g.name]
                obs, r, term, trunc = obs_all[g.name], r_all[g.name], term_all[g.name], trunc_all[g.name]
                ended = term | trunc
                final = info["final_obs"][g.name]
                check_env_step(labels[g.name], g.check, self.metrics, obs, r, {"final_obs": final}, ended)
                if g.mask is not None:
                    g.mask = self._mask_of(info["action_mask"][g.name], g.spec, g.slots)
                w.rewards[t], w.terminated[t], w.truncated[t] = r, term, trunc
                g.ep_return += r
                g.ep_len += w.present[t]
                for i in np.flatnonzero(ended & w.present[t]):
                    w.final_obs.append(final[i])
                    w.final_index.append(t * g.slots + i)
                    self.episodes.finish(g.ep_return[i], g.ep_len[i], self.env_steps, g.policy.version, policy=g.name)
                    g.ep_return[i], g.ep_len[i] = 0.0, 0
                w.obs[t + 1] = obs
                stepped += int(w.present[t].sum())
            self.obs, self.present = obs_all, info["present"]
            t += 1
            self._stepped(stepped)
        return self._cut_windows(t, [(g, windows[g.name]) for g in self.groups])

    def _stepped(self, agent_steps: int) -> None:
        """A step of every env copy is done: count the agent steps recorded, and keep the pace."""
        self.env_steps += agent_steps
        self.metrics.inc("actor/env_steps_total", agent_steps)
        self._pace.step()

    def _cut_windows(self, t: int, windows: list[tuple[Group, Window]]) -> EncodedFragment | None:
        """Cut each policy's window of t steps into its fragments; the first of them (None: no step)."""
        if t == 0:
            return None
        for g, w in windows:
            self._cut_window(g, w, t)
        return self._pending.popleft()

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
        self._pending.append(msg if not g.name else dataclasses.replace(msg, policy=g.name))

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

    def _finish_episode(self, i: int) -> None:
        self.episodes.finish(self._ep_return[i], self._ep_len[i], self.env_steps, self.policy.version)
        self._ep_return[i] = 0.0
        self._ep_len[i] = 0

    def close(self) -> None:
        self.envs.close()


class RolloutWorker(threading.Thread):
    """Runs `Rollout.collect` in a loop, handing every fragment to `on_fragment` (thread-safe).

    Waits once, at start, for the learner's first weights; after that it never waits on the network,
    except where the buffer's rate limiter holds it before a fragment (limiter.py), or on-policy
    pacing (actor.fragments_per_version) holds it for the next weights.
    `done` (a callable) receives None on a clean stop or the exception that ended the thread.
    """

    def __init__(self, rollout: Rollout, on_fragment, done):
        super().__init__(name="rollout", daemon=True)
        self.rollout, self.on_fragment, self.done = rollout, on_fragment, done
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            waited = 0.0
            while not all(p.have_weights.wait(timeout=0.5 / len(self.rollout.policies))
                          for p in self.rollout.policies.values()):
                if self.stop_event.is_set():
                    self.done(None)
                    return
                waited += 0.5
                if waited % 10 == 0:
                    log.info("waiting for the learner's first weights (%.0f s)", waited)
            while not self.stop_event.is_set():
                msg = self.rollout.collect(self.stop_event)
                if msg is not None:
                    self.on_fragment(msg)
            for msg in self.rollout.take_pending():   # cut with the last one: sent like it, never lost
                self.on_fragment(msg)
        except BaseException as exc:  # handed to the event loop, which ends the process loudly
            self.done(exc)
            return
        self.done(None)
