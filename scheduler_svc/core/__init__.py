"""The scheduler core: pure Python, no gRPC, no torch."""

from common.gc_tuning import restore_gc, tune_gc_for_serving
from common.messages import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput

# importing policies registers the built-ins beyond fcfs and priority (sjf, aging, fair, deadline)
from scheduler_svc.core import policies  # noqa: F401
from scheduler_svc.core.block_pool import (
    BlockPool,
    CacheJournal,
    FreeBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
)
from scheduler_svc.core.errors import RequestRejected, SchedulerConfigError
from scheduler_svc.core.kv_cache_manager import (
    KVCacheManager,
    count_prefix_blocks,
    request_block_hashes,
)
from scheduler_svc.core.outputs import RequestOutput
from scheduler_svc.core.policy import (
    FCFSPolicy,
    PriorityPolicy,
    SchedulingPolicy,
    available_policies,
    create_policy,
    register_policy,
    unregister_policy,
)
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.request_queue import (
    FIFORequestQueue,
    KeyedRequestQueue,
    RequestQueue,
    create_request_queue,
)
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.stats import SchedulerStats
from scheduler_svc.core.validation import validate_request, validate_sampling_params

__all__ = [
    "BlockPool",
    "CacheJournal",
    "request_block_hashes",
    "CachedRequestData",
    "FCFSPolicy",
    "FIFORequestQueue",
    "FinishReason",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KeyedRequestQueue",
    "NewRequestData",
    "PriorityPolicy",
    "Request",
    "RequestOutput",
    "RequestQueue",
    "RequestRejected",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConfigError",
    "SchedulerOutput",
    "SchedulerStats",
    "SchedulingPolicy",
    "available_policies",
    "count_prefix_blocks",
    "create_policy",
    "create_request_queue",
    "hash_block_tokens",
    "register_policy",
    "restore_gc",
    "tune_gc_for_serving",
    "unregister_policy",
    "validate_request",
    "validate_sampling_params",
]
