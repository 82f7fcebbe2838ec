from common.pb import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "model", "priority", "tenant", "deadline_s", "include_special_tokens", "echo_prompt_token_ids", "n", "ttft_target_s", "tpot_target_s", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ECHO_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TTFT_TARGET_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_TARGET_S_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: _sampling_pb2.SamplingParams
    model: str
    priority: int
    tenant: str
    deadline_s: float
    include_special_tokens: bool
    echo_prompt_token_ids: bool
    n: int
    ttft_target_s: float
    tpot_target_s: float
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., model: _Optional[str] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., deadline_s: _Optional[float] = ..., include_special_tokens: _Optional[bool] = ..., echo_prompt_token_ids: _Optional[bool] = ..., n: _Optional[int] = ..., ttft_target_s: _Optional[float] = ..., tpot_target_s: _Optional[float] = ..., lora_name: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "stop_reason", "prompt_tokens", "completion_tokens", "logprobs", "prompt_token_ids", "error", "worker_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stop_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    error: str
    worker_id: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., worker_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetPriorityRequest(_message.Message):
    __slots__ = ("request_id", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class SetPriorityResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "num_blocks", "num_free_blocks", "num_host_blocks", "num_running", "num_waiting", "kv_usage", "num_preemptions", "num_steps", "state", "num_swap_outs", "num_recomputed_tokens", "resident_loras", "max_loras")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_OUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    num_blocks: int
    num_free_blocks: int
    num_host_blocks: int
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    num_steps: int
    state: str
    num_swap_outs: int
    num_recomputed_tokens: int
    resident_loras: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., state: _Optional[str] = ..., num_swap_outs: _Optional[int] = ..., num_recomputed_tokens: _Optional[int] = ..., resident_loras: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("model", "max_model_len", "block_size", "scheduling_policy", "workers", "num_requests_in_flight", "num_waiting", "num_running", "num_preemptions", "num_requests_finished", "version", "loras", "max_loras", "running_lora_adapters", "waiting_lora_adapters")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_POLICY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    block_size: int
    scheduling_policy: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    num_requests_in_flight: int
    num_waiting: int
    num_running: int
    num_preemptions: int
    num_requests_finished: int
    version: str
    loras: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    max_loras: int
    running_lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    waiting_lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., scheduling_policy: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., num_requests_in_flight: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_requests_finished: _Optional[int] = ..., version: _Optional[str] = ..., loras: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., max_loras: _Optional[int] = ..., running_lora_adapters: _Optional[_Iterable[str]] = ..., waiting_lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "rank", "target_modules")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...
