from common.pb import generation_pb2 as _generation_pb2
from common.pb import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerMessage(_message.Message):
    __slots__ = ("register", "step_result", "heartbeat", "drain", "lora_report")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    STEP_RESULT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    LORA_REPORT_FIELD_NUMBER: _ClassVar[int]
    register: Register
    step_result: StepResult
    heartbeat: Heartbeat
    drain: Drain
    lora_report: LoraReport
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., step_result: _Optional[_Union[StepResult, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., lora_report: _Optional[_Union[LoraReport, _Mapping]] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("register_ack", "step", "heartbeat", "drained", "lora_command")
    REGISTER_ACK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    LORA_COMMAND_FIELD_NUMBER: _ClassVar[int]
    register_ack: RegisterAck
    step: Step
    heartbeat: Heartbeat
    drained: Drained
    lora_command: LoraCommand
    def __init__(self, register_ack: _Optional[_Union[RegisterAck, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., drained: _Optional[_Union[Drained, _Mapping]] = ..., lora_command: _Optional[_Union[LoraCommand, _Mapping]] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class Drained(_message.Message):
    __slots__ = ("num_finished", "num_handed_back")
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    num_finished: int
    num_handed_back: int
    def __init__(self, num_finished: _Optional[int] = ..., num_handed_back: _Optional[int] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("worker_id", "model", "block_size", "num_device_blocks", "num_host_blocks", "max_model_len", "vocab_size", "eos_token_id", "device", "dtype", "prefill_s_per_token", "prefill_s_per_token_ctx", "swap_bytes_per_s", "swap_latency_s", "kv_bytes_per_block", "kernels", "epoch", "held", "host", "pid", "verify_step_s", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank", "loras", "resident_loras")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_CTX_FIELD_NUMBER: _ClassVar[int]
    SWAP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    SWAP_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEP_S_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LORAS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int
    device: str
    dtype: str
    prefill_s_per_token: float
    prefill_s_per_token_ctx: float
    swap_bytes_per_s: float
    swap_latency_s: float
    kv_bytes_per_block: int
    kernels: str
    epoch: int
    held: _containers.RepeatedCompositeFieldContainer[HeldRequest]
    host: str
    pid: int
    verify_step_s: _containers.RepeatedScalarFieldContainer[float]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int
    max_lora_rank: int
    loras: _containers.RepeatedCompositeFieldContainer[_generation_pb2.LoraAdapter]
    resident_loras: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., num_device_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., prefill_s_per_token: _Optional[float] = ..., prefill_s_per_token_ctx: _Optional[float] = ..., swap_bytes_per_s: _Optional[float] = ..., swap_latency_s: _Optional[float] = ..., kv_bytes_per_block: _Optional[int] = ..., kernels: _Optional[str] = ..., epoch: _Optional[int] = ..., held: _Optional[_Iterable[_Union[HeldRequest, _Mapping]]] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., verify_step_s: _Optional[_Iterable[float]] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., loras: _Optional[_Iterable[_Union[_generation_pb2.LoraAdapter, _Mapping]]] = ..., resident_loras: _Optional[_Iterable[str]] = ...) -> None: ...

class HeldRequest(_message.Message):
    __slots__ = ("request_id", "block_ids", "num_computed_tokens", "num_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class RegisterAck(_message.Message):
    __slots__ = ("worker_id", "max_model_len", "epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    max_model_len: int
    epoch: int
    def __init__(self, worker_id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("time",)
    TIME_FIELD_NUMBER: _ClassVar[int]
    time: float
    def __init__(self, time: _Optional[float] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("handle", "prompt_token_ids", "sampling", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "output_token_ids", "request_id", "lora_name")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    handle: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    lora_name: str
    def __init__(self, handle: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("handle", "num_scheduled_tokens", "new_block_ids", "num_computed_tokens", "resumed", "new_token_ids")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    num_scheduled_tokens: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    resumed: bool
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., resumed: _Optional[bool] = ..., new_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockPair(_message.Message):
    __slots__ = ("device_block", "host_block")
    DEVICE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    device_block: int
    host_block: int
    def __init__(self, device_block: _Optional[int] = ..., host_block: _Optional[int] = ...) -> None: ...

class RunningColumns(_message.Message):
    __slots__ = ("handles", "num_scheduled_tokens", "num_computed_tokens", "num_new_blocks", "new_block_ids")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handles: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "preempted", "finished", "swap_out", "swap_in", "running", "epoch", "drafts")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    preempted: _containers.RepeatedScalarFieldContainer[int]
    finished: _containers.RepeatedScalarFieldContainer[int]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockPair]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockPair]
    running: RunningColumns
    epoch: int
    drafts: Drafts
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., preempted: _Optional[_Iterable[int]] = ..., finished: _Optional[_Iterable[int]] = ..., swap_out: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., running: _Optional[_Union[RunningColumns, _Mapping]] = ..., epoch: _Optional[int] = ..., drafts: _Optional[_Union[Drafts, _Mapping]] = ...) -> None: ...

class Drafts(_message.Message):
    __slots__ = ("handles", "num_tokens", "token_ids")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handles: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SampledTokens(_message.Message):
    __slots__ = ("handle", "token_ids", "logprobs", "top_token_ids", "top_logprobs")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, handle: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled", "forward_time_s", "sample_time_s", "step_time_s", "error", "idle_time_s", "sampled_handles", "sampled_token_ids", "resident_loras", "resident_loras_changed")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LORAS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LORAS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledTokens]
    forward_time_s: float
    sample_time_s: float
    step_time_s: float
    error: str
    idle_time_s: float
    sampled_handles: _containers.RepeatedScalarFieldContainer[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resident_loras: _containers.RepeatedScalarFieldContainer[str]
    resident_loras_changed: bool
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledTokens, _Mapping]]] = ..., forward_time_s: _Optional[float] = ..., sample_time_s: _Optional[float] = ..., step_time_s: _Optional[float] = ..., error: _Optional[str] = ..., idle_time_s: _Optional[float] = ..., sampled_handles: _Optional[_Iterable[int]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., resident_loras: _Optional[_Iterable[str]] = ..., resident_loras_changed: _Optional[bool] = ...) -> None: ...

class LoraCommand(_message.Message):
    __slots__ = ("name", "path", "unload")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    unload: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., unload: _Optional[bool] = ...) -> None: ...

class LoraReport(_message.Message):
    __slots__ = ("adapter", "error", "unload")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_FIELD_NUMBER: _ClassVar[int]
    adapter: _generation_pb2.LoraAdapter
    error: str
    unload: bool
    def __init__(self, adapter: _Optional[_Union[_generation_pb2.LoraAdapter, _Mapping]] = ..., error: _Optional[str] = ..., unload: _Optional[bool] = ...) -> None: ...
