"""The actor's copy of the policy: a newest-wins weights handoff and batched action selection.

Shared by local envs (rollout.py) and external simulator sessions (sessions.py). `offer_weights`
may be called from any thread; `swap` and `act` run on the one thread that does inference, so a
version is swapped in only between two `act` calls. A `greedy` policy (`kuberl serve`'s default)
acts deterministically instead of exploring: it serves a trained policy, it does not collect data.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from services import algorithms
from services.config import ExperimentConfig
from services.common.models.nets import EnvSpec, load_numpy
from services.common.stats import Metrics

log = logging.getLogger(__name__)


class Policy:
    def __init__(self, cfg: ExperimentConfig, spec: EnvSpec, seed: int, metrics: Metrics, greedy: bool = False,
                 name: str = ""):
        torch.manual_seed(seed)
        self.cfg, self.spec, self.metrics = cfg, spec, metrics
        self.name = name   # of several policies in a run: its version is also `actor/policies/<name>/policy_version`
        self.rng = np.random.default_rng(seed)
        # The algorithm's acting part: its network and how it picks actions (and what it records).
        self.acting = algorithms.get(cfg.algorithm).acting(cfg, spec, self.rng, metrics)
        self.net = self.acting.net
        self.net.eval()
        # Floats of recurrent state per env (ppo.recurrent); 0 for a feed-forward policy.
        self.state_size = int(getattr(self.acting, "state_size", 0))
        # `Acting.greedy` shares `net`, so the weights swapped into `net` are the ones it acts with.
        self.greedy = self.acting.greedy().eval() if greedy else None
        self._deterministic = self.greedy   # (the greedy net, made where first asked for: `act(greedy=True)`)
        self.version: int | None = None  # None until the learner's first weights arrive
        self.have_weights = threading.Event()
        self.newer_weights = threading.Event()  # set while weights newer than `version` wait for `swap`
        self._pending: tuple[int, dict] | None = None
        self._handoff = threading.Lock()   # offer (any thread) against swap's take-and-clear

    def offer_weights(self, version: int, arrays: dict[str, np.ndarray]) -> None:
        """Hand over new weights (any thread); loaded at the next `swap`. Newest offer wins."""
        with self._handoff:
            self._pending = (version, arrays)
        self.have_weights.set()
        self.newer_weights.set()

    def swap(self) -> None:
        """Load the newest offered weights, if any (inference thread only)."""
        self.newer_weights.clear()  # (before taking: an offer racing this swap sets it again)
        with self._handoff:   # without it, an offer landing between the read and the clear was lost
            pending, self._pending = self._pending, None
        if pending is not None:
            version, arrays = pending
            load_numpy(self.net, arrays)
            self.version = version
            self.metrics.set("actor/policy_version", version)
            if self.name:
                self.metrics.set(f"actor/policies/{self.name}/policy_version", version)
            self.metrics.inc("actor/weights_swapped_total")

    def initial_state(self, n: int) -> np.ndarray | None:
        """The state of `n` envs at an episode's start (zeros [n, state_size]); None when stateless."""
        return np.zeros((n, self.state_size), np.float32) if self.state_size else None

    @torch.inference_mode()
    def act(self, obs: np.ndarray, env_steps: int = 0, mask: np.ndarray | None = None, state: np.ndarray | None = None,
            greedy: bool | None = None) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        """Actions for a batch of observations, the per-step extras the algorithm records with
        them (`Algorithm.extras`, e.g. PPO's behaviour log-probs), and for a recurrent policy each
        env's state after the step. `env_steps`: this actor's so far (DQN anneals exploration by it).
        `mask` [N, M] bool: the allowed actions, for an algorithm that `takes_action_masks`. `state`
        [N, state_size]: each env's state before `obs` (a recurrent policy needs it; the caller
        zeroes an env's row where its episode starts). Actions are in the space's layout; a Box
        action is the unclipped sample (the caller clips what it sends to the env). A `greedy`
        policy returns the most likely actions (Box: within bounds) and no extras; so does any policy
        asked for them (`greedy` True; None: as it was made)."""
        x = torch.from_numpy(np.ascontiguousarray(obs))
        m = None if mask is None else torch.from_numpy(np.ascontiguousarray(mask))
        if self.state_size and state is None:
            raise ValueError("a recurrent policy (ppo.recurrent) acts from each env's state: pass state")
        if (self.greedy is not None) if greedy is None else greedy:
            if self._deterministic is None:   # (`Acting.greedy` shares `net`, and so the weights swapped in)
                self._deterministic = self.acting.greedy().eval()
            net = self._deterministic
            if self.state_size:
                actions, after = net(x, torch.from_numpy(np.ascontiguousarray(state)), m)
                return actions.numpy(), {}, after.numpy()
            actions = net(x) if m is None else net(x, m)
            return actions.numpy(), {}, None
        if self.state_size:
            return self.acting.act(x, self.version, env_steps, mask=m, state=np.ascontiguousarray(state))
        out = self.acting.act(x, self.version, env_steps) if m is None else self.acting.act(x, self.version, env_steps, mask=m)
        return out[0], out[1], None


class Pace:
    """On-policy pacing (actor.fragments_per_version): after that many fragments cut with one policy
    version, the actor waits for newer weights, at most actor.pace_timeout_s (then a fresh quota,
    counted). The quota is counted from the fragment counter `cut` (a rollout's or a session hub's
    seq) where the held version came in; the caller waits (a thread or the event loop) and reports."""

    def __init__(self, cfg: ExperimentConfig, policy: Policy, metrics: Metrics):
        self.quota, self.timeout_s = cfg.actor.fragments_per_version, cfg.actor.pace_timeout_s
        self.policy, self.metrics = policy, metrics
        self._from: tuple[int | None, int] = (None, 0)  # (policy version, `cut` when it came in)
        for name in ("actor/pace_wait_seconds_total", "actor/pace_timeouts_total"):
            metrics.inc(name, 0)

    def rebase(self, cut: int) -> tuple[int | None, int]:
        """Start the quota of weights swapped in since the last call at `cut` (fragments so far). The
        caller calls it right after every `Policy.swap`, before cutting with them: a version noticed
        only at the next `due` would get the fragment cut in between for free (one fragment per
        version too many, which the FIFO then evicts)."""
        if self._from[0] != self.policy.version:
            self._from = self.policy.version, cut
        return self._from

    def due(self, cut: int) -> bool:
        """Whether the caller must wait for newer weights before cutting more (`cut`: fragments so far)."""
        if not self.quota:
            return False
        _, since = self.rebase(cut)
        return cut - since >= self.quota and not self.policy.newer_weights.is_set()

    def held(self, seconds: float) -> None:
        """Count `seconds` more of a wait while it goes on. The planner reads the counter at any time and
        measures an actor over the time it was not held: a wait counted only once it ended would read
        as production at rate 0 until then (services/planner/observe.py)."""
        self.metrics.inc("actor/pace_wait_seconds_total", seconds)

    def waited(self, cut: int, stopped: bool = False) -> None:
        """A wait ended (its seconds already `held`); where it ran out without newer weights, count it
        and start a fresh quota."""
        if self.policy.newer_weights.is_set() or stopped:
            return
        version, since = self._from
        self.metrics.inc("actor/pace_timeouts_total")
        self._from = (version, cut)
        log.warning("no new weights within actor.pace_timeout_s (%g s) after %d fragments with version %s; "
                    "going on", self.timeout_s, cut - since, version)
