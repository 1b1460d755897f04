from protocols import tensor_pb2 as _tensor_pb2
from protocols import stage_pb2 as _stage_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExpertForwardRequest(_message.Message):
    __slots__ = ("run_id", "expert", "uid", "inputs", "output_codec", "train")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CODEC_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    expert: str
    uid: str
    inputs: _tensor_pb2.Tensor
    output_codec: _tensor_pb2.Codec
    train: bool
    def __init__(self, run_id: _Optional[str] = ..., expert: _Optional[str] = ..., uid: _Optional[str] = ..., inputs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., output_codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., train: _Optional[bool] = ...) -> None: ...

class ExpertForwardResponse(_message.Message):
    __slots__ = ("outputs", "epoch")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    outputs: _tensor_pb2.Tensor
    epoch: int
    def __init__(self, outputs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class ExpertBackwardRequest(_message.Message):
    __slots__ = ("run_id", "expert", "uid", "inputs", "grad_outputs", "samples", "output_codec")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CODEC_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    expert: str
    uid: str
    inputs: _tensor_pb2.Tensor
    grad_outputs: _tensor_pb2.Tensor
    samples: int
    output_codec: _tensor_pb2.Codec
    def __init__(self, run_id: _Optional[str] = ..., expert: _Optional[str] = ..., uid: _Optional[str] = ..., inputs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., grad_outputs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., samples: _Optional[int] = ..., output_codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ...) -> None: ...

class ExpertBackwardResponse(_message.Message):
    __slots__ = ("grad_inputs", "epoch", "seq", "incarnation", "stepped_seq")
    GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEPPED_SEQ_FIELD_NUMBER: _ClassVar[int]
    grad_inputs: _tensor_pb2.Tensor
    epoch: int
    seq: int
    incarnation: int
    stepped_seq: int
    def __init__(self, grad_inputs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., incarnation: _Optional[int] = ..., stepped_seq: _Optional[int] = ...) -> None: ...
