"""The limits one worker is scheduled within: for each of rows (max_num_seqs), tokens per step
(max_num_batched_tokens) and sequence length (max_model_len), the smaller of the scheduler's
own flag and what the worker reported in its Register (0 = not reported: the scheduler's).
Its KV blocks are its own. `scheduler_config` builds the worker's core SchedulerConfig from
them and logs one `worker_limits` line naming each limit used and whose it was."""

from __future__ import annotations

from dataclasses import dataclass

from common.logging import get_logger
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core import SchedulerConfig, SchedulerConfigError
from scheduler_svc.core.speculative import SpeculativeConfig
from scheduler_svc.engine.worker_session import WorkerRegistration

log = get_logger("splitserve.engine")

SCHEDULER = "scheduler"
WORKER = "worker"


class WorkerLimitsError(ValueError):
    """No valid core configuration fits this worker's limits: it is refused."""


@dataclass(frozen=True, slots=True)
class Limit:
    value: int
    source: str  # SCHEDULER or WORKER: whose limit it is


def smaller(own: int, reported: int) -> Limit:
    """The scheduler's `own` limit, or the worker's `reported` one when that is smaller (0 =
    not reported). A tie is the scheduler's: its flag alone would give the same."""
    if 0 < reported < own:
        return Limit(reported, WORKER)
    return Limit(own, SCHEDULER)


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    max_num_seqs: Limit
    max_num_batched_tokens: Limit
    max_model_len: Limit

    @classmethod
    def of(cls, cfg: SchedulerServiceConfig, reg: WorkerRegistration) -> WorkerLimits:
        return cls(
            max_num_seqs=smaller(cfg.max_num_seqs, reg.max_num_seqs),
            max_num_batched_tokens=smaller(cfg.max_num_batched_tokens, reg.max_num_batched_tokens),
            max_model_len=smaller(cfg.max_model_len, reg.max_model_len),
        )

    def log_fields(self) -> dict[str, int | str]:
        fields: dict[str, int | str] = {}
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            limit: Limit = getattr(self, name)
            fields[name] = limit.value
            fields[name + "_from"] = limit.source
        return fields


def _build(
    cfg: SchedulerServiceConfig,
    reg: WorkerRegistration,
    limits: WorkerLimits,
    speculative: SpeculativeConfig | None,
) -> SchedulerConfig:
    try:
        return SchedulerConfig(
            max_num_batched_tokens=limits.max_num_batched_tokens.value,
            max_num_seqs=limits.max_num_seqs.value,
            block_size=reg.block_size,
            num_blocks=reg.num_device_blocks,
            num_host_blocks=reg.num_host_blocks,
            watermark=cfg.watermark,
            policy=cfg.scheduling_policy,
            preemption_mode=cfg.preemption_mode,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            enable_prefix_caching=cfg.enable_prefix_caching,
            max_model_len=limits.max_model_len.value,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            worker_costs=reg.costs,
            speculative=speculative,
            max_loras=reg.max_loras,
        )
    except SchedulerConfigError as exc:
        used = ", ".join(f"{k} {v}" for k, v in limits.log_fields().items() if "_from" not in k)
        raise WorkerLimitsError(
            f"worker {reg.worker_id!r} cannot be scheduled within its limits ({used}; "
            f"{reg.num_device_blocks} KV blocks of {reg.block_size} tokens): {exc}"
        ) from None


def check(cfg: SchedulerServiceConfig, reg: WorkerRegistration) -> str | None:
    """Why no core configuration fits this worker (a sentence to refuse it with), or None."""
    try:
        _build(cfg, reg, WorkerLimits.of(cfg, reg), None)
    except WorkerLimitsError as exc:
        return str(exc)
    return None


def scheduler_config(
    cfg: SchedulerServiceConfig,
    reg: WorkerRegistration,
    speculative: SpeculativeConfig | None = None,
) -> SchedulerConfig:
    """The worker's core SchedulerConfig within the smaller of each limit; logs which it used.
    Raises WorkerLimitsError when none fits (`check` says so before the worker is attached)."""
    limits = WorkerLimits.of(cfg, reg)
    sched_cfg = _build(cfg, reg, limits, speculative)
    log.info(
        "worker_limits",
        worker_id=reg.worker_id,
        num_blocks=reg.num_device_blocks,
        **limits.log_fields(),
    )
    return sched_cfg
