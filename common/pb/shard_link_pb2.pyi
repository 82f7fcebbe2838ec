from common.pb import frontend_link_pb2 as _frontend_link_pb2
from common.pb import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardMessage(_message.Message):
    __slots__ = ("hello", "report")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    hello: ShardHello
    report: ShardReport
    def __init__(self, hello: _Optional[_Union[ShardHello, _Mapping]] = ..., report: _Optional[_Union[ShardReport, _Mapping]] = ...) -> None: ...

class ShardHello(_message.Message):
    __slots__ = ("shard_id", "host", "pid", "worker_address")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    host: str
    pid: int
    worker_address: str
    def __init__(self, shard_id: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., worker_address: _Optional[str] = ...) -> None: ...

class ShardWorker(_message.Message):
    __slots__ = ("worker_id", "state", "block_size", "num_device_blocks", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_waiting", "num_running", "kv_usage", "cached_added", "cached_removed", "cached_reset", "enable_caching", "worst_waiting_priority", "held_request_ids", "max_loras", "loras", "resident_loras", "loras_changed")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    CACHED_ADDED_FIELD_NUMBER: _ClassVar[int]
    CACHED_REMOVED_FIELD_NUMBER: _ClassVar[int]
    CACHED_RESET_FIELD_NUMBER: _ClassVar[int]
    ENABLE_CACHING_FIELD_NUMBER: _ClassVar[int]
    WORST_WAITING_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    HELD_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORAS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    state: str
    block_size: int
    num_device_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_waiting: int
    num_running: int
    kv_usage: float
    cached_added: _containers.RepeatedScalarFieldContainer[bytes]
    cached_removed: _containers.RepeatedScalarFieldContainer[bytes]
    cached_reset: bool
    enable_caching: bool
    worst_waiting_priority: int
    held_request_ids: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    loras: _containers.RepeatedCompositeFieldContainer[_generation_pb2.LoraAdapter]
    resident_loras: _containers.RepeatedScalarFieldContainer[str]
    loras_changed: bool
    def __init__(self, worker_id: _Optional[str] = ..., state: _Optional[str] = ..., block_size: _Optional[int] = ..., num_device_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., kv_usage: _Optional[float] = ..., cached_added: _Optional[_Iterable[bytes]] = ..., cached_removed: _Optional[_Iterable[bytes]] = ..., cached_reset: _Optional[bool] = ..., enable_caching: _Optional[bool] = ..., worst_waiting_priority: _Optional[int] = ..., held_request_ids: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ..., loras: _Optional[_Iterable[_Union[_generation_pb2.LoraAdapter, _Mapping]]] = ..., resident_loras: _Optional[_Iterable[str]] = ..., loras_changed: _Optional[bool] = ...) -> None: ...

class FrontendTokens(_message.Message):
    __slots__ = ("frontend_id", "token_batch")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BATCH_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    token_batch: bytes
    def __init__(self, frontend_id: _Optional[str] = ..., token_batch: _Optional[bytes] = ...) -> None: ...

class EndedRequest(_message.Message):
    __slots__ = ("request_id", "finish_reason", "num_output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: _generation_pb2.FinishReason
    num_output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., num_output_tokens: _Optional[int] = ...) -> None: ...

class ShardReport(_message.Message):
    __slots__ = ("workers", "tokens", "ended", "returned", "first_token")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[ShardWorker]
    tokens: _containers.RepeatedCompositeFieldContainer[FrontendTokens]
    ended: _containers.RepeatedCompositeFieldContainer[EndedRequest]
    returned: _containers.RepeatedCompositeFieldContainer[_frontend_link_pb2.SubmitRequest]
    first_token: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, workers: _Optional[_Iterable[_Union[ShardWorker, _Mapping]]] = ..., tokens: _Optional[_Iterable[_Union[FrontendTokens, _Mapping]]] = ..., ended: _Optional[_Iterable[_Union[EndedRequest, _Mapping]]] = ..., returned: _Optional[_Iterable[_Union[_frontend_link_pb2.SubmitRequest, _Mapping]]] = ..., first_token: _Optional[_Iterable[str]] = ...) -> None: ...

class ShardCommand(_message.Message):
    __slots__ = ("epoch", "hello_ack", "assign", "cancel")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    hello_ack: ShardHelloAck
    assign: AssignRequest
    cancel: _frontend_link_pb2.CancelRequest
    def __init__(self, epoch: _Optional[int] = ..., hello_ack: _Optional[_Union[ShardHelloAck, _Mapping]] = ..., assign: _Optional[_Union[AssignRequest, _Mapping]] = ..., cancel: _Optional[_Union[_frontend_link_pb2.CancelRequest, _Mapping]] = ...) -> None: ...

class ShardHelloAck(_message.Message):
    __slots__ = ("scheduler_id",)
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    def __init__(self, scheduler_id: _Optional[str] = ...) -> None: ...

class AssignRequest(_message.Message):
    __slots__ = ("worker_id", "frontend_id", "request")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    frontend_id: str
    request: _frontend_link_pb2.SubmitRequest
    def __init__(self, worker_id: _Optional[str] = ..., frontend_id: _Optional[str] = ..., request: _Optional[_Union[_frontend_link_pb2.SubmitRequest, _Mapping]] = ...) -> None: ...
