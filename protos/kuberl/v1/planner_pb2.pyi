from kuberl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecisionAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_ACTION_UNSPECIFIED: _ClassVar[DecisionAction]
    DECISION_ACTION_HOLD: _ClassVar[DecisionAction]
    DECISION_ACTION_SCALE: _ClassVar[DecisionAction]
    DECISION_ACTION_SUPPRESSED: _ClassVar[DecisionAction]
DECISION_ACTION_UNSPECIFIED: DecisionAction
DECISION_ACTION_HOLD: DecisionAction
DECISION_ACTION_SCALE: DecisionAction
DECISION_ACTION_SUPPRESSED: DecisionAction

class RoleDecision(_message.Message):
    __slots__ = ("role", "current", "target", "proposed", "ready", "reporting", "rate_per_replica", "stale", "blocked", "override", "cores_per_replica", "cost_per_replica", "ceiling")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REPORTING_FIELD_NUMBER: _ClassVar[int]
    RATE_PER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    CORES_PER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    COST_PER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    CEILING_FIELD_NUMBER: _ClassVar[int]
    role: str
    current: int
    target: int
    proposed: int
    ready: int
    reporting: int
    rate_per_replica: float
    stale: bool
    blocked: str
    override: int
    cores_per_replica: float
    cost_per_replica: float
    ceiling: int
    def __init__(self, role: _Optional[str] = ..., current: _Optional[int] = ..., target: _Optional[int] = ..., proposed: _Optional[int] = ..., ready: _Optional[int] = ..., reporting: _Optional[int] = ..., rate_per_replica: _Optional[float] = ..., stale: _Optional[bool] = ..., blocked: _Optional[str] = ..., override: _Optional[int] = ..., cores_per_replica: _Optional[float] = ..., cost_per_replica: _Optional[float] = ..., ceiling: _Optional[int] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("id", "unix_s", "action", "applied", "dry_run", "reason", "roles", "production", "consumption", "ratio", "planned_throughput", "replay_ratio", "tolerance", "budget", "trigger", "error", "backend", "policy_lag", "max_policy_lag", "buffer_samples_per_insert", "buffer_samples_received_per_s", "buffer_size_samples", "bottleneck", "bottleneck_evidence", "buffer_shards", "buffer_shards_target", "buffer_shards_reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    PRODUCTION_FIELD_NUMBER: _ClassVar[int]
    CONSUMPTION_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    PLANNED_THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_RATIO_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    POLICY_LAG_FIELD_NUMBER: _ClassVar[int]
    MAX_POLICY_LAG_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SAMPLES_PER_INSERT_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SAMPLES_RECEIVED_PER_S_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SIZE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BOTTLENECK_FIELD_NUMBER: _ClassVar[int]
    BOTTLENECK_EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SHARDS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SHARDS_TARGET_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SHARDS_REASON_FIELD_NUMBER: _ClassVar[int]
    id: int
    unix_s: float
    action: DecisionAction
    applied: bool
    dry_run: bool
    reason: str
    roles: _containers.RepeatedCompositeFieldContainer[RoleDecision]
    production: float
    consumption: float
    ratio: float
    planned_throughput: float
    replay_ratio: float
    tolerance: float
    budget: float
    trigger: str
    error: str
    backend: str
    policy_lag: float
    max_policy_lag: float
    buffer_samples_per_insert: float
    buffer_samples_received_per_s: float
    buffer_size_samples: float
    bottleneck: str
    bottleneck_evidence: str
    buffer_shards: int
    buffer_shards_target: int
    buffer_shards_reason: str
    def __init__(self, id: _Optional[int] = ..., unix_s: _Optional[float] = ..., action: _Optional[_Union[DecisionAction, str]] = ..., applied: _Optional[bool] = ..., dry_run: _Optional[bool] = ..., reason: _Optional[str] = ..., roles: _Optional[_Iterable[_Union[RoleDecision, _Mapping]]] = ..., production: _Optional[float] = ..., consumption: _Optional[float] = ..., ratio: _Optional[float] = ..., planned_throughput: _Optional[float] = ..., replay_ratio: _Optional[float] = ..., tolerance: _Optional[float] = ..., budget: _Optional[float] = ..., trigger: _Optional[str] = ..., error: _Optional[str] = ..., backend: _Optional[str] = ..., policy_lag: _Optional[float] = ..., max_policy_lag: _Optional[float] = ..., buffer_samples_per_insert: _Optional[float] = ..., buffer_samples_received_per_s: _Optional[float] = ..., buffer_size_samples: _Optional[float] = ..., bottleneck: _Optional[str] = ..., bottleneck_evidence: _Optional[str] = ..., buffer_shards: _Optional[int] = ..., buffer_shards_target: _Optional[int] = ..., buffer_shards_reason: _Optional[str] = ...) -> None: ...

class PreviewRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ApplyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetReplicasRequest(_message.Message):
    __slots__ = ("role", "replicas", "ttl_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    role: str
    replicas: int
    ttl_s: float
    def __init__(self, role: _Optional[str] = ..., replicas: _Optional[int] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ClearOverrideRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchDecisionsRequest(_message.Message):
    __slots__ = ("after_id",)
    AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    after_id: int
    def __init__(self, after_id: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Override(_message.Message):
    __slots__ = ("role", "replicas", "expires_unix_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    role: str
    replicas: int
    expires_unix_s: float
    def __init__(self, role: _Optional[str] = ..., replicas: _Optional[int] = ..., expires_unix_s: _Optional[float] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("role", "name", "address", "ready")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    role: str
    name: str
    address: str
    ready: bool
    def __init__(self, role: _Optional[str] = ..., name: _Optional[str] = ..., address: _Optional[str] = ..., ready: _Optional[bool] = ...) -> None: ...

class PlannerStatus(_message.Message):
    __slots__ = ("paused", "pause_reason", "backend", "leader", "overrides", "last_decision", "replicas")
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    PAUSE_REASON_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    pause_reason: str
    backend: str
    leader: bool
    overrides: _containers.RepeatedCompositeFieldContainer[Override]
    last_decision: Decision
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, paused: _Optional[bool] = ..., pause_reason: _Optional[str] = ..., backend: _Optional[str] = ..., leader: _Optional[bool] = ..., overrides: _Optional[_Iterable[_Union[Override, _Mapping]]] = ..., last_decision: _Optional[_Union[Decision, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...
