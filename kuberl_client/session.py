"""A blocking client for one `Actor.EnvSession` stream: a simulator's side of the protocol.

    with EnvSessionClient("actor:50053", session_id="sim-0", obs_shape=(4,), obs_dtype="float32",
                          num_actions=2, num_envs=8) as client:
        actions = client.reset(obs)                  # hello -> accepted -> step 0 -> actions
        while running:
            obs, rewards, term, trunc, final_obs = simulate(actions)
            actions = client.step(obs, rewards, term, trunc, final_obs)
    # leaving the block half-closes the stream and waits for the actor to end it

Several agents (`agent_ids=[...]` instead of num_envs; docs/multi-agent.md, "Agents over EnvSession"),
as PettingZoo's parallel API has them: `reset` and `step` take and return dicts keyed by agent id.

    with EnvSessionClient(address, session_id="crossing-3", agent_ids=["car-0", "car-1", "car-2"],
                          obs_shape=(6,), num_actions=3) as client:
        actions = client.reset({"car-0": o0, "car-1": o1})        # the agents acting now
        # rewards, terminated, truncated (and final_observations of those that ended): one entry for
        # each agent that acted on the step before; observations: the agents acting next
        actions = client.step({"car-0": o0, "car-2": o2}, rewards={"car-0": 0.1, "car-1": 1.0},
                              terminated={"car-0": False, "car-1": True}, truncated={...},
                              final_observations={"car-1": last1}, joined=[])

A run of several policies (config `policies`; docs/multi-agent.md, "Several policies over EnvSession"):
one session per policy, each naming it (`policy="..."`) with that policy's spaces and agents; the
simulator steps them together, each with its own agents' data.

    with EnvSessionClient(address, session_id="game-1/red", policy="red", agent_ids=["red-0", "red-1"],
                          obs_shape=(8,), num_actions=5) as red, \
         EnvSessionClient(address, session_id="game-1/blue", policy="blue", agent_ids=["blue-0"],
                          obs_shape=(12,), num_actions=3) as blue:
        red_actions, blue_actions = red.reset(red_obs), blue.reset(blue_obs)

An agent that acted and did not end must act again; one that ended acts on (its next episode) or
leaves, and comes back only when listed in `joined` (never on its first step: a first step takes no
join). The client checks this before sending, as the actor does (INVALID_ARGUMENT naming the agent and
the field). A step on which no agent acts (every agent ended and left, or the simulator plays them for
a while) passes empty observations, `{}` (sent as EnvStep.no_agents), and gets `{}` back; the step
after it has no outcomes to report (rewards, terminated and truncated `{}` or left out).

        actions = client.step({}, rewards={"car-0": 1.0}, terminated={"car-0": True},
                              truncated={"car-0": False}, final_observations={"car-0": last0})   # -> {}
        actions = client.step({"car-0": o0}, joined=["car-0"])                                    # back

Spaces: the observation is a Box (`obs_shape`, `obs_dtype`), a Dict of Boxes (`obs_keys`, each
key's shape; observations are then passed as {key: [num_envs, *shape]} and flattened here, keys
sorted, into float32), or `obs_space`: a `Discrete(n)` (observations int [num_envs], each in
0..n-1) or `MultiDiscrete(nvec)` (int [num_envs, k]) that the policy one-hot encodes. The action space is `num_actions` (Discrete) or `action_space`: a
`Discrete(n)`, `MultiDiscrete(nvec)` or `Box.of(shape, low, high)` from this package. Actions come
back as int64 [num_envs] (Discrete), int64 [num_envs, k] (MultiDiscrete) or float32
[num_envs, *shape] clipped to the bounds (Box). `reset` and `step` take optional `action_masks`
([num_envs, M] bool; Discrete M = n, MultiDiscrete M = sum(nvec)).

The protocol (protos/kuberl/v1/actor.proto) keeps exactly one step outstanding, so the client is a
plain request/reply loop over a gRPC bidirectional stream (synchronous grpc API): requests go to
gRPC through an iterator fed from a queue.Queue; replies are read in the calling thread. Every wait
has a timeout (`timeout_s`): a watchdog cancels the call when the actor does not answer in time.

An error from the actor (the stream ends with a non-OK status) is raised as SessionError with the
status code's name (e.g. "INVALID_ARGUMENT") and the actor's message; the session is then over
(reconnect with the same session_id to resume its episodes). One client serves one thread.

TLS (an actor with tls.enabled; docs/security.md): `ca_file` is the CA bundle that verifies the
actor's certificate; `cert_file`/`key_file` this simulator's client certificate, needed when the
actor requires one (tls.client_auth: require); `server_name` the name checked in the actor's
certificate instead of the host dialled. Any of them turns TLS on; `tls=True` with none of them
verifies the actor against the system's CAs.

Tokens (an actor with auth.token_files; docs/security.md): `token` (or `token_file`, whose first token
is read) is sent as `authorization: Bearer <token>` metadata; the actor answers a missing or unknown
one with UNAUTHENTICATED. Without TLS the token is sent anyway, with one warning per process.

Imports only numpy, grpc, the kuberl.v1 stubs, services.common.protocol.tensors, services.common.protocol.spaces,
services.common.net.tls (TlsConfig, the credentials) and services.common.net.tokens; never the experiment
config nor the servers' side.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import numpy as np

from kuberl.v1 import actor_pb2, actor_pb2_grpc
from services.common.protocol import spaces
from services.common.net.tokens import AuthError, bearer_metadata, read_client_token
from services.common.net.tls import TlsConfig
from services.common.protocol.spaces import ActionSpace, Box, Discrete, MultiDiscrete
from services.common.protocol.tensors import TensorError, decode, dtype_code, encode
from services.common.net.tls import Names, channel_credentials, open_channel

__all__ = ["Box", "Discrete", "EnvSessionClient", "MultiDiscrete", "SessionError", "SessionTimeout"]

_END = object()          # queue sentinel: half-close the request stream
_POLL_S = 1.0            # how often an idle request iterator / watchdog re-checks for shutdown
MAX_MESSAGE_BYTES = 64 << 20
TLS_NAMES = Names(cert="cert_file", key="key_file", ca="ca_file")  # how TLS errors name the parameters


class SessionError(Exception):
    """The session ended with an error. `code` is the gRPC status code's name, `details` its message.

    Codes the actor sends (actor.proto): INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED,
    DEADLINE_EXCEEDED; transport failures arrive as UNAVAILABLE, CANCELLED, etc.
    """

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class SessionTimeout(SessionError):
    """The actor did not answer within the client's `timeout_s` (raised by the client, code DEADLINE_EXCEEDED)."""

    def __init__(self, details: str):
        super().__init__("DEADLINE_EXCEEDED", details)


