"""External simulator sessions: validate what simulators send, assemble their fragments, close them out.

No gRPC and no asyncio here (servicer.py speaks the EnvSession protocol and batches inference).
Each session steps `num_envs` env copies in lockstep; its transitions are cut into fragments of
`rollout_steps` steps exactly as rollout.py does for local envs. A session that ends for any reason
pushes its unfinished fragment with the last step of every still-running episode marked truncated,
so the learner bootstraps there instead of seeing a false terminal state. A step holding NaN or
infinity (or, with actor.check_obs_bounds, an observation outside its declared bounds: finite.py) ends
its session with INVALID_ARGUMENT before anything of it is recorded or acted on.

A fragment is cut on the calling thread (the event loop): its seq, `on_cut` (the buffer's rate limiter)
and the metrics count it at once, and the session goes on in fresh arrays. Its arrays are encoded into
the wire payload (`encode_fragment`, one copy) by the hub's `encoder` (encoder.py: one thread of its
own, in the order cut, so the loop never copies a payload) and handed to `on_fragment` in seq order,
on the encoder's thread; without an encoder, inline, before the step returns. `flush` waits for the
encoder's pending fragments (the actor's shutdown, after `close_all`).

A session of several agents (hello.agent_ids) gives each agent a slot. A step names the agents that act
on it (`EnvStep.agents`; none with `EnvStep.no_agents`); the outcomes it carries are those of the agents
that acted on the step before. An agent that acted and did not end must act again; one that ended acts
on with its next episode or leaves, and comes back only through `EnvStep.joined` (never on its first
step of the stream). Its transitions are recorded only at the steps it acted, and a window is cut into
one fragment per run of steps of a set of agents (windows.py's `split_runs`, as for PettingZoo envs),
so no agent's step is lost or recorded twice. A step of no agents takes no row of the window (the
next step's agents fill it), so a stretch of them records nothing and cuts no fragment. Every refusal
of one agent's data names the agent's id and the field, not its row.

A hub without `on_fragment` (`kuberl serve`: inference only) checks everything exactly as a training
actor's does and keeps the sessions' episode statistics, but records no transitions: no fragment
buffers are allocated, no fragment is cut, nothing is pushed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field

import numpy as np

from kuberl.v1 import actor_pb2
from services.actor.encoder import FragmentEncoder
from services.actor.episodes import EpisodeLog
from services.actor.finite import FINITE, Check
from services.actor.windows import window_groups
from services.common.agents import policy_of
from services.config import ExperimentConfig
from services import algorithms
from services.common.protocol.fragments import MAX_ID_LEN, EncodedFragment, encode_fragment
from services.common.models.nets import EnvSpec
from services.common.stats import Metrics
from services.common.protocol import spaces
from services.common.protocol.tensors import TensorError, decode, numpy_dtype

MAX_ENVS = 1024
RECENT_RETURNS = 20   # episodes in a session's actor/session_return_mean


class SessionError(Exception):
    """A session must end with `code` (a grpc.StatusCode name) and this message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class _Episodes:
    """Running returns and lengths of a session's env copies, and its totals (kept across a resume)."""
    returns: np.ndarray
    lengths: np.ndarray
    closed_at: float | None = None
    env_steps: int = 0                # env steps the session's simulator took
    finished: int = 0                 # episodes it finished
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_RETURNS))
    # A recurrent policy's state per env copy [N, state_size] (zeroed where an episode starts); None
    # for a feed-forward policy. `acted_from`: the state the last actions were chosen from, where a
    # resumed session goes on (its step 0 re-sends the observations those actions were chosen on).
    state: np.ndarray | None = None
    acted_from: np.ndarray | None = None
    agent_ids: tuple[str, ...] = ()   # a session of several agents: theirs (a resume must name the same)


def _same_action_space(got: spaces.ActionSpace, want: spaces.ActionSpace) -> bool:
    """Equal spaces; Box bounds compared as the float32 values actions are clipped to."""
    if isinstance(got, spaces.Box) and isinstance(want, spaces.Box):
        return (got.shape == want.shape and np.array_equal(got.low_array, want.low_array)
                and np.array_equal(got.high_array, want.high_array))
    return got == want


