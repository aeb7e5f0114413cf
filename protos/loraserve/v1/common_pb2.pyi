from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModuleKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODULE_KIND_UNSPECIFIED: _ClassVar[ModuleKind]
    COLUMN: _ClassVar[ModuleKind]
    MERGED_COLUMN: _ClassVar[ModuleKind]
    QKV: _ClassVar[ModuleKind]
    ROW: _ClassVar[ModuleKind]
    REPLICATED: _ClassVar[ModuleKind]
    EMBEDDING: _ClassVar[ModuleKind]
    LM_HEAD: _ClassVar[ModuleKind]
    MOE_W13: _ClassVar[ModuleKind]
    MOE_W2: _ClassVar[ModuleKind]
MODULE_KIND_UNSPECIFIED: ModuleKind
COLUMN: ModuleKind
MERGED_COLUMN: ModuleKind
QKV: ModuleKind
ROW: ModuleKind
REPLICATED: ModuleKind
EMBEDDING: ModuleKind
LM_HEAD: ModuleKind
MOE_W13: ModuleKind
MOE_W2: ModuleKind

class ModuleLayout(_message.Message):
    __slots__ = ("name", "kind", "input_size", "output_sizes", "peft_modules", "head_size", "num_experts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INPUT_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SIZES_FIELD_NUMBER: _ClassVar[int]
    PEFT_MODULES_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: ModuleKind
    input_size: int
    output_sizes: _containers.RepeatedScalarFieldContainer[int]
    peft_modules: _containers.RepeatedScalarFieldContainer[str]
    head_size: int
    num_experts: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[ModuleKind, str]] = ..., input_size: _Optional[int] = ..., output_sizes: _Optional[_Iterable[int]] = ..., peft_modules: _Optional[_Iterable[str]] = ..., head_size: _Optional[int] = ..., num_experts: _Optional[int] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("modules", "tp_size", "fully_sharded", "ep_size", "dtype", "max_rank", "base_model")
    MODULES_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    FULLY_SHARDED_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    modules: _containers.RepeatedCompositeFieldContainer[ModuleLayout]
    tp_size: int
    fully_sharded: bool
    ep_size: int
    dtype: str
    max_rank: int
    base_model: str
    def __init__(self, modules: _Optional[_Iterable[_Union[ModuleLayout, _Mapping]]] = ..., tp_size: _Optional[int] = ..., fully_sharded: _Optional[bool] = ..., ep_size: _Optional[int] = ..., dtype: _Optional[str] = ..., max_rank: _Optional[int] = ..., base_model: _Optional[str] = ...) -> None: ...

class ShardRank(_message.Message):
    __slots__ = ("tp_rank", "ep_rank")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    EP_RANK_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    ep_rank: int
    def __init__(self, tp_rank: _Optional[int] = ..., ep_rank: _Optional[int] = ...) -> None: ...

class AdapterManifest(_message.Message):
    __slots__ = ("name", "revision", "uri", "digest", "rank", "lora_alpha", "use_rslora", "target_modules", "weight_bytes", "num_parameters", "base_model", "created_unix_ms", "weights_cast", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    USE_RSLORA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CAST_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    revision: str
    uri: str
    digest: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    weight_bytes: int
    num_parameters: int
    base_model: str
    created_unix_ms: int
    weights_cast: str
    kind: str
    def __init__(self, name: _Optional[str] = ..., revision: _Optional[str] = ..., uri: _Optional[str] = ..., digest: _Optional[str] = ..., rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., use_rslora: _Optional[bool] = ..., target_modules: _Optional[_Iterable[str]] = ..., weight_bytes: _Optional[int] = ..., num_parameters: _Optional[int] = ..., base_model: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., weights_cast: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...
