from common.pb import generation_pb2 as _generation_pb2
from common.pb import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ("num_in_flight",)
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    num_in_flight: int
    def __init__(self, num_in_flight: _Optional[int] = ...) -> None: ...

class FrontendMessage(_message.Message):
    __slots__ = ("hello", "submit", "cancel", "resubmit")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    RESUBMIT_FIELD_NUMBER: _ClassVar[int]
    hello: FrontendHello
    submit: SubmitRequest
    cancel: CancelRequest
    resubmit: SubmitRequest
    def __init__(self, hello: _Optional[_Union[FrontendHello, _Mapping]] = ..., submit: _Optional[_Union[SubmitRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelRequest, _Mapping]] = ..., resubmit: _Optional[_Union[SubmitRequest, _Mapping]] = ...) -> None: ...

class FrontendHello(_message.Message):
    __slots__ = ("frontend_id", "host", "pid", "http_address", "grpc_address", "epoch", "in_flight")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    host: str
    pid: int
    http_address: str
    grpc_address: str
    epoch: int
    in_flight: _containers.RepeatedCompositeFieldContainer[SubmitRequest]
    def __init__(self, frontend_id: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., http_address: _Optional[str] = ..., grpc_address: _Optional[str] = ..., epoch: _Optional[int] = ..., in_flight: _Optional[_Iterable[_Union[SubmitRequest, _Mapping]]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "tenant", "deadline_left_s", "output_token_ids", "num_migrations", "age_s", "eos_token_id", "prefill_after", "ttft_target_s", "tpot_target_s", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_AFTER_FIELD_NUMBER: _ClassVar[int]
    TTFT_TARGET_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_TARGET_S_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    priority: int
    tenant: str
    deadline_left_s: float
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_migrations: int
    age_s: float
    eos_token_id: int
    prefill_after: str
    ttft_target_s: float
    tpot_target_s: float
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., deadline_left_s: _Optional[float] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., num_migrations: _Optional[int] = ..., age_s: _Optional[float] = ..., eos_token_id: _Optional[int] = ..., prefill_after: _Optional[str] = ..., ttft_target_s: _Optional[float] = ..., tpot_target_s: _Optional[float] = ..., lora_name: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class LeaderMessage(_message.Message):
    __slots__ = ("epoch", "hello_ack", "tokens", "status", "reclaim")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    hello_ack: FrontendHelloAck
    tokens: TokenBatch
    status: ClusterStatus
    reclaim: Reclaim
    def __init__(self, epoch: _Optional[int] = ..., hello_ack: _Optional[_Union[FrontendHelloAck, _Mapping]] = ..., tokens: _Optional[_Union[TokenBatch, _Mapping]] = ..., status: _Optional[_Union[ClusterStatus, _Mapping]] = ..., reclaim: _Optional[_Union[Reclaim, _Mapping]] = ...) -> None: ...

class Reclaim(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FrontendHelloAck(_message.Message):
    __slots__ = ("scheduler_id", "num_resumed", "num_adopted")
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_FIELD_NUMBER: _ClassVar[int]
    NUM_ADOPTED_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    num_resumed: int
    num_adopted: int
    def __init__(self, scheduler_id: _Optional[str] = ..., num_resumed: _Optional[int] = ..., num_adopted: _Optional[int] = ...) -> None: ...

class RequestUpdate(_message.Message):
    __slots__ = ("request_id", "start", "token_ids", "finish_reason", "stop_reason", "error", "error_code", "logprobs", "worker_id", "retry_after_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _generation_pb2.FinishReason
    stop_reason: str
    error: str
    error_code: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    worker_id: str
    retry_after_s: float
    def __init__(self, request_id: _Optional[str] = ..., start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., error: _Optional[str] = ..., error_code: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., worker_id: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("updates", "next_request_ids", "next_starts", "next_token_ids")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    NEXT_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_STARTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[RequestUpdate]
    next_request_ids: _containers.RepeatedScalarFieldContainer[str]
    next_starts: _containers.RepeatedScalarFieldContainer[int]
    next_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, updates: _Optional[_Iterable[_Union[RequestUpdate, _Mapping]]] = ..., next_request_ids: _Optional[_Iterable[str]] = ..., next_starts: _Optional[_Iterable[int]] = ..., next_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ClusterMember(_message.Message):
    __slots__ = ("kind", "id", "host", "pid", "role", "epoch", "state", "num_running", "kv_usage", "address", "num_requests", "kernels")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    id: str
    host: str
    pid: int
    role: str
    epoch: int
    state: str
    num_running: int
    kv_usage: float
    address: str
    num_requests: int
    kernels: str
    def __init__(self, kind: _Optional[str] = ..., id: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., role: _Optional[str] = ..., epoch: _Optional[int] = ..., state: _Optional[str] = ..., num_running: _Optional[int] = ..., kv_usage: _Optional[float] = ..., address: _Optional[str] = ..., num_requests: _Optional[int] = ..., kernels: _Optional[str] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("server_info", "members", "num_failovers", "last_takeover_s", "last_resumed", "last_adopted", "last_recomputed_tokens", "stream_interval")
    SERVER_INFO_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    LAST_TAKEOVER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_RESUMED_FIELD_NUMBER: _ClassVar[int]
    LAST_ADOPTED_FIELD_NUMBER: _ClassVar[int]
    LAST_RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    server_info: _generation_pb2.ServerInfo
    members: _containers.RepeatedCompositeFieldContainer[ClusterMember]
    num_failovers: int
    last_takeover_s: float
    last_resumed: int
    last_adopted: int
    last_recomputed_tokens: int
    stream_interval: int
    def __init__(self, server_info: _Optional[_Union[_generation_pb2.ServerInfo, _Mapping]] = ..., members: _Optional[_Iterable[_Union[ClusterMember, _Mapping]]] = ..., num_failovers: _Optional[int] = ..., last_takeover_s: _Optional[float] = ..., last_resumed: _Optional[int] = ..., last_adopted: _Optional[int] = ..., last_recomputed_tokens: _Optional[int] = ..., stream_interval: _Optional[int] = ...) -> None: ...
