from kuberl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BufferTopology(_message.Message):
    __slots__ = ("generation", "addresses", "active")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    addresses: _containers.RepeatedScalarFieldContainer[str]
    active: int
    def __init__(self, generation: _Optional[int] = ..., addresses: _Optional[_Iterable[str]] = ..., active: _Optional[int] = ...) -> None: ...

class SetTopologyRequest(_message.Message):
    __slots__ = ("topology", "shard")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    topology: BufferTopology
    shard: int
    def __init__(self, topology: _Optional[_Union[BufferTopology, _Mapping]] = ..., shard: _Optional[int] = ...) -> None: ...

class TopologyAck(_message.Message):
    __slots__ = ("generation", "draining", "drained", "actors_live", "size_samples", "topology")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    ACTORS_LIVE_FIELD_NUMBER: _ClassVar[int]
    SIZE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    generation: int
    draining: bool
    drained: bool
    actors_live: int
    size_samples: int
    topology: BufferTopology
    def __init__(self, generation: _Optional[int] = ..., draining: _Optional[bool] = ..., drained: _Optional[bool] = ..., actors_live: _Optional[int] = ..., size_samples: _Optional[int] = ..., topology: _Optional[_Union[BufferTopology, _Mapping]] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("accepted", "duplicates", "rejected", "last_accepted_seq", "high_water_seq")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCEPTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATER_SEQ_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    rejected: int
    last_accepted_seq: int
    high_water_seq: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., rejected: _Optional[int] = ..., last_accepted_seq: _Optional[int] = ..., high_water_seq: _Optional[int] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("learner_id", "algorithm", "batch_size", "max_batches")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHES_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    algorithm: _common_pb2.Algorithm
    batch_size: int
    max_batches: int
    def __init__(self, learner_id: _Optional[str] = ..., algorithm: _Optional[_Union[_common_pb2.Algorithm, str]] = ..., batch_size: _Optional[int] = ..., max_batches: _Optional[int] = ...) -> None: ...

class LearnerProgress(_message.Message):
    __slots__ = ("learner_id", "policy_version", "samples_consumed_total", "batches_consumed_total")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_CONSUMED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BATCHES_CONSUMED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    policy_version: int
    samples_consumed_total: int
    batches_consumed_total: int
    def __init__(self, learner_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., samples_consumed_total: _Optional[int] = ..., batches_consumed_total: _Optional[int] = ...) -> None: ...

class ProgressAck(_message.Message):
    __slots__ = ("samples_inserted_total", "warmup_samples", "topology")
    SAMPLES_INSERTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WARMUP_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    samples_inserted_total: int
    warmup_samples: int
    topology: BufferTopology
    def __init__(self, samples_inserted_total: _Optional[int] = ..., warmup_samples: _Optional[int] = ..., topology: _Optional[_Union[BufferTopology, _Mapping]] = ...) -> None: ...

class InsertLimitRequest(_message.Message):
    __slots__ = ("actor_id", "incarnation")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    incarnation: int
    def __init__(self, actor_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class InsertLimit(_message.Message):
    __slots__ = ("samples_inserted_total", "insert_limit_samples", "high_water_seq", "samples_served_total", "replay_ratio_target", "topology")
    SAMPLES_INSERTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    INSERT_LIMIT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATER_SEQ_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SERVED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REPLAY_RATIO_TARGET_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    samples_inserted_total: int
    insert_limit_samples: int
    high_water_seq: int
    samples_served_total: int
    replay_ratio_target: float
    topology: BufferTopology
    def __init__(self, samples_inserted_total: _Optional[int] = ..., insert_limit_samples: _Optional[int] = ..., high_water_seq: _Optional[int] = ..., samples_served_total: _Optional[int] = ..., replay_ratio_target: _Optional[float] = ..., topology: _Optional[_Union[BufferTopology, _Mapping]] = ...) -> None: ...
