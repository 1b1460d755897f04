from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Contribution(_message.Message):
    __slots__ = ("peer_id", "samples", "incarnation", "seq", "norm", "nonce", "reference")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NORM_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    samples: int
    incarnation: int
    seq: int
    norm: float
    nonce: bytes
    reference: float
    def __init__(self, peer_id: _Optional[str] = ..., samples: _Optional[int] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., norm: _Optional[float] = ..., nonce: _Optional[bytes] = ..., reference: _Optional[float] = ...) -> None: ...

class AverageHeader(_message.Message):
    __slots__ = ("run_id", "stage", "expert", "epoch", "attempt", "group", "sender", "total_elements")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    expert: str
    epoch: int
    attempt: int
    group: _containers.RepeatedScalarFieldContainer[str]
    sender: Contribution
    total_elements: int
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., expert: _Optional[str] = ..., epoch: _Optional[int] = ..., attempt: _Optional[int] = ..., group: _Optional[_Iterable[str]] = ..., sender: _Optional[_Union[Contribution, _Mapping]] = ..., total_elements: _Optional[int] = ...) -> None: ...

class AverageVerdict(_message.Message):
    __slots__ = ("ok", "lost", "reason", "gathered", "group", "stepped", "total_elements", "digest", "signature")
    OK_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GATHERED_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STEPPED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    lost: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    gathered: _containers.RepeatedCompositeFieldContainer[Contribution]
    group: _containers.RepeatedScalarFieldContainer[str]
    stepped: bool
    total_elements: int
    digest: bytes
    signature: bytes
    def __init__(self, ok: _Optional[bool] = ..., lost: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., gathered: _Optional[_Iterable[_Union[Contribution, _Mapping]]] = ..., group: _Optional[_Iterable[str]] = ..., stepped: _Optional[bool] = ..., total_elements: _Optional[int] = ..., digest: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Confirm(_message.Message):
    __slots__ = ("ok", "digests", "signatures", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    digests: _containers.RepeatedScalarFieldContainer[bytes]
    signatures: _containers.RepeatedScalarFieldContainer[bytes]
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., digests: _Optional[_Iterable[bytes]] = ..., signatures: _Optional[_Iterable[bytes]] = ..., reason: _Optional[str] = ...) -> None: ...

class AverageFrame(_message.Message):
    __slots__ = ("header", "piece", "verdict", "confirm")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_FIELD_NUMBER: _ClassVar[int]
    header: AverageHeader
    piece: bytes
    verdict: AverageVerdict
    confirm: Confirm
    def __init__(self, header: _Optional[_Union[AverageHeader, _Mapping]] = ..., piece: _Optional[bytes] = ..., verdict: _Optional[_Union[AverageVerdict, _Mapping]] = ..., confirm: _Optional[_Union[Confirm, _Mapping]] = ...) -> None: ...