class _Watchdog(threading.Thread):
    """Calls `expire()` once a deadline set by `arm` passes without `disarm`.

    Arming is cheap (a lock, no thread wake-up while the watchdog is already waiting on an earlier
    deadline: deadlines only move later, so it wakes up in time and re-checks).
    """

    def __init__(self, expire, name: str):
        super().__init__(name=name, daemon=True)
        self._expire = expire
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._idle = False
        self._stopped = False

    def arm(self, seconds: float) -> None:
        with self._cond:
            self._deadline = time.monotonic() + seconds
            if self._idle:
                self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def run(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._idle = True
                    self._cond.wait(_POLL_S)
                    self._idle = False
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                self._deadline = None
                self._cond.release()
                try:
                    self._expire()
                finally:
                    self._cond.acquire()


class EnvSessionClient:
    """One simulator session with an actor in env.mode "external".

    obs_shape / obs_dtype: a Box observation space of ONE env copy (must equal the actor's policy input);
    or obs_keys: {key: shape} of a Dict observation space; or obs_space: a Discrete or MultiDiscrete
    observation space (this package's: an env copy's observation is one int in 0..n-1, or k of them;
    the policy one-hots them).
    num_actions: a Discrete action space's n; or action_space: Discrete, MultiDiscrete or Box (this
    package's). num_envs: env copies stepped in lockstep (1..1024).
    timeout_s: the longest wait for any answer from the actor (connecting included).
    ca_file, cert_file, key_file, server_name, tls: TLS to the actor (see the module's docstring); a
    file that cannot be read, or a key that does not match its certificate, raises ValueError naming
    the parameter and the file.
    token, token_file: the bearer token for an actor with auth.token_files (at most one of them).

    After `reset` / `step`: `step_id` (of the last step sent), `policy_version` (of the last actions),
    `held_s` (seconds the actor held this session's replies so far, while the learner was behind:
    the rate limiter, docs/rate-limiter.md), and from the actor's acceptance `resumed`, `session_timeout_s`.
    """

    def __init__(self, address: str, *, session_id: str, num_envs: int = 0, obs_shape=None, obs_dtype="float32",
                 obs_keys: dict | None = None, obs_space: Discrete | MultiDiscrete | None = None,
                 num_actions: int | None = None,
                 action_space: ActionSpace | None = None, simulator: str = "python", timeout_s: float = 30.0,
                 wait_for_ready: bool = True, channel_options: list | None = None, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None, server_name: str | None = None,
                 tls: bool | None = None, token: str | None = None, token_file: str | None = None,
                 agent_ids: list[str] | None = None, policy: str = ""):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if (num_actions is None) == (action_space is None):
            raise ValueError("give num_actions (a Discrete space) or action_space, exactly one")
        if (obs_shape is not None) + (obs_keys is not None) + (obs_space is not None) != 1:
            raise ValueError("give obs_shape (a Box observation), obs_keys (a Dict) or obs_space (a Discrete or "
                             "MultiDiscrete), exactly one")
        if obs_space is not None and not isinstance(obs_space, (Discrete, MultiDiscrete)):
            raise TypeError(f"obs_space: expected kuberl_client.Discrete or MultiDiscrete, got {type(obs_space).__name__}")
        self.obs_space = obs_space
        self.address, self.session_id = address, session_id
        self.action_space: ActionSpace = Discrete(int(num_actions)) if action_space is None else action_space
        if not isinstance(self.action_space, (Discrete, MultiDiscrete, Box)):
            raise TypeError(f"action_space: expected kuberl_client.Discrete, MultiDiscrete or Box, "
                            f"got {type(action_space).__name__}")
        self.obs_keys = None if obs_keys is None else spaces.dict_layout(obs_keys)
        if self.obs_keys is not None:
            obs_shape, obs_dtype = (spaces.flat_size(self.obs_keys),), np.float32
        if obs_space is not None:
            obs_shape, obs_dtype = obs_space.shape, np.int64
        self.obs_shape = tuple(int(d) for d in obs_shape)
        self.obs_dtype = np.dtype(obs_dtype)
        self.agent_ids = [str(a) for a in agent_ids or ()]
        self.policy = str(policy)
        if self.agent_ids:
            if len(set(self.agent_ids)) != len(self.agent_ids):
                raise ValueError("agent_ids: each id once")
            if num_envs not in (0, len(self.agent_ids)):
                raise ValueError(f"num_envs: {num_envs}, but agent_ids names {len(self.agent_ids)} agents")
            num_envs = len(self.agent_ids)
        elif num_envs < 1:
            raise ValueError("give num_envs (env copies, >= 1) or agent_ids (several agents)")
        self.num_envs = int(num_envs)
        self._acted: list[str] = []          # several agents: those that acted on the last step, in order
        self._left: set[str] = set()         # ... those that ended and left (they come back through joined)
        self._seen: set[str] = set()         # ... those that acted on this stream (a first step takes no join)
        self.simulator, self.timeout_s, self.wait_for_ready = simulator, float(timeout_s), wait_for_ready
        self._obs_code = dtype_code(self.obs_dtype)  # TensorError (a ValueError) for dtypes with no wire code
        self.tls = TlsConfig(enabled=bool(ca_file or cert_file or key_file or server_name) if tls is None else tls,
                             cert_file=cert_file or "", key_file=key_file or "", ca_file=ca_file or "",
                             server_name=server_name or "")
        if self.tls.enabled:
            channel_credentials(self.tls, TLS_NAMES)  # unreadable files are refused here, not at connect
        if token and token_file:
            raise ValueError("give token or token_file, not both")
        try:
            self._token = read_client_token(token_file, "token_file") if token_file else (token or None)
        except AuthError as err:
            raise ValueError(str(err)) from None
        self._options = channel_options if channel_options is not None else [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
        self.step_id: int | None = None      # last step sent (None before reset)
        self.resumed: bool | None = None     # from `accepted`
        self.policy_version: int | None = None
        self.held_s = 0.0
        self.session_timeout_s: float | None = None
        self._channel: grpc.Channel | None = None
        self._call = None
        self._requests: queue.Queue = queue.Queue()
        self._watchdog: _Watchdog | None = None
        self._timed_out = False
        self._shutdown = False               # the request iterator ends at the next poll
        self._closed = False
        self._error: SessionError | None = None
        self._waiting = ""                   # what we wait for, for the timeout message

    # -- public API ----------------------------------------------------------------------------
    def hello(self) -> actor_pb2.SessionAccepted:
        """Open the stream, send hello and wait for `accepted` (reset() calls this if needed)."""
        self._check_usable()
        if self._call is not None:
            raise RuntimeError("hello was already sent on this session")
        self._channel = open_channel(self.address, self.tls, options=self._options, names=TLS_NAMES)
        self._watchdog = _Watchdog(self._expire, name=f"env-session-watchdog-{self.session_id}")
        self._watchdog.start()
        stub = actor_pb2_grpc.ActorStub(self._channel)
        self._call = stub.EnvSession(self._request_iter(), wait_for_ready=self.wait_for_ready,
                                     metadata=bearer_metadata(self._token, self.tls.enabled) or None)
        hello = actor_pb2.EnvHello(session_id=self.session_id, num_envs=self.num_envs, simulator=self.simulator,
                                   agent_ids=self.agent_ids, policy=self.policy)
        if self.obs_space is not None:
            spaces.to_proto(self.obs_space, hello.observation_space)
        elif self.obs_keys is None:
            hello.observation_space.box.shape[:] = self.obs_shape
            hello.observation_space.box.dtype = self._obs_code
        else:
            spaces.dict_layout_to_proto(self.obs_keys, hello.observation_space.dict)
        spaces.to_proto(self.action_space, hello.action_space)
        self._requests.put(actor_pb2.EnvMessage(hello=hello))
        reply = self._receive("the actor's answer to hello")
        if reply.WhichOneof("kind") != "accepted":
            raise self._protocol_error(f"expected `accepted` after hello, got `{reply.WhichOneof('kind')}`")
        acc = reply.accepted
        self.resumed, self.policy_version = bool(acc.resumed), int(acc.policy_version)
        self.session_timeout_s = acc.session_timeout_ms / 1000.0
        return acc

    def reset(self, observations, action_masks=None):
        """Send hello (if not yet sent) and step 0 with the first observations; return the actions.
        Several agents: observations {agent: obs} of the agents acting first (action_masks likewise);
        returns {agent: action}."""
        self._check_usable()
        if self.step_id is not None:
            raise RuntimeError("reset() starts a session once; to resume, open a new client with the same session_id")
        if self._call is None:
            self.hello()
        if self.agent_ids:
            return self._agents_step(0, observations, action_masks)
        step = actor_pb2.EnvStep(step_id=0)
        encode(self._observations(observations, "observations"), step.observations)
        self._masks(action_masks, step)
        return self._exchange(step)

    def step(self, observations, rewards=None, terminated=None, truncated=None, final_observations=None,
             action_masks=None, joined=()):
        """Send the next step (rewards, flags and next observations for the previous actions); return actions.

        final_observations: [K, *obs_shape] (a Dict space: {key: [K, *shape]}), the true last
        observation of each env whose episode ended (terminated or truncated), in env order; required
        iff K > 0. action_masks: [num_envs, M] bool, the actions allowed at `observations` (None: all).
        Several agents: every argument a dict keyed by agent id (see the module docstring), `joined`
        the agents coming back after they left; returns {agent: action}. Observations `{}`: no agent
        acts on this step (EnvStep.no_agents; returns {}). Rewards and flags are required, except
        after a step of no agents (there are no outcomes to report).
        """
        self._check_usable()
        if self.step_id is None:
            raise RuntimeError("call reset() before step()")
        if self.agent_ids:
            return self._agents_step(self.step_id + 1, observations, action_masks, rewards, terminated, truncated,
                                     final_observations, joined)
        n = self.num_envs
        if rewards is None or terminated is None or truncated is None:
            raise ValueError("rewards, terminated and truncated: required (one per env copy)")
        step = actor_pb2.EnvStep(step_id=self.step_id + 1)
        encode(self._observations(observations, "observations"), step.observations)
        encode(self._per_env(rewards, np.float32, "rewards"), step.rewards)
        term = self._per_env(terminated, np.bool_, "terminated")
        trunc = self._per_env(truncated, np.bool_, "truncated")
        encode(term, step.terminated)
        encode(trunc, step.truncated)
        k = int(np.count_nonzero(term | trunc))
        if k:
            if final_observations is None:
                raise ValueError(f"final_observations: required, {k} of {n} envs ended this step")
            fin = self._array(self._flat(final_observations, k, "final_observations"), "final_observations")
            if fin.shape != (k, *self.obs_shape):
                raise ValueError(f"final_observations: shape {fin.shape}, expected {(k, *self.obs_shape)} "
                                 f"(one row per ended env, in env order)")
            encode(fin, step.final_observations)
        elif final_observations is not None and (isinstance(final_observations, dict) or np.size(final_observations)):
            raise ValueError("final_observations: given, but no env ended this step")
        self._masks(action_masks, step)
        return self._exchange(step)

    def close(self) -> None:
        """Half-close the stream and wait (at most timeout_s) for the actor to end it.

        Raises SessionError if the actor ends the stream with an error. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        error = None
        try:
            if self._call is not None and self._error is None:
                self._requests.put(_END)
                self._waiting = "the actor to end the stream after half-close"
                self._watchdog.arm(self.timeout_s)
                try:
                    for _ in self._call:  # nothing is outstanding; anything late is dropped
                        pass
                except grpc.RpcError as e:
                    error = self._translate(e)
                finally:
                    self._watchdog.disarm()
        finally:
            self._release()
        if error is not None:
            self._error = error
            raise error

    def cancel(self) -> None:
        """Abort the stream at once (the actor sees the simulator go away). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._call is not None:
                self._call.cancel()
        finally:
            self._release()

    def __enter__(self) -> EnvSessionClient:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()

    def __del__(self):  # best effort: never leave a watchdog thread and a channel behind
        try:
            if not self._closed:
                self.cancel()
        except Exception:
            pass

    # -- internals -----------------------------------------------------------------------------
    def _request_iter(self):
        """Consumed by gRPC's request thread: messages from the queue until _END (half-close)."""
        while True:
            try:
                item = self._requests.get(timeout=_POLL_S)
            except queue.Empty:
                if self._shutdown:
                    return
                continue
            if item is _END:
                return
            yield item

    def _agents_step(self, step_id: int, observations: dict, action_masks: dict | None, rewards=None,
                     terminated=None, truncated=None, final_observations=None, joined=()) -> dict:
        """One step of a session of several agents: the dicts checked and laid out in rows (none:
        EnvStep.no_agents)."""
        if not isinstance(observations, dict):
            raise TypeError("observations: a dict {agent id: observation} for a session of several agents")
        agents = list(observations)
        for a in agents:
            if a not in self.agent_ids:
                raise ValueError(f"observations: {a!r} is not one of agent_ids")
        joined = list(joined)
        for a in joined:
            if a not in observations:
                raise ValueError(f"joined: {a!r} joins but has no observation (a joining agent acts on the step it joins)")
            if a not in self._seen:
                raise ValueError(f"joined: {a!r} must not be joined on its first step (a first step takes no join: "
                                 f"joined is for an agent back after its episode ended)")
        if not agents and action_masks:
            raise ValueError("action_masks: given, but no agent acts on this step")
        step = actor_pb2.EnvStep(step_id=step_id, agents=agents, joined=joined, no_agents=not agents)
        ended: list[str] = []
        if step_id > 0 and self._acted:   # (after a step of no agents there are no outcomes: none sent)
            flags = {}
            for field, value, dtype in (("rewards", rewards, np.float32), ("terminated", terminated, np.bool_),
                                        ("truncated", truncated, np.bool_)):
                if not isinstance(value, dict) or set(value) != set(self._acted):
                    raise ValueError(f"{field}: a dict with one entry for each agent that acted on the step before: "
                                     f"{sorted(self._acted)}")
                flags[field] = np.array([value[a] for a in self._acted], dtype)
            encode(flags["rewards"], step.rewards)
            encode(flags["terminated"], step.terminated)
            encode(flags["truncated"], step.truncated)
            ended = [a for a, e in zip(self._acted, flags["terminated"] | flags["truncated"]) if e]
            for a in self._acted:
                if a not in ended and a not in observations:
                    raise ValueError(f"observations: {a!r} acted on the step before and did not end, so it must act "
                                     f"now (end it with terminated or truncated first)")
            finals = final_observations or {}
            if set(finals) != set(ended):
                raise ValueError(f"final_observations: one for each agent that ended, {sorted(ended)}; "
                                 f"got {sorted(finals)}")
            if ended:
                encode(self._array(self._flat(np.stack([np.asarray(finals[a]) for a in ended])
                                              if self.obs_keys is None else _stack_dicts([finals[a] for a in ended]),
                                              len(ended), "final_observations"), "final_observations"),
                       step.final_observations)
        elif step_id > 0:
            for field, value in (("rewards", rewards), ("terminated", terminated), ("truncated", truncated),
                                 ("final_observations", final_observations)):
                if value:
                    raise ValueError(f"{field}: given, but no agent acted on the step before (it was a step of no "
                                     f"agents): leave it out")
        for a in joined:
            if a not in self._left and a not in ended:
                raise ValueError(f"joined: {a!r} has not ended (only an agent whose episode ended joins again)")
        for a in agents:
            if a in self._left and a not in joined and a not in ended:
                raise ValueError(f"observations: {a!r} left after its episode ended; list it in joined to act again")
        if agents:   # (a step of no agents sends no observations)
            rows = (_stack_dicts([observations[a] for a in agents]) if self.obs_keys is not None
                    else np.stack([np.asarray(observations[a]) for a in agents]))
            encode(self._observations(rows, "observations", len(agents)), step.observations)
        if action_masks is not None and agents:
            self._masks(np.stack([np.asarray(action_masks[a]) for a in agents]), step, len(agents))
        actions = self._exchange(step, len(agents))
        self._left = (self._left | set(ended)) - set(agents)
        self._seen |= set(agents)
        self._acted = agents
        return dict(zip(agents, actions))

    def _exchange(self, step: actor_pb2.EnvStep, rows: int | None = None) -> np.ndarray:
        self._requests.put(actor_pb2.EnvMessage(step=step))
        self.step_id = step.step_id
        reply = self._receive(f"actions for step {step.step_id}")
        if reply.WhichOneof("kind") != "actions":
            raise self._protocol_error(f"expected `actions` for step {step.step_id}, got `{reply.WhichOneof('kind')}`")
        ar = reply.actions
        if ar.step_id != step.step_id:
            raise self._protocol_error(f"actions answer step {ar.step_id}, expected {step.step_id}")
        try:
            actions = decode(ar.actions, "actions")
        except TensorError as e:
            raise self._protocol_error(f"malformed actions: {e}") from None
        try:
            spaces.check_actions(self.action_space, actions, (self.num_envs if rows is None else rows,))
            if isinstance(self.action_space, Box) and ((actions < self.action_space.low_array).any()
                                                       or (actions > self.action_space.high_array).any()):
                raise TensorError("actions", f"lie outside the bounds of {self.action_space}")
        except TensorError as e:
            raise self._protocol_error(str(e)) from None
        self.policy_version = int(ar.policy_version)
        self.held_s += ar.held_ms / 1000.0
        return actions.copy()

    def _receive(self, what: str):
        self._waiting = what
        self._watchdog.arm(self.timeout_s)
        try:
            return next(self._call)
        except StopIteration:
            raise self._fail(SessionError("OK", f"the actor ended the stream while the client waited for {what}")) from None
        except grpc.RpcError as e:
            raise self._fail(self._translate(e)) from None
        finally:
            self._watchdog.disarm()

    def _expire(self) -> None:
        self._timed_out = True
        call = self._call
        if call is not None:
            call.cancel()

    def _translate(self, e: grpc.RpcError) -> SessionError:
        if self._timed_out:
            return SessionTimeout(f"no answer from the actor at {self.address} within {self.timeout_s:g} s "
                                  f"(waiting for {self._waiting})")
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        return SessionError(code.name if code is not None else "UNKNOWN", details or "")

    def _fail(self, error: SessionError) -> SessionError:
        self._error = error
        if self._call is not None:
            self._call.cancel()
        self._closed = True
        self._release()
        return error

    def _protocol_error(self, message: str) -> SessionError:
        return self._fail(SessionError("UNKNOWN", f"protocol violation by the actor: {message}"))

    def _release(self) -> None:
        self._shutdown = True
        self._requests.put(_END)
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._channel is not None:
            self._channel.close()

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError("the session is closed")

    def _array(self, value, field: str) -> np.ndarray:
        arr = np.asarray(value)
        if arr.dtype != self.obs_dtype:
            if not np.can_cast(arr.dtype, self.obs_dtype, casting="same_kind"):
                raise ValueError(f"{field}: dtype {arr.dtype} cannot be sent as the declared {self.obs_dtype}")
            arr = arr.astype(self.obs_dtype)
        return arr

    def _flat(self, value, rows: int, field: str):
        """A Dict space's {key: array} flattened to [rows, flat size] float32 (anything else as it is)."""
        if self.obs_keys is None or not isinstance(value, dict):
            return value
        if rows == 1 and all(np.shape(value.get(k)) == shape for k, shape in self.obs_keys):
            value = {k: np.asarray(v)[None] for k, v in value.items()}  # one env's observation
        try:
            return spaces.flatten_dict(value, self.obs_keys, (rows,))
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None

    def _masks(self, value, step: actor_pb2.EnvStep, rows: int | None = None) -> None:
        if value is None:
            return
        arr = np.asarray(value)
        if arr.dtype != np.bool_:
            if not np.isin(arr, (0, 1)).all():
                raise ValueError("action_masks: must be booleans (0 or 1)")
            arr = arr.astype(np.bool_)
        try:
            spaces.check_mask(self.action_space, arr, (self.num_envs if rows is None else rows,), "action_masks")
        except TensorError as e:
            raise ValueError(str(e)) from None
        encode(arr, step.action_masks)

    def _observations(self, value, field: str, rows: int | None = None) -> np.ndarray:
        n = self.num_envs if rows is None else rows
        arr = self._array(self._flat(value, n, field), field)
        if n == 1 and arr.shape == self.obs_shape:
            arr = arr[None]
        if arr.shape != (n, *self.obs_shape):
            raise ValueError(f"{field}: shape {arr.shape}, expected {(n, *self.obs_shape)}")
        return arr

    def _per_env(self, value, dtype, field: str) -> np.ndarray:
        arr = np.asarray(value)
        if arr.size != self.num_envs or arr.ndim > 1:
            raise ValueError(f"{field}: shape {arr.shape}, expected ({self.num_envs},)")
        if dtype is np.bool_ and arr.dtype != np.bool_ and not np.isin(arr, (0, 1)).all():
            raise ValueError(f"{field}: flags must be booleans (0 or 1)")
        return arr.astype(dtype, copy=False).reshape(self.num_envs)


def _stack_dicts(values: list[dict]) -> dict:
    """Several agents' Dict observations, {key: [K, *shape]}."""
    return {k: np.stack([np.asarray(v[k]) for v in values]) for k in values[0]} if values else {}
