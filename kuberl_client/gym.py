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

from kuberl_client.session import Discrete, EnvSessionClient, SessionError
from services.common.protocol.spaces import from_gymnasium, observation_space

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


def _spaces(envs: gym.vector.VectorEnv) -> tuple[dict, int]:
    """The client's space arguments for `envs`, and the offset of a Discrete space's first action."""
    obs, act = envs.single_observation_space, envs.single_action_space
    if isinstance(obs, gym.spaces.Dict):
        if not all(isinstance(sub, gym.spaces.Box) for sub in obs.spaces.values()):
            raise ValueError(f"observation space {obs}: a Dict observation must hold only Box spaces")
        kw = {"obs_keys": {k: sub.shape for k, sub in obs.spaces.items()}}
    elif isinstance(obs, gym.spaces.Box):
        kw = {"obs_shape": tuple(obs.shape), "obs_dtype": np.dtype(obs.dtype)}
    elif isinstance(obs, (gym.spaces.Discrete, gym.spaces.MultiDiscrete)):
        kw = {"obs_space": observation_space(obs)}   # ValueError for a start other than 0
    else:
        raise ValueError(f"observation space {obs}: only Box, Discrete, MultiDiscrete and Dict-of-Box "
                         f"observations are supported")
    start = int(act.start) if isinstance(act, gym.spaces.Discrete) else 0
    if isinstance(act, gym.spaces.Discrete):
        kw["action_space"] = Discrete(int(act.n))
    else:
        kw["action_space"] = from_gymnasium(act)  # ValueError naming what is not supported
    return kw, start


def _masks(info: dict):
    """The envs' `info["action_mask"]` ([num_envs, M], as the actor's local rollouts read it), or None."""
    return None if "action_mask" not in info else np.asarray(info["action_mask"])


def _stack(rows: list):
    """Per-env final observations as one batch: an array, or {key: array} for a Dict space."""
    if isinstance(rows[0], dict):
        return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}
    return np.stack([np.asarray(r) for r in rows])


def serve_gym_env(env, address: str, *, session_id: str, max_steps: int | None = None,
                  stop: threading.Event | None = None, seed: int | None = None, timeout_s: float = 30.0,
                  simulator: str | None = None, reconnect_s: float | None = 240.0,
                  max_reconnects: int = 3, ca_file: str | None = None, cert_file: str | None = None,
                  key_file: str | None = None, server_name: str | None = None, tls: bool | None = None,
                  token: str | None = None, token_file: str | None = None) -> dict:
    """Step `env` with the actor's actions until `max_steps` vector steps or `stop` is set.

    env: a gymnasium VectorEnv made with autoreset_mode SAME_STEP, or a plain Env (wrapped, num_envs=1).
    Its spaces: Box, Discrete, MultiDiscrete or Dict-of-Box observations; Discrete, MultiDiscrete or
    Box actions. An env that reports `info["action_mask"]` has its masks sent with every step.
    The env is not closed. Returns {"steps": vector steps, "env_steps": steps x num_envs,
    "episodes": finished episodes, "returns": their returns, "lengths": their lengths,
    "sessions": streams opened, "held_s": seconds the actor held its replies while the learner was
    behind (the rate limiter)}.

    reconnect_s: open a fresh stream (same session_id, so the actor resumes the episodes) this often.
    kuberl servers close connections after a maximum age (300 s plus 30 s grace, services/common/
    grpcutil.py), which ends a stream with UNAVAILABLE; handing over before that, between steps and
    before the last actions are applied, loses nothing. None = never.
    max_reconnects: consecutive attempts to resume after the stream broke (UNAVAILABLE); the reward
    of the one step in flight when it broke is then not counted by the actor. Errors the actor sends
    (INVALID_ARGUMENT, ...) are raised as SessionError.
    ca_file, cert_file, key_file, server_name, tls: TLS to the actor, as EnvSessionClient takes them.
    token, token_file: the bearer token, as EnvSessionClient takes them (a token file is read again at
    each reconnect, so a rotated token is picked up).
    """
    envs = as_vector_env(env)
    space_kw, start = _spaces(envs)
    n = envs.num_envs
    spec_id = getattr(getattr(envs, "spec", None), "id", None) or type(envs).__name__

    def connect() -> EnvSessionClient:
        return EnvSessionClient(address, session_id=session_id, **space_kw, num_envs=n, timeout_s=timeout_s,
                                simulator=simulator or f"gymnasium:{spec_id}"[:128], ca_file=ca_file,
                                cert_file=cert_file, key_file=key_file, server_name=server_name, tls=tls,
                                token=token, token_file=token_file)

    obs, info = envs.reset(seed=seed)
    masks = _masks(info)
    ep_ret, ep_len = np.zeros(n), np.zeros(n, dtype=np.int64)
    returns: list[float] = []
    lengths: list[int] = []
    steps = sessions = 0
    held = 0.0  # seconds the actor held the replies of the streams closed so far
    client: EnvSessionClient | None = None
    opened = 0.0

    def open_session(first_obs, first_masks, retries: int) -> np.ndarray:
        """A new stream (resuming the session after the first); returns the actions for first_obs."""
        nonlocal client, sessions, opened, held
        for attempt in range(retries + 1):
            held += client.held_s if client is not None else 0.0
            client = connect()
            sessions += 1
            try:
                actions = client.reset(first_obs, first_masks)
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
        actions = open_session(obs, masks, 0)
        while (max_steps is None or steps < max_steps) and not (stop is not None and stop.is_set()):
            obs, rewards, terminated, truncated, info = envs.step(actions + start)
            steps += 1
            ep_ret += rewards
            ep_len += 1
            masks = _masks(info)
            done = np.logical_or(terminated, truncated)
            final = None
            if done.any():
                idx = np.flatnonzero(done)
                final = _stack([info["final_obs"][i] for i in idx])
                returns.extend(float(r) for r in ep_ret[idx])
                lengths.extend(int(x) for x in ep_len[idx])
                ep_ret[idx], ep_len[idx] = 0.0, 0
            try:
                actions = client.step(obs, rewards, terminated, truncated, final, masks)
            except SessionError as e:
                if e.code != "UNAVAILABLE" or max_reconnects <= 0:
                    raise
                log.warning("session %s broke (%s); resuming", session_id, e)
                client.cancel()
                actions = open_session(obs, masks, max_reconnects)
                continue
            if reconnect_s is not None and time.monotonic() - opened >= reconnect_s:
                # Hand over before applying these actions: the actor drops them (and marks the last
                # transition truncated, bootstrapped); the new stream starts again at this obs.
                client.close()
                actions = open_session(obs, masks, max_reconnects)
        client.close()
    except BaseException:
        if client is not None:
            client.cancel()
        raise
    return {"steps": steps, "env_steps": steps * n, "episodes": len(returns), "returns": returns,
            "lengths": lengths, "sessions": sessions, "held_s": held + (client.held_s if client is not None else 0.0)}
