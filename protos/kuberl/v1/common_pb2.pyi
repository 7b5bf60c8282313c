from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class Algorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALGORITHM_UNSPECIFIED: _ClassVar[Algorithm]
    ALGORITHM_DQN: _ClassVar[Algorithm]
    ALGORITHM_PPO: _ClassVar[Algorithm]
    ALGORITHM_SAC: _ClassVar[Algorithm]
DTYPE_UNSPECIFIED: DType
DTYPE_UINT8: DType
DTYPE_INT8: DType
DTYPE_INT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_FLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_BOOL: DType
ALGORITHM_UNSPECIFIED: Algorithm
ALGORITHM_DQN: Algorithm
ALGORITHM_PPO: Algorithm
ALGORITHM_SAC: Algorithm

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TrajectoryFragment(_message.Message):
    __slots__ = ("actor_id", "seq", "policy_version", "algorithm", "env_ids", "num_steps", "incarnation", "obs", "actions", "rewards", "terminated", "truncated", "final_obs", "final_index", "action_mask", "extras", "created_unix_s")
    class ExtrasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    ENV_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    OBS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FINAL_OBS_FIELD_NUMBER: _ClassVar[int]
    FINAL_INDEX_FIELD_NUMBER: _ClassVar[int]
    ACTION_MASK_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    seq: int
    policy_version: int
    algorithm: Algorithm
    env_ids: _containers.RepeatedScalarFieldContainer[int]
    num_steps: int
    incarnation: int
    obs: Tensor
    actions: Tensor
    rewards: Tensor
    terminated: Tensor
    truncated: Tensor
    final_obs: Tensor
    final_index: Tensor
    action_mask: Tensor
    extras: _containers.MessageMap[str, Tensor]
    created_unix_s: float
    def __init__(self, actor_id: _Optional[str] = ..., seq: _Optional[int] = ..., policy_version: _Optional[int] = ..., algorithm: _Optional[_Union[Algorithm, str]] = ..., env_ids: _Optional[_Iterable[int]] = ..., num_steps: _Optional[int] = ..., incarnation: _Optional[int] = ..., obs: _Optional[_Union[Tensor, _Mapping]] = ..., actions: _Optional[_Union[Tensor, _Mapping]] = ..., rewards: _Optional[_Union[Tensor, _Mapping]] = ..., terminated: _Optional[_Union[Tensor, _Mapping]] = ..., truncated: _Optional[_Union[Tensor, _Mapping]] = ..., final_obs: _Optional[_Union[Tensor, _Mapping]] = ..., final_index: _Optional[_Union[Tensor, _Mapping]] = ..., action_mask: _Optional[_Union[Tensor, _Mapping]] = ..., extras: _Optional[_Mapping[str, Tensor]] = ..., created_unix_s: _Optional[float] = ...) -> None: ...

class TransitionBatch(_message.Message):
    __slots__ = ("obs", "actions", "rewards", "next_obs", "terminated", "policy_version", "discount")
    OBS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_OBS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DISCOUNT_FIELD_NUMBER: _ClassVar[int]
    obs: Tensor
    actions: Tensor
    rewards: Tensor
    next_obs: Tensor
    terminated: Tensor
    policy_version: Tensor
    discount: Tensor
    def __init__(self, obs: _Optional[_Union[Tensor, _Mapping]] = ..., actions: _Optional[_Union[Tensor, _Mapping]] = ..., rewards: _Optional[_Union[Tensor, _Mapping]] = ..., next_obs: _Optional[_Union[Tensor, _Mapping]] = ..., terminated: _Optional[_Union[Tensor, _Mapping]] = ..., policy_version: _Optional[_Union[Tensor, _Mapping]] = ..., discount: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RolloutBatch(_message.Message):
    __slots__ = ("fragments",)
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    fragments: _containers.RepeatedCompositeFieldContainer[TrajectoryFragment]
    def __init__(self, fragments: _Optional[_Iterable[_Union[TrajectoryFragment, _Mapping]]] = ...) -> None: ...

class TrainingBatch(_message.Message):
    __slots__ = ("batch_id", "transitions", "rollouts", "buffer_inserted_total", "buffer_size")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_INSERTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SIZE_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    transitions: TransitionBatch
    rollouts: RolloutBatch
    buffer_inserted_total: int
    buffer_size: int
    def __init__(self, batch_id: _Optional[int] = ..., transitions: _Optional[_Union[TransitionBatch, _Mapping]] = ..., rollouts: _Optional[_Union[RolloutBatch, _Mapping]] = ..., buffer_inserted_total: _Optional[int] = ..., buffer_size: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ...) -> None: ...

class Weights(_message.Message):
    __slots__ = ("version", "checksum", "chunk_index", "num_chunks", "total_bytes", "specs", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    checksum: str
    chunk_index: int
    num_chunks: int
    total_bytes: int
    specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    data: bytes
    def __init__(self, version: _Optional[int] = ..., checksum: _Optional[str] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ..., total_bytes: _Optional[int] = ..., specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Episode(_message.Message):
    __slots__ = ("index", "episode_return", "length", "actor_env_steps", "policy_version", "end_unix_s", "policy")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    EPISODE_RETURN_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACTOR_ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    index: int
    episode_return: float
    length: int
    actor_env_steps: int
    policy_version: int
    end_unix_s: float
    policy: str
    def __init__(self, index: _Optional[int] = ..., episode_return: _Optional[float] = ..., length: _Optional[int] = ..., actor_env_steps: _Optional[int] = ..., policy_version: _Optional[int] = ..., end_unix_s: _Optional[float] = ..., policy: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("episodes_after", "max_episodes")
    EPISODES_AFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODES_FIELD_NUMBER: _ClassVar[int]
    episodes_after: int
    max_episodes: int
    def __init__(self, episodes_after: _Optional[int] = ..., max_episodes: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("role", "instance_id", "heartbeat_unix_s", "uptime_s", "metrics", "episodes", "episodes_remaining", "episodes_skipped", "oldest_episode_index", "process_start_unix_s")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    EPISODES_REMAINING_FIELD_NUMBER: _ClassVar[int]
    EPISODES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_EPISODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROCESS_START_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    role: str
    instance_id: str
    heartbeat_unix_s: float
    uptime_s: float
    metrics: _containers.ScalarMap[str, float]
    episodes: _containers.RepeatedCompositeFieldContainer[Episode]
    episodes_remaining: int
    episodes_skipped: int
    oldest_episode_index: int
    process_start_unix_s: float
    def __init__(self, role: _Optional[str] = ..., instance_id: _Optional[str] = ..., heartbeat_unix_s: _Optional[float] = ..., uptime_s: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., episodes: _Optional[_Iterable[_Union[Episode, _Mapping]]] = ..., episodes_remaining: _Optional[int] = ..., episodes_skipped: _Optional[int] = ..., oldest_episode_index: _Optional[int] = ..., process_start_unix_s: _Optional[float] = ...) -> None: ...