@dataclass
class Session:
    session_id: str
    num_envs: int
    episodes: _Episodes
    env_id_base: int
    T: int
    next_step: int = 0
    t: int = 0                        # transitions recorded in the current fragment
    buffers: dict = field(default_factory=dict)
    final_obs: list = field(default_factory=list)
    final_index: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    masked: bool = False              # some step of the current fragment carried action masks
    mask: np.ndarray | None = None    # the masks of the observations being acted on (None: all allowed)
    check: Check = FINITE             # how its observations are checked (finite.py; its hello's layout, bounds)
    last_seen: float = field(default_factory=time.monotonic)
    held_s: float = 0.0               # seconds its replies were held (rate limiter, on-policy pacing)
    ended: str | None = None          # why the hub closed it ("replaced", "shutdown", ...), None while open
    # A session of several agents (hello.agent_ids): slot of each id; the slots of the observations being
    # acted on, in row order; [N] slots that ended and left (they come back through `joined`).
    index: dict[str, int] = field(default_factory=dict)
    rows: np.ndarray | None = None
    left: np.ndarray | None = None
    seen: np.ndarray | None = None    # [N] slots that acted on this stream (a first step takes no join)
    all_rows: np.ndarray = field(init=False)   # every slot, in order: the rows of a session without agents

    def __post_init__(self) -> None:
        self.all_rows = np.arange(self.num_envs)

    @property
    def agents(self) -> bool:
        return bool(self.index)


def ended_error(s: Session) -> SessionError:
    """What a stream hears when its session was closed under it. A takeover is ABORTED: a newer stream
    owns the session_id now, and this one must stop (reconnecting would take the session back, and the
    two would take it from each other forever). Anything else (the actor shutting down) is
    UNAVAILABLE: reconnect, with the same session_id to resume."""
    if s.ended == "replaced":
        return SessionError("ABORTED", f"session {s.session_id!r} was taken over by a newer stream with the same "
                                       f"session_id: stop this one (do not reconnect it)")
    return SessionError("UNAVAILABLE", "the actor is shutting down: reconnect (with the same session_id to resume)")


def register_session_metrics(metrics: Metrics) -> None:
    """The session counters and gauge at 0: every actor reports them, one without simulators (a local
    env's actor) as 0 sessions, so that a dashboard reads 0 rather than no data."""
    for name in ("sessions", "sessions_refused", "sessions_timed_out", "sessions_resumed", "sessions_replaced",
                 "steps_refused_nonfinite", "steps_refused_out_of_bounds"):
        metrics.inc(f"actor/{name}_total", 0)
    metrics.set("actor/sessions_active", metrics.gauges.get("actor/sessions_active", 0))


