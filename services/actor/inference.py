"""Batched inference for external sessions: every pending step of every session in one forward pass.

Sessions call `act(obs, mask)` and await their slice of the batch. The loop takes whatever is pending when
it comes round (no artificial delay), so the batch grows with load and latency stays one forward
pass when idle. Torch runs in a worker thread; weights are swapped in only between batches. Replies
are held, all of them, while the buffer's rate limiter says the learner is behind (limiter.py) or
on-policy pacing waits for new weights: the simulators then wait on their replies. A hub that records
nothing (`kuberl serve`) cuts no fragments and has no gate, so neither ever holds its replies.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from services.actor.limiter import InsertGate
from services.actor.policy import Pace, Policy
from services.actor.sessions import SessionHub
from services.common.stats import Metrics


class BatchedInference:
    def __init__(self, policy: Policy, hub: SessionHub, metrics: Metrics, gate: InsertGate | None = None):
        self.policy, self.hub, self.metrics, self.gate = policy, hub, metrics, gate
        self._pending: list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self.pace = Pace(hub.cfg, policy, metrics)

    async def act(self, obs: np.ndarray, mask: np.ndarray | None = None, state: np.ndarray | None = None
                  ) -> tuple[np.ndarray, dict[str, np.ndarray], int, np.ndarray | None]:
        """Actions for one session's observations (within `mask` [N, M] bool where given), the
        per-step extras the algorithm records with them (`Policy.act`), the policy version used, and
        for a recurrent policy its envs' state after the step (`state`: theirs before it). No rows (a
        step on which no agent acts, EnvStep.no_agents): answered at once, with the weights in use,
        outside any batch (nothing to choose, and nothing to hold: no fragment grows)."""
        if not len(obs):
            space = self.policy.spec.action
            return np.empty((0, *space.shape), space.dtype), {}, self.policy.version or 0, state
        future = asyncio.get_running_loop().create_future()
        self._pending.append((obs, mask, state, future))
        self._wake.set()
        return await future

    async def run(self) -> None:
        """Serve batches until cancelled (the actor's "inference" task)."""
        while not self.policy.have_weights.is_set():  # start-up only: the learner's first weights
            await asyncio.sleep(0.05)
        while True:
            await self._wake.wait()
            await self._hold()
            await self._pace()
            self._wake.clear()
            batch, self._pending = self._pending, []
            batch = [item for item in batch if not item[3].done()]  # a session that went away
            if not batch:
                continue
            obs = np.concatenate([o for o, _, _, _ in batch])
            mask = None
            if any(m is not None for _, m, _, _ in batch):  # sessions without masks allow every action
                mask = np.concatenate([np.ones((len(o), self.policy.spec.action.mask_width), bool) if m is None
                                       else m for o, m, _, _ in batch])
            state = np.concatenate([s for _, _, s, _ in batch]) if self.policy.state_size else None
            actions, extras, version, after = await asyncio.to_thread(self._infer, obs, mask, state)
            self.metrics.rolling("actor/inference_batch_envs").add(len(actions))
            start = 0
            for obs, _, _, fut in batch:
                end = start + len(obs)
                if not fut.done():
                    fut.set_result((actions[start:end], {k: v[start:end] for k, v in extras.items()}, version,
                                    None if after is None else after[start:end].copy()))
                start = end

    async def _hold(self) -> None:
        """The buffer's rate limiter: hold every reply while there is no room (polled: the gate is
        fed on this loop, so a short sleep lets its updates in). Counted per session too."""
        if self.gate is None or self.gate.room():
            return
        self.metrics.inc("actor/limiter_waits_total")
        held = list(self.hub.sessions.values())  # the sessions whose replies wait
        start = last = time.monotonic()
        while not self.gate.room() and not self.hub.closing:
            await asyncio.sleep(0.002)
            last = self.gate.held_since(last)
        self.hub.held(held, last - start)

    async def _pace(self) -> None:
        """On-policy pacing (`Pace`): once the sessions together have cut the quota of fragments with
        the weights held, hold every reply for newer weights. The simulators wait on their replies."""
        if not self.pace.due(self.hub.seq):
            return
        held = list(self.hub.sessions.values())
        loop = asyncio.get_running_loop()
        start = last = loop.time()
        while not self.policy.newer_weights.is_set() and last - start < self.pace.timeout_s:
            await asyncio.sleep(0.01)
            now = loop.time()
            self.pace.held(now - last)
            last = now
        self.hub.held(held, last - start)
        self.pace.waited(self.hub.seq)

    def _infer(self, obs: np.ndarray, mask: np.ndarray | None, state: np.ndarray | None):
        self.policy.swap()
        self.pace.rebase(self.hub.seq)
        actions, extras, after = self.policy.act(obs, self.hub.env_steps, mask, state)
        return actions, extras, self.policy.version, after
