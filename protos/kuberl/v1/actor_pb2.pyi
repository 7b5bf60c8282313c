from kuberl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BoxSpace(_message.Message):
    __slots__ = ("shape", "dtype", "low", "high")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: _common_pb2.DType
    low: _containers.RepeatedScalarFieldContainer[float]
    high: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., low: _Optional[_Iterable[float]] = ..., high: _Optional[_Iterable[float]] = ...) -> None: ...

class DiscreteSpace(_message.Message):
    __slots__ = ("n",)
    N_FIELD_NUMBER: _ClassVar[int]
    n: int
    def __init__(self, n: _Optional[int] = ...) -> None: ...

class MultiDiscreteSpace(_message.Message):
    __slots__ = ("nvec",)
    NVEC_FIELD_NUMBER: _ClassVar[int]
    nvec: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, nvec: _Optional[_Iterable[int]] = ...) -> None: ...

class DictSpace(_message.Message):
    __slots__ = ("spaces",)
    class SpacesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: BoxSpace
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[BoxSpace, _Mapping]] = ...) -> None: ...
    SPACES_FIELD_NUMBER: _ClassVar[int]
    spaces: _containers.MessageMap[str, BoxSpace]
    def __init__(self, spaces: _Optional[_Mapping[str, BoxSpace]] = ...) -> None: ...

class Space(_message.Message):
    __slots__ = ("box", "discrete", "multi_discrete", "dict")
    BOX_FIELD_NUMBER: _ClassVar[int]
    DISCRETE_FIELD_NUMBER: _ClassVar[int]
    MULTI_DISCRETE_FIELD_NUMBER: _ClassVar[int]
    DICT_FIELD_NUMBER: _ClassVar[int]
    box: BoxSpace
    discrete: DiscreteSpace
    multi_discrete: MultiDiscreteSpace
    dict: DictSpace
    def __init__(self, box: _Optional[_Union[BoxSpace, _Mapping]] = ..., discrete: _Optional[_Union[DiscreteSpace, _Mapping]] = ..., multi_discrete: _Optional[_Union[MultiDiscreteSpace, _Mapping]] = ..., dict: _Optional[_Union[DictSpace, _Mapping]] = ...) -> None: ...

class EnvHello(_message.Message):
    __slots__ = ("session_id", "observation_space", "action_space", "num_envs", "simulator", "agent_ids", "policy")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_SPACE_FIELD_NUMBER: _ClassVar[int]
    ACTION_SPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    SIMULATOR_FIELD_NUMBER: _ClassVar[int]
    AGENT_IDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    observation_space: Space
    action_space: Space
    num_envs: int
    simulator: str
    agent_ids: _containers.RepeatedScalarFieldContainer[str]
    policy: str
    def __init__(self, session_id: _Optional[str] = ..., observation_space: _Optional[_Union[Space, _Mapping]] = ..., action_space: _Optional[_Union[Space, _Mapping]] = ..., num_envs: _Optional[int] = ..., simulator: _Optional[str] = ..., agent_ids: _Optional[_Iterable[str]] = ..., policy: _Optional[str] = ...) -> None: ...

class EnvStep(_message.Message):
    __slots__ = ("step_id", "observations", "rewards", "terminated", "truncated", "final_observations", "action_masks", "agents", "joined", "no_agents")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FINAL_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    ACTION_MASKS_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    NO_AGENTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    observations: _common_pb2.Tensor
    rewards: _common_pb2.Tensor
    terminated: _common_pb2.Tensor
    truncated: _common_pb2.Tensor
    final_observations: _common_pb2.Tensor
    action_masks: _common_pb2.Tensor
    agents: _containers.RepeatedScalarFieldContainer[str]
    joined: _containers.RepeatedScalarFieldContainer[str]
    no_agents: bool
    def __init__(self, step_id: _Optional[int] = ..., observations: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., rewards: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., terminated: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., truncated: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., final_observations: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., action_masks: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., agents: _Optional[_Iterable[str]] = ..., joined: _Optional[_Iterable[str]] = ..., no_agents: _Optional[bool] = ...) -> None: ...

class EnvMessage(_message.Message):
    __slots__ = ("hello", "step")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    hello: EnvHello
    step: EnvStep
    def __init__(self, hello: _Optional[_Union[EnvHello, _Mapping]] = ..., step: _Optional[_Union[EnvStep, _Mapping]] = ...) -> None: ...

class SessionAccepted(_message.Message):
    __slots__ = ("session_id", "resumed", "policy_version", "session_timeout_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    resumed: bool
    policy_version: int
    session_timeout_ms: int
    def __init__(self, session_id: _Optional[str] = ..., resumed: _Optional[bool] = ..., policy_version: _Optional[int] = ..., session_timeout_ms: _Optional[int] = ...) -> None: ...

class ActionReply(_message.Message):
    __slots__ = ("step_id", "actions", "policy_version", "held_ms")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_MS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    actions: _common_pb2.Tensor
    policy_version: int
    held_ms: int
    def __init__(self, step_id: _Optional[int] = ..., actions: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., policy_version: _Optional[int] = ..., held_ms: _Optional[int] = ...) -> None: ...

class ActorMessage(_message.Message):
    __slots__ = ("accepted", "actions")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    accepted: SessionAccepted
    actions: ActionReply
    def __init__(self, accepted: _Optional[_Union[SessionAccepted, _Mapping]] = ..., actions: _Optional[_Union[ActionReply, _Mapping]] = ...) -> None: ...
