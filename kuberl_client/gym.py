"""Train any gymnasium env with kuberl from another process or machine: `serve_gym_env`.

    import gymnasium as gym
    from kuberl_client.gym import serve_gym_env

    envs = gym.make_vec("CartPole-v1", num_envs=8, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    serve_gym_env(envs, "actor-host:50053", session_id="cartpole-sim-0")

The actor must run with env.mode: external and the same spaces. The env is stepped in this process;
the actor chooses the actions, collects the trajectories and reports the episodes.
"""

from __future__ import annotations

import logging
import threading
import time

import gymnasium as gym
import numpy as np

from kuberl_client.session import EnvSessionClient, SessionError

__all__ = ["as_vector_env", "serve_gym_env"]

log = logging.getLogger(__name__)
_SAME_STEP = gym.vector.AutoresetMode.SAME_STEP


def as_vector_env(env) -> gym.vector.VectorEnv:
    """A VectorEnv with same-step autoreset: `env` itself, or a plain Env wrapped as num_envs=1."""
    if isinstance(env, gym.vector.VectorEnv):
        mode = env.metadata.get("autoreset_mode")
        if mode not in (_SAME_STEP, _SAME_STEP.value):
            raise ValueError(f"the vector env resets with autoreset_mode {mode!r}; create it with "
                             f"vector_kwargs={{'autoreset_mode': gymnasium.vector.AutoresetMode.SAME_STEP}} "
                             f"(the protocol needs the reset observation and the final one in the same step)")
        return env
    if isinstance(env, gym.Env):
        return gym.vector.SyncVectorEnv([lambda: env], autoreset_mode=_SAME_STEP)
    raise TypeError(f"expected a gymnasium Env or VectorEnv, got {type(env).__name__}")


def _spaces(envs: gym.vector.VectorEnv) -> tuple[tuple[int, ...], np.dtype, int, int]:
    obs, act = envs.single_observation_space, envs.single_action_space
    if not isinstance(obs, gym.spaces.Box):
        raise ValueError(f"observation space {obs}: only Box observations are supported")
    if not isinstance(act, gym.spaces.Discrete):
        raise ValueError(f"action space {act}: only Discrete actions are supported")
    return tuple(obs.shape), np.dtype(obs.dtype), int(act.n), int(act.start)


def serve_gym_env(env, address: str, *, session_id: str, max_steps: int | None = None,
                  stop: threading.Event | None = None, seed: int | None = None, timeout_s: float = 30.0,
                  simulator: str | None = None, reconnect_s: float | None = 240.0,
                  max_reconnects: int = 3) -> dict:
    """Step `env` with the actor's actions until `max_steps` vector steps or `stop` is set.

    env: a gymnasium VectorEnv made with autoreset_mode SAME_STEP, or a plain Env (wrapped, num_envs=1).
    The env is not closed. Returns {"steps": vector steps, "env_steps": steps x num_envs,
    "episodes": finished episodes, "returns": their returns, "lengths": their lengths,
    "sessions": streams opened}.

    reconnect_s: open a fresh stream (same session_id, so the actor resumes the episodes) this often.
    kuberl servers close connections after a maximum age (300 s plus 30 s grace, services/common/
    grpcutil.py), which ends a stream with UNAVAILABLE; handing over before that, between steps and
    before the last actions are applied, loses nothing. None = never.
    max_reconnects: consecutive attempts to resume after the stream broke (UNAVAILABLE); the reward
    of the one step in flight when it broke is then not counted by the actor. Errors the actor sends
    (INVALID_ARGUMENT, ...) are raised as SessionError.
    """
    envs = as_vector_env(env)
    obs_shape, obs_dtype, n_actions, start = _spaces(envs)
    n = envs.num_envs
    spec_id = getattr(getattr(envs, "spec", None), "id", None) or type(envs).__name__

    def connect() -> EnvSessionClient:
        return EnvSessionClient(address, session_id=session_id, obs_shape=obs_shape, obs_dtype=obs_dtype,
                                num_actions=n_actions, num_envs=n, timeout_s=timeout_s,
                                simulator=simulator or f"gymnasium:{spec_id}"[:128])

    obs, _ = envs.reset(seed=seed)
    ep_ret, ep_len = np.zeros(n), np.zeros(n, dtype=np.int64)
    returns: list[float] = []
    lengths: list[int] = []
    steps = sessions = 0
    client: EnvSessionClient | None = None
    opened = 0.0

    def open_session(first_obs, retries: int) -> np.ndarray:
        """A new stream (resuming the session after the first); returns the actions for first_obs."""
        nonlocal client, sessions, opened
        for attempt in range(retries + 1):
            client = connect()
            sessions += 1
            try:
                actions = client.reset(first_obs)
                opened = time.monotonic()
                return actions
            except SessionError as e:
                client.cancel()
                if e.code != "UNAVAILABLE" or attempt == retries:
                    raise
                log.warning("session %s: %s; retrying (%d of %d)", session_id, e, attempt + 1, retries)
                time.sleep(min(2.0 ** attempt, 10.0))
        raise AssertionError("unreachable")

    try:
        actions = open_session(obs, 0)
        while (max_steps is None or steps < max_steps) and not (stop is not None and stop.is_set()):
            obs, rewards, terminated, truncated, info = envs.step(actions + start)
            steps += 1
            ep_ret += rewards
            ep_len += 1
            done = np.logical_or(terminated, truncated)
            final = None
            if done.any():
                idx = np.flatnonzero(done)
                final = np.stack([np.asarray(info["final_obs"][i]) for i in idx])
                returns.extend(float(r) for r in ep_ret[idx])
                lengths.extend(int(x) for x in ep_len[idx])
                ep_ret[idx], ep_len[idx] = 0.0, 0
            try:
                actions = client.step(obs, rewards, terminated, truncated, final)
            except SessionError as e:
                if e.code != "UNAVAILABLE" or max_reconnects <= 0:
                    raise
                log.warning("session %s broke (%s); resuming", session_id, e)
                client.cancel()
                actions = open_session(obs, max_reconnects)
                continue
            if reconnect_s is not None and time.monotonic() - opened >= reconnect_s:
                # Hand over before applying these actions: the actor drops them (and marks the last
                # transition truncated, bootstrapped); the new stream starts again at this obs.
                client.close()
                actions = open_session(obs, max_reconnects)
        client.close()
    except BaseException:
        if client is not None:
            client.cancel()
        raise
    return {"steps": steps, "env_steps": steps * n, "episodes": len(returns), "returns": returns,
            "lengths": lengths, "sessions": sessions}
