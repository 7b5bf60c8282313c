from kuberl.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WeightsRequest(_message.Message):
    __slots__ = ("subscriber_id", "after_version")
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    subscriber_id: str
    after_version: int
    def __init__(self, subscriber_id: _Optional[str] = ..., after_version: _Optional[int] = ...) -> None: ...
