from protocols import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ForwardRequest(_message.Message):
    __slots__ = ("run_id", "stage", "uid", "inputs", "targets", "output_codec", "train", "step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CODEC_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    uid: str
    inputs: _tensor_pb2.Tensor
    targets: _tensor_pb2.Tensor
    output_codec: _tensor_pb2.Codec
    train: bool
    step: int
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., uid: _Optional[str] = ..., inputs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., targets: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., output_codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., train: _Optional[bool] = ..., step: _Optional[int] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("outputs", "has_loss", "loss", "epoch")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    outputs: _tensor_pb2.Tensor
    has_loss: bool
    loss: float
    epoch: int
    def __init__(self, outputs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., has_loss: _Optional[bool] = ..., loss: _Optional[float] = ..., epoch: _Optional[int] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("run_id", "stage", "uid", "inputs", "grad_outputs", "targets", "output_codec", "dry", "step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CODEC_FIELD_NUMBER: _ClassVar[int]
    DRY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    uid: str
    inputs: _tensor_pb2.Tensor
    grad_outputs: _tensor_pb2.Tensor
    targets: _tensor_pb2.Tensor
    output_codec: _tensor_pb2.Codec
    dry: bool
    step: int
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., uid: _Optional[str] = ..., inputs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., grad_outputs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., targets: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., output_codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., dry: _Optional[bool] = ..., step: _Optional[int] = ...) -> None: ...

class BackwardResponse(_message.Message):
    __slots__ = ("grad_inputs", "has_loss", "loss", "epoch", "seq", "incarnation", "stepped_seq")
    GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEPPED_SEQ_FIELD_NUMBER: _ClassVar[int]
    grad_inputs: _tensor_pb2.Tensor
    has_loss: bool
    loss: float
    epoch: int
    seq: int
    incarnation: int
    stepped_seq: int
    def __init__(self, grad_inputs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., has_loss: _Optional[bool] = ..., loss: _Optional[float] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., incarnation: _Optional[int] = ..., stepped_seq: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("expert",)
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    expert: str
    def __init__(self, expert: _Optional[str] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("run_id", "stage", "peer_id", "epoch", "samples_accumulated", "samples_stepped", "throughput", "load", "history", "incarnation", "stepped_seq", "state", "samples_averaging")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_ACCUMULATED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_STEPPED_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEPPED_SEQ_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_AVERAGING_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    peer_id: str
    epoch: int
    samples_accumulated: int
    samples_stepped: int
    throughput: float
    load: float
    history: _containers.RepeatedCompositeFieldContainer[StepFingerprint]
    incarnation: int
    stepped_seq: int
    state: str
    samples_averaging: int
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., peer_id: _Optional[str] = ..., epoch: _Optional[int] = ..., samples_accumulated: _Optional[int] = ..., samples_stepped: _Optional[int] = ..., throughput: _Optional[float] = ..., load: _Optional[float] = ..., history: _Optional[_Iterable[_Union[StepFingerprint, _Mapping]]] = ..., incarnation: _Optional[int] = ..., stepped_seq: _Optional[int] = ..., state: _Optional[str] = ..., samples_averaging: _Optional[int] = ...) -> None: ...

class StepFingerprint(_message.Message):
    __slots__ = ("epoch", "samples", "values", "members", "coverage")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    samples: int
    values: _containers.RepeatedScalarFieldContainer[float]
    members: _containers.RepeatedScalarFieldContainer[str]
    coverage: _containers.RepeatedCompositeFieldContainer[Coverage]
    def __init__(self, epoch: _Optional[int] = ..., samples: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ..., members: _Optional[_Iterable[str]] = ..., coverage: _Optional[_Iterable[_Union[Coverage, _Mapping]]] = ...) -> None: ...

class Coverage(_message.Message):
    __slots__ = ("peer_id", "incarnation", "seq")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    incarnation: int
    seq: int
    def __init__(self, peer_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class RoundRequest(_message.Message):
    __slots__ = ("run_id", "stage", "epoch", "expert", "inviter")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    INVITER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    epoch: int
    expert: str
    inviter: str
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., epoch: _Optional[int] = ..., expert: _Optional[str] = ..., inviter: _Optional[str] = ...) -> None: ...

class RoundResponse(_message.Message):
    __slots__ = ("joining", "epoch")
    JOINING_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    joining: bool
    epoch: int
    def __init__(self, joining: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class SignedRecord(_message.Message):
    __slots__ = ("owner", "expiration", "envelope")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EXPIRATION_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    expiration: float
    envelope: bytes
    def __init__(self, owner: _Optional[str] = ..., expiration: _Optional[float] = ..., envelope: _Optional[bytes] = ...) -> None: ...

class ProgressRequest(_message.Message):
    __slots__ = ("run_id", "stage", "expert", "record")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    expert: str
    record: SignedRecord
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., expert: _Optional[str] = ..., record: _Optional[_Union[SignedRecord, _Mapping]] = ...) -> None: ...

class ProgressResponse(_message.Message):
    __slots__ = ("record",)
    RECORD_FIELD_NUMBER: _ClassVar[int]
    record: SignedRecord
    def __init__(self, record: _Optional[_Union[SignedRecord, _Mapping]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("run_id", "stage", "shard", "num_shards", "epoch", "expert")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    shard: int
    num_shards: int
    epoch: int
    expert: str
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., epoch: _Optional[int] = ..., expert: _Optional[str] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: _tensor_pb2.Tensor
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class StateResponse(_message.Message):
    __slots__ = ("metadata_json", "tensors")
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    metadata_json: str
    tensors: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    def __init__(self, metadata_json: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ...) -> None: ...
