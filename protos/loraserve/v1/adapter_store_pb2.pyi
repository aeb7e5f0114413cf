from loraserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterAdapterRequest(_message.Message):
    __slots__ = ("name", "uri", "revision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    uri: str
    revision: str
    def __init__(self, name: _Optional[str] = ..., uri: _Optional[str] = ..., revision: _Optional[str] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "next_page_token")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.AdapterManifest]
    next_page_token: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[_common_pb2.AdapterManifest, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class FetchShardRequest(_message.Message):
    __slots__ = ("name", "layout", "rank", "digest", "chunk_bytes", "verify", "xxh3")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    name: str
    layout: _common_pb2.Layout
    rank: _common_pb2.ShardRank
    digest: str
    chunk_bytes: int
    verify: bool
    xxh3: bool
    def __init__(self, name: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ..., rank: _Optional[_Union[_common_pb2.ShardRank, _Mapping]] = ..., digest: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., verify: _Optional[bool] = ..., xxh3: _Optional[bool] = ...) -> None: ...

class ShardHeader(_message.Message):
    __slots__ = ("manifest", "layout_hash", "total_bytes", "cache_tier")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_TIER_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.AdapterManifest
    layout_hash: str
    total_bytes: int
    cache_tier: str
    def __init__(self, manifest: _Optional[_Union[_common_pb2.AdapterManifest, _Mapping]] = ..., layout_hash: _Optional[str] = ..., total_bytes: _Optional[int] = ..., cache_tier: _Optional[str] = ...) -> None: ...

class ShardTrailer(_message.Message):
    __slots__ = ("sha256", "xxh3_128")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    XXH3_128_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    xxh3_128: str
    def __init__(self, sha256: _Optional[str] = ..., xxh3_128: _Optional[str] = ...) -> None: ...

class ShardChunk(_message.Message):
    __slots__ = ("header", "data", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: ShardHeader
    data: bytes
    trailer: ShardTrailer
    def __init__(self, header: _Optional[_Union[ShardHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer: _Optional[_Union[ShardTrailer, _Mapping]] = ...) -> None: ...

class PrefetchItem(_message.Message):
    __slots__ = ("name", "layout", "ranks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    layout: _common_pb2.Layout
    ranks: _containers.RepeatedCompositeFieldContainer[_common_pb2.ShardRank]
    def __init__(self, name: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[_common_pb2.ShardRank, _Mapping]]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PrefetchItem]
    def __init__(self, items: _Optional[_Iterable[_Union[PrefetchItem, _Mapping]]] = ...) -> None: ...

class PrefetchResult(_message.Message):
    __slots__ = ("name", "rank", "ok", "error", "bytes", "cache_tier")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_TIER_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: _common_pb2.ShardRank
    ok: bool
    error: str
    bytes: int
    cache_tier: str
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[_Union[_common_pb2.ShardRank, _Mapping]] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ..., cache_tier: _Optional[str] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PrefetchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PrefetchResult, _Mapping]]] = ...) -> None: ...