class SessionHub:
    def __init__(self, cfg: ExperimentConfig, spec: EnvSpec, actor_id: str, metrics: Metrics,
                 on_fragment: Callable[[EncodedFragment], None] | None, incarnation: int = 0, *,
                 on_cut: Callable[[int, int], None] | None = None, encoder: FragmentEncoder | None = None,
                 state_size: int = 0, policy: str = "", episodes: EpisodeLog | None = None):
        """`on_fragment` receives every fragment's payload, in seq order: on `encoder`'s thread if given
        (then it must be thread-safe), else inline. `on_cut(seq, samples)` is called as each is cut.
        `state_size`: floats of recurrent state per env copy the policy keeps (`Policy.state_size`).

        `policy`: of a run of several policies (config `policies`), the one this hub's sessions are
        played by: one hub per policy, each with that policy's spaces, `metrics` scoped to it
        (`Metrics.scoped`: its gauges under actor/policies/<policy>/), and `episodes` shared by all."""
        self.cfg, self.spec, self.actor_id, self.metrics, self.incarnation = cfg, spec, actor_id, metrics, incarnation
        self.policy = policy
        self.on_fragment, self.on_cut, self.encoder = on_fragment, on_cut, encoder
        self.records = on_fragment is not None  # False: serving only, no transitions kept
        self.algorithm = algorithms.get(cfg.algorithm)
        self.extras = self.algorithm.extras(cfg)
        self.state_size = state_size
        # Fragments carry the simulators' masks when the space has them and the algorithm takes them.
        self.masks = self.algorithm.uses_masks(spec.action)
        self.sessions: dict[str, Session] = {}
        self._parked: dict[str, _Episodes] = {}  # closed sessions that may resume
        self._next_env_id = 0
        self.closing = False
        self.seq = 0
        self.env_steps = 0
        self.episodes = episodes if episodes is not None else EpisodeLog(metrics)
        register_session_metrics(metrics)
        metrics.add_labelled(self.session_figures)
        metrics.track_rate("actor/env_steps_per_s", "actor/env_steps_total")
        if self.records:
            metrics.track_rate("actor/fragments_per_s", "actor/fragments_total")

    def session_figures(self) -> list[tuple[str, dict[str, str], float]]:
        """Per open session, labelled `session` (its session_id), for Prometheus (docs/metrics.md): env
        steps, episodes finished, seconds its replies were held, env copies, and the mean return of its
        last RECENT_RETURNS episodes. Called from the exporter's thread: reads a copy of the table."""
        out: list[tuple[str, dict[str, str], float]] = []
        for s in list(self.sessions.values()):
            labels, ep = {"session": s.session_id, **({"policy": self.policy} if self.policy else {})}, s.episodes
            out += [("actor/session_env_steps_total", labels, float(ep.env_steps)),
                    ("actor/session_episodes_total", labels, float(ep.finished)),
                    ("actor/session_held_seconds_total", labels, s.held_s),
                    ("actor/session_envs", labels, float(s.num_envs))]
            if recent := list(ep.recent):
                out.append(("actor/session_return_mean", labels, sum(recent) / len(recent)))
        return out

    # -- hello -------------------------------------------------------------------------------------
    def open(self, hello: actor_pb2.EnvHello) -> tuple[Session, bool]:
        """Validate a hello against the policy's spaces and open (or resume) its session."""
        if self.closing:
            raise SessionError("UNAVAILABLE", "the actor is shutting down")
        try:
            check = self._check_hello(hello)
        except SessionError:
            self.metrics.inc("actor/sessions_refused_total")
            raise
        if (old := self.sessions.get(hello.session_id)) is not None:
            # A reconnect that raced the end of its broken stream: the new stream takes over.
            self.close(old, "replaced")
            self.metrics.inc("actor/sessions_replaced_total")
        if len(self.sessions) >= self.cfg.actor.max_sessions:
            self.metrics.inc("actor/sessions_refused_total")
            raise SessionError("RESOURCE_EXHAUSTED", f"this actor already holds {len(self.sessions)} sessions "
                                                     f"(actor.max_sessions)")
        self._expire_parked()
        parked = self._parked.pop(hello.session_id, None)
        ids = tuple(hello.agent_ids)
        n = len(ids) or hello.num_envs
        resumed = parked is not None and len(parked.returns) == n and parked.agent_ids == ids
        episodes = parked if resumed else _Episodes(np.zeros(n), np.zeros(n, np.int64), agent_ids=ids)
        if not resumed and self.state_size:
            episodes.state = np.zeros((n, self.state_size), np.float32)
        elif resumed and episodes.acted_from is not None:   # the state its last actions were chosen from
            episodes.state = episodes.acted_from
        episodes.closed_at = None
        session = Session(hello.session_id, n, episodes, self._next_env_id, self.cfg.rollout_steps, check=check)
        if ids:
            session.index = {agent: i for i, agent in enumerate(ids)}
            session.left, session.seen = np.zeros(n, bool), np.zeros(n, bool)
        self._next_env_id += n
        self._new_buffers(session)
        self.sessions[session.session_id] = session
        self.metrics.inc("actor/sessions_total")
        self.metrics.inc("actor/sessions_resumed_total", int(resumed))
        self.metrics.set("actor/sessions_active", len(self.sessions))
        return session, resumed

    def _check_hello(self, hello: actor_pb2.EnvHello) -> Check:
        """Refuse a hello that does not fit the policy (SessionError); the check of its observations."""
        if not 0 < len(hello.session_id) <= MAX_ID_LEN:
            raise SessionError("INVALID_ARGUMENT", f"session_id: must be 1..{MAX_ID_LEN} characters")
        if hello.agent_ids:
            self._check_agent_ids(hello)
        elif not 0 < hello.num_envs <= MAX_ENVS:
            raise SessionError("INVALID_ARGUMENT", f"num_envs: {hello.num_envs} is outside 1..{MAX_ENVS}")
        self._check_observation_space(hello.observation_space)
        want = self.spec.action
        try:
            got = spaces.from_proto(hello.action_space)
        except TensorError as err:
            raise SessionError("INVALID_ARGUMENT", f"{err} (this actor's policy acts in {want})") from None
        if not _same_action_space(got, want):
            raise SessionError("INVALID_ARGUMENT", f"action_space: expected {want}, got {got}")
        try:
            return Check.from_hello(hello.observation_space, self.spec.obs_shape, self.spec.obs_dtype,
                                    bounds=self.cfg.actor.check_obs_bounds)
        except TensorError as err:
            raise SessionError("INVALID_ARGUMENT", str(err)) from None

    def _check_agent_ids(self, hello: actor_pb2.EnvHello) -> None:
        ids, patterns = hello.agent_ids, {name: p.agents for name, p in self.cfg.policies.items()}
        if len(ids) > MAX_ENVS:
            raise SessionError("INVALID_ARGUMENT", f"agent_ids: {len(ids)} agents, more than {MAX_ENVS}")
        first: dict[str, int] = {}
        for i, agent in enumerate(ids):
            if not 0 < len(agent) <= MAX_ID_LEN:
                raise SessionError("INVALID_ARGUMENT", f"agent_ids[{i}]: must be 1..{MAX_ID_LEN} characters")
            if agent in first:
                raise SessionError("INVALID_ARGUMENT", f"agent_ids[{i}]: {agent!r} is agent_ids[{first[agent]}] too")
            first[agent] = i
            if self.policy and (owner := policy_of(patterns, agent)) != self.policy:
                raise SessionError("INVALID_ARGUMENT", f"agent_ids[{i}]: {agent!r} is played by "
                                   + (f"policy {owner!r} (policies.{owner}.agents)" if owner else
                                      "no policy (it matches no policies.<name>.agents pattern)")
                                   + f", not this session's policy {self.policy!r}: open a session per policy")
        if hello.num_envs not in (0, len(ids)):
            raise SessionError("INVALID_ARGUMENT", f"num_envs: {hello.num_envs}, but agent_ids names {len(ids)} "
                                                   f"agents (0, or their count)")

    def _check_observation_space(self, obs) -> None:
        """The hello's observation space must be the policy's input: the same Box, Discrete or
        MultiDiscrete, or a Dict with the policy's layout (or, where the policy's keys are not known,
        with its flattened size). A Dict with Discrete keys cannot be declared in a hello (its
        DictSpace holds Boxes only)."""
        spec, kind = self.spec, obs.WhichOneof("kind")
        want = spaces.describe_observation(spec)
        if kind in ("discrete", "multi_discrete"):
            try:
                got = spaces.observation_space(spaces.from_proto(obs, "observation_space"), "observation_space")
            except (TensorError, ValueError) as err:
                raise SessionError("INVALID_ARGUMENT", str(err)) from None
            if got != spec.discrete_obs:
                raise SessionError("INVALID_ARGUMENT", f"observation_space: expected {want}, got {got}")
            return
        if spec.obs_categories:
            raise SessionError("INVALID_ARGUMENT", f"observation_space: expected {want}, got {kind or 'nothing'}" + (
                " (a Dict with Discrete keys cannot be declared over EnvSession yet: its DictSpace holds Boxes)"
                if spec.obs_keys is not None else ""))
        if kind == "box":
            try:
                got_dtype = numpy_dtype(obs.box.dtype, "observation_space.box.dtype")
            except TensorError as err:
                raise SessionError("INVALID_ARGUMENT", str(err)) from None
            if tuple(obs.box.shape) != spec.obs_shape or got_dtype != spec.obs_dtype:
                raise SessionError("INVALID_ARGUMENT", f"observation_space: expected {want}, got "
                                                       f"Box{list(obs.box.shape)} {got_dtype.name}")
            return
        if kind != "dict":
            raise SessionError("INVALID_ARGUMENT", f"observation_space: expected {want}, got {kind or 'nothing'}")
        try:
            layout = spaces.dict_layout_from_proto(obs.dict)
        except TensorError as err:
            raise SessionError("INVALID_ARGUMENT", str(err)) from None
        if spec.obs_keys is not None:
            ok = layout == spec.obs_keys
        else:
            ok = (len(spec.obs_shape) == 1 and spec.obs_dtype == np.float32
                  and spaces.flat_size(layout) == spec.obs_shape[0])
        if not ok:
            raise SessionError("INVALID_ARGUMENT", f"observation_space: expected {want}, got "
                                                   f"{spaces.describe(layout)} ({spaces.flat_size(layout)} "
                                                   f"values flattened)")

    def _new_buffers(self, s: Session) -> None:
        s.t, s.final_obs, s.final_index, s.versions, s.masked = 0, [], [], [], False
        if not self.records:
            return
        T, N, shape = s.T, s.num_envs, self.spec.obs_shape
        s.buffers = {"obs": np.empty((T + 1, N, *shape), self.spec.obs_dtype),
                     "actions": np.empty((T, N, *self.spec.action.shape), self.spec.action.dtype),
                     "rewards": np.empty((T, N), np.float32),
                     "terminated": np.zeros((T, N), bool), "truncated": np.zeros((T, N), bool),
                     **{name: np.empty((T, N), np.float32) for name in self.extras.steps}}
        if s.episodes.state is not None:   # the state each env starts the fragment from
            s.buffers.update({name: s.episodes.state.copy() for name in self.extras.start})
        if self.masks:
            s.buffers["action_mask"] = np.ones((T, N, self.spec.action.mask_width), bool)
        if s.agents:   # which slots acted at each step; the observations of absent ones are zeros, not garbage
            s.buffers["present"] = np.zeros((T, N), bool)
            s.buffers["obs"] = np.zeros((T + 1, N, *shape), self.spec.obs_dtype)

    # -- steps -------------------------------------------------------------------------------------
    def observe(self, s: Session, step: actor_pb2.EnvStep) -> np.ndarray:
        """Validate a step and record the outcome of the previous actions; return the observations
        to act on. Raises SessionError (the session must end) for anything malformed.

        One intake for every session: its rows are the step's agents (a session of several agents,
        module docstring), or every env copy at every step; the outcomes are those of the rows that
        acted on the step before."""
        s.last_seen = time.monotonic()
        if self.sessions.get(s.session_id) is not s:
            raise ended_error(s)
        sid = step.step_id
        if sid != s.next_step:
            raise SessionError("FAILED_PRECONDITION", f"step_id: expected {s.next_step}, got {sid} "
                                                      f"(one step at a time, starting at 0)")
        N = s.num_envs
        if step.no_agents and not s.agents:
            raise SessionError("INVALID_ARGUMENT", f"step {sid}: no_agents: only a session of several agents "
                                                   f"(hello.agent_ids) has a step of no agents")
        rows, names = self._agent_rows(s, step) if s.agents else (s.all_rows, None)
        s.mask = self._mask(s, step, rows) if step.HasField("action_masks") else None
        # The rows that acted on the step before: none on step 0 or after a step of no agents (K = 0).
        prev = s.rows if sid > 0 and s.rows is not None else rows[:0]
        K = len(prev)
        what = "agent" if s.agents else "env"
        rewards = term = trunc = final = None
        done = prev[:0]
        try:
            # (with no rows, absent tensors are empty ones: a step of no agents, the outcomes of no agents)
            obs = self._tensor(step, "observations", (len(rows), *self.spec.obs_shape), self.spec.obs_dtype)
            if sid > 0:
                rewards = self._tensor(step, "rewards", (K,), np.dtype(np.float32))
                term = self._tensor(step, "terminated", (K,), np.dtype(bool))
                trunc = self._tensor(step, "truncated", (K,), np.dtype(bool))
                done = np.flatnonzero(term | trunc)
                if len(done):
                    final = self._tensor(step, "final_observations", (len(done), *self.spec.obs_shape),
                                         self.spec.obs_dtype)
                elif step.HasField("final_observations") and step.final_observations.shape and \
                        step.final_observations.shape[0]:
                    raise TensorError("final_observations", f"given, but no {what} ended")
        except TensorError as err:
            raise SessionError("INVALID_ARGUMENT", f"step {sid}: {err}" + (
                " (rewards, terminated, truncated and final_observations are of the agents that acted on the step "
                "before)" if s.agents else "")) from None
        if s.agents:
            assert names is not None
            self._check_returns(s, step, rows, names, set(prev[done].tolist()))
        self._refuse_bad(s, sid, obs, rows, prev, rewards, final, done)
        if s.agents and sid > 0:
            assert term is not None and trunc is not None
            acting = set(rows.tolist())
            for slot in prev[~(term | trunc)]:
                if slot not in acting:
                    raise SessionError("INVALID_ARGUMENT", f"step {sid}: agents: {s.episodes.agent_ids[slot]!r} "
                                                           f"acted on step {sid - 1} and did not end, so it must act "
                                                           f"on this step (end it with terminated or truncated first)"
                                                           + (" (no_agents: no agent acts)" if step.no_agents else ""))
        if K and s.episodes.state is not None:
            s.episodes.state[prev[done]] = 0.0   # these act on an episode's first observation next
        # (every row at every step: slices, not an index array)
        at, before = (rows, prev) if s.agents else (slice(None), slice(None))
        if self.records:
            b, t = s.buffers, s.t
            if K:   # the outcomes of row t's actions; these observations go one row on
                b["rewards"][t, before], b["terminated"][t, before], b["truncated"][t, before] = rewards, term, trunc
                for k, i in enumerate(done):
                    s.final_obs.append(final[k])
                    s.final_index.append(t * N + int(prev[i]))
                b["obs"][t + 1, at] = obs
            else:   # step 0, or the step after one of no agents: these observations start row t
                b["obs"][t, at] = obs
        if K:
            ep = s.episodes
            ep.returns[before] += rewards
            ep.lengths[before] += 1
            for slot in prev[done]:
                self._finish_episode(ep, int(slot))
            if s.left is not None:
                s.left[prev[done]] = True     # ended: gone, unless it acts on this step (its next episode)
            self.env_steps += K
            ep.env_steps += K
            self.metrics.inc("actor/env_steps_total", K)
        if s.left is not None and s.seen is not None:
            s.left[rows], s.seen[rows] = False, True
        s.rows = rows
        if self.records and K:
            s.t += 1
            if s.t == s.T:
                self._emit(s, s.t)
                s.buffers["obs"][0, at] = obs
        return obs

    def _agent_rows(self, s: Session, step: actor_pb2.EnvStep) -> tuple[np.ndarray, list[str]]:
        """The slots of the step's `agents` in row order, and their names (none with `no_agents`);
        SessionError naming the agent and the field for an id not in hello.agent_ids or named twice."""
        if step.no_agents and step.agents:
            raise SessionError("INVALID_ARGUMENT", f"step {step.step_id}: agents: names {len(step.agents)} agents "
                                                   f"({step.agents[0]!r} first), but no_agents says none acts")
        names = [] if step.no_agents else list(step.agents) or list(s.index)
        rows = np.empty(len(names), np.int64)
        seen: dict[int, int] = {}
        for i, agent in enumerate(names):
            slot = s.index.get(agent)
            if slot is None:
                raise SessionError("INVALID_ARGUMENT", f"step {step.step_id}: agents[{i}]: {agent!r} is not one "
                                                       f"of hello.agent_ids")
            if slot in seen:
                raise SessionError("INVALID_ARGUMENT", f"step {step.step_id}: agents[{i}]: {agent!r} is "
                                                       f"agents[{seen[slot]}] too")
            seen[slot] = i
            rows[i] = slot
        return rows, names

    def _check_returns(self, s: Session, step: actor_pb2.EnvStep, rows: np.ndarray, names: list[str],
                       ended_now: set[int]) -> None:
        """`joined` names agents of this step that ended (on this step or before), never one on its first
        step of the stream; an agent that left (ended on an earlier step and was absent since) acts
        again only when joined. SessionError naming the agent and the field otherwise."""
        sid, acting = step.step_id, set(rows.tolist())
        assert s.left is not None and s.seen is not None
        joining = set()
        for i, agent in enumerate(step.joined):
            slot = s.index.get(agent)
            if slot is None:
                raise SessionError("INVALID_ARGUMENT", f"step {sid}: joined[{i}]: {agent!r} is not one of "
                                                       f"hello.agent_ids")
            if slot not in acting:
                raise SessionError("INVALID_ARGUMENT", f"step {sid}: joined[{i}]: {agent!r} joins but is not in "
                                                       f"agents (a joining agent acts on the step it joins)")
            if not s.seen[slot]:
                raise SessionError("INVALID_ARGUMENT", f"step {sid}: joined[{i}]: {agent!r} must not be joined on "
                                                       f"its first step of the stream (a first step takes no join: "
                                                       f"joined is for an agent back after its episode ended)")
            if not s.left[slot] and slot not in ended_now:
                raise SessionError("INVALID_ARGUMENT", f"step {sid}: joined[{i}]: {agent!r} has not ended (only an "
                                                       f"agent whose episode ended joins again)")
            joining.add(slot)
        for i, slot in enumerate(rows):   # (one that ends on this step may act on: its next episode)
            if s.left[slot] and slot not in joining:
                raise SessionError("INVALID_ARGUMENT", f"step {sid}: agents[{i}]: {names[i]!r} left after its "
                                                       f"episode ended; it acts again only when listed in joined")

    def _refuse_bad(self, s: Session, step_id: int, obs: np.ndarray, rows: np.ndarray, prev: np.ndarray,
                    rewards: np.ndarray | None = None, final: np.ndarray | None = None,
                    done: np.ndarray | None = None) -> None:
        """SessionError INVALID_ARGUMENT naming the field and the env copy (a session of several agents:
        the agent's id), counted, if the step holds NaN or infinity, a Discrete observation outside 0..n-1,
        or an observation outside its declared bounds (actor.check_obs_bounds). `rows`: the slots of `obs`; `prev`: those of
        `rewards`, and of `final` through `done` (positions in `prev`)."""
        bad, slots = s.check.find(obs), rows
        if bad is None and rewards is not None:
            bad, slots = FINITE.find(rewards, "rewards"), prev
        if bad is None and final is not None:
            bad, slots = s.check.find(final, "final_observations", envs=done), prev
        if bad is None:
            return
        self.metrics.inc(bad.metric)
        if s.agents:   # (a row named by its agent, not as "env k")
            bad = dataclasses.replace(bad, who=f"agent {s.episodes.agent_ids[int(slots[bad.env])]!r}")
        raise SessionError("INVALID_ARGUMENT", f"step {step_id}: {bad}")

    def _mask(self, s: Session, step, rows: np.ndarray) -> np.ndarray:
        """The step's action masks (one row per `rows`), checked against the action space; SessionError if
        they cannot be used (naming the agent of a row that allows nothing, in a session of several agents)."""
        space = self.spec.action
        if not space.mask_width:
            raise SessionError("INVALID_ARGUMENT", f"step {step.step_id}: action_masks: {space} actions take no mask")
        if not self.algorithm.takes_action_masks:
            raise SessionError("INVALID_ARGUMENT", f"step {step.step_id}: action_masks: algorithm "
                                                   f"{self.algorithm.name} does not take action masks")
        mask = None
        try:
            mask = decode(step.action_masks, "action_masks")
            spaces.check_mask(space, mask, (len(rows),), "action_masks")
        except TensorError as err:
            raise SessionError("INVALID_ARGUMENT", f"step {step.step_id}: {err}" + (
                self._masked_out(s, mask, rows) if s.agents and mask is not None else "")) from None
        return mask

    def _masked_out(self, s: Session, mask: np.ndarray, rows: np.ndarray) -> str:
        """The first row of a well-formed mask that allows nothing, as " (agent 'x', row k)"; "" if none."""
        if mask.shape != (len(rows), self.spec.action.mask_width) or mask.dtype != np.bool_:
            return ""
        for k in range(len(rows)):
            try:
                spaces.check_mask(self.spec.action, mask[k:k + 1], (1,))
            except TensorError:
                return f" (agent {s.episodes.agent_ids[int(rows[k])]!r}, row {k})"
        return ""

    def _tensor(self, step, name: str, shape: tuple, dtype: np.dtype) -> np.ndarray:
        if not step.HasField(name):
            if shape[0] == 0:   # (no rows: a step of no agents, or the outcomes of none)
                return np.empty(shape, dtype)
            raise TensorError(name, "is required but missing")
        arr = decode(getattr(step, name), name)
        if arr.shape != shape or arr.dtype != dtype:
            raise TensorError(name, f"must be {dtype.name} {list(shape)}, got {arr.dtype.name} {list(arr.shape)}")
        return arr

    def state_of(self, s: Session) -> np.ndarray | None:
        """A recurrent policy's state of the rows about to be acted on (`observe`'s), None if stateless."""
        state = s.episodes.state
        return None if state is None else state[s.rows] if s.agents else state

    def record_actions(self, s: Session, actions: np.ndarray, extras: dict[str, np.ndarray], version: int,
                       state: np.ndarray | None = None) -> None:
        """Store the actions chosen for the session's current observations, with what the algorithm
        recorded while choosing them (`Algorithm.extras`), and a recurrent policy's `state` after them.
        Serving only: just the step count and the state."""
        s.next_step += 1
        if state is not None and s.ended is None and s.episodes.state is not None:
            if s.agents:   # (the step's agents' rows; the others keep theirs)
                s.episodes.acted_from = s.episodes.state.copy()
                s.episodes.state[s.rows] = state
            else:
                s.episodes.acted_from, s.episodes.state = s.episodes.state, state
        if not self.records or s.ended is not None:
            return  # (closed while its actions were chosen: its arrays went to the encoder with its last fragment)
        if s.agents and not len(s.rows):
            return  # a step of no agents takes no row: the next step's agents fill this one
        at = slice(None) if not s.agents else s.rows    # a session of several agents: the step's agents' slots
        s.buffers["actions"][s.t, at] = actions
        if s.agents:
            s.buffers["present"][s.t, at] = True
        if self.masks:
            s.buffers["action_mask"][s.t, at] = True if s.mask is None else s.mask
            s.masked |= s.mask is not None
        for name in self.extras.steps:
            s.buffers[name][s.t, at] = extras[name]
        s.versions.append(version)

    def to_send(self, actions: np.ndarray) -> np.ndarray:
        """Actions as the simulator receives them: int64 for discrete spaces, float32 clipped to the
        declared bounds for a Box (the fragment keeps the unclipped sample the log-prob is of)."""
        space = self.spec.action
        if isinstance(space, spaces.Box):
            return space.clip(actions).astype(np.float32, copy=False)
        return actions.astype(np.int64, copy=False)

    def _finish_episode(self, ep: _Episodes, i: int) -> None:
        self.episodes.finish(ep.returns[i], ep.lengths[i], self.env_steps,
                             int(self.metrics.gauges.get(self.metrics.scope_name("actor/policy_version"), 0)),
                             policy=self.policy)
        ep.finished += 1
        ep.recent.append(float(ep.returns[i]))
        ep.returns[i], ep.lengths[i] = 0.0, 0

    def _emit(self, s: Session, t: int, last: bool = False) -> None:
        """Cut the session's first t transitions as a fragment (a session of several agents: one per run
        of steps of a set of its agents, windows.py's `window_groups`) and start anew (not if `last`)."""
        b, N = s.buffers, s.num_envs
        common = dict(actor_id=self.actor_id, incarnation=self.incarnation, policy_version=min(s.versions[:t]),
                      algorithm=self.algorithm.code)
        cuts = []
        for a, end, cols, picked in window_groups(b["present"] if s.agents else None, t, N, s.final_index):
            cuts.append(dict(
                common, seq=self.seq + len(cuts), created_unix_s=time.time(), env_ids=(s.env_id_base + cols).tolist(),
                obs=b["obs"][a:end + 1, cols], actions=b["actions"][a:end, cols], rewards=b["rewards"][a:end, cols],
                terminated=b["terminated"][a:end, cols], truncated=b["truncated"][a:end, cols],
                final_obs=(np.stack([s.final_obs[k] for k, _ in picked]) if picked
                           else np.empty((0, *self.spec.obs_shape), self.spec.obs_dtype)),
                final_index=np.asarray([i for _, i in picked], np.int64),
                action_mask=b["action_mask"][a:end, cols] if s.masked else None,
                extras={**{name: b[name][a:end, cols] for name in self.extras.steps},
                        # (a run that starts after the window's first step is an agent's new life: a fresh state)
                        **{name: b[name][cols] if a == 0 else np.zeros_like(b[name][cols])
                           for name in self.extras.start}}))
        for fields in cuts:
            if self.on_cut is not None:
                self.on_cut(self.seq, (fields["actions"].shape[0]) * len(fields["env_ids"]))
            self.seq += 1
            self.metrics.inc("actor/fragments_total")
        # The filled arrays now belong to the encoder: the session goes on in fresh ones (a closed one in none).
        rest = s.versions[t:]
        if last:
            s.buffers, s.t, s.final_obs, s.final_index, s.versions, s.masked = {}, 0, [], [], [], False
        else:
            self._new_buffers(s)
            s.versions = rest
        assert self.on_fragment is not None  # (records: a hub without a sink never cuts)
        for fields in cuts:
            if self.encoder is not None:
                self.encoder.submit(fields, self.on_fragment)
            else:
                self.on_fragment(encode_fragment(**fields))

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every fragment cut so far has been handed to `on_fragment` (and end the encoder's
        thread: a later fragment starts it again); False if `timeout` passed first."""
        return self.encoder is None or self.encoder.close(timeout)

    def held(self, sessions: list[Session], seconds: float) -> None:
        """The replies of `sessions` were held `seconds` (by the rate limiter or on-policy pacing)."""
        for s in sessions:
            s.held_s += seconds

    # -- the end -----------------------------------------------------------------------------------
    def close(self, s: Session, reason: str) -> None:
        """End a session: flush its unfinished fragment (still-running episodes truncated at the last
        step, bootstrapped from the last observation) and park its episodes for a resume."""
        if self.sessions.get(s.session_id) is not s:
            return
        del self.sessions[s.session_id]
        s.ended = reason
        if s.t > 0:
            b, t, N = s.buffers, s.t, s.num_envs
            running = ~(b["terminated"][t - 1] | b["truncated"][t - 1])
            if s.agents:   # (the agents that acted on the last step recorded)
                running &= b["present"][t - 1]
            for i in np.flatnonzero(running):
                b["truncated"][t - 1, i] = True
                s.final_obs.append(b["obs"][t, i].copy())
                s.final_index.append((t - 1) * N + i)
            self._emit(s, t, last=True)
        s.episodes.closed_at = time.monotonic()
        self._parked[s.session_id] = s.episodes
        self.metrics.inc("actor/sessions_timed_out_total", int(reason == "timeout"))
        self.metrics.set("actor/sessions_active", len(self.sessions))

    def close_all(self) -> None:
        """Shutdown: refuse new sessions and close (flush) every open one."""
        self.closing = True
        for s in list(self.sessions.values()):
            self.close(s, "shutdown")

    def _expire_parked(self) -> None:
        now = time.monotonic()
        for sid in [k for k, ep in self._parked.items() if now - ep.closed_at > self.cfg.actor.session_resume_s]:
            del self._parked[sid]
