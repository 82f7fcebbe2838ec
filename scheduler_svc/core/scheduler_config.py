"""SchedulerConfig: the knobs of one Scheduler (one per worker), checked on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.core.errors import SchedulerConfigError
from scheduler_svc.core.policy import available_policies, create_policy
from scheduler_svc.core.preemption_cost import WorkerCosts
from scheduler_svc.core.speculative import SpeculativeConfig

# recompute: a victim's blocks are freed and it is prefilled again (prefix hits help).
# swap: its computed KV is copied to host blocks and back on resume; recompute when the host
#   pool is full (or has no blocks).
# auto: per victim the cheaper of the two by the worker's measured costs (worker_costs; see
#   preemption_cost.py); without them, swap victims with at least auto_swap_min_tokens computed
#   tokens and recompute the others.
SUPPORTED_PREEMPTION_MODES = ("recompute", "swap", "auto")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # most requests running at once
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 4096  # device KV blocks (all usable)
    num_host_blocks: int = 0  # host blocks for swap (growth path)
    watermark: float = 0.01  # fraction of num_blocks kept free when admitting waiting requests
    policy: str = "fcfs"  # waiting-queue order, a name in the policy registry
    preemption_mode: str = "recompute"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int = 2048  # longest prompt + output in tokens
    long_prefill_token_threshold: int = 0  # cap one request's prefill chunk (0 = off)
    # a step looks at most this many waiting requests it has to skip (bounds per-step work)
    max_waiting_skips_per_step: int = 128
    auto_swap_min_tokens: int = 512  # preemption_mode="auto": swap from this many tokens on
    # options for the policy when the Scheduler creates it (aging_rate, weights, ...)
    policy_options: dict[str, Any] = field(default_factory=dict)
    worker_costs: WorkerCosts | None = None  # measured by the worker; None = unknown
    speculative: SpeculativeConfig | None = None  # draft tokens for decodes (speculative.py)
    # distinct LoRA adapters among the running requests, at most (0 = this worker runs none)
    max_loras: int = 0
    # a request kept out this many steps for want of an adapter slot stops other adapters'
    # admissions behind it (lora_slots.py)
    lora_starvation_steps: int = 32

    def __post_init__(self) -> None:
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("block_size", self.block_size)
        _positive_int("num_blocks", self.num_blocks)
        _positive_int("max_model_len", self.max_model_len)
        _positive_int("max_waiting_skips_per_step", self.max_waiting_skips_per_step)
        _non_negative_int("num_host_blocks", self.num_host_blocks)
        _non_negative_int("long_prefill_token_threshold", self.long_prefill_token_threshold)
        _non_negative_int("auto_swap_min_tokens", self.auto_swap_min_tokens)
        _non_negative_int("max_loras", self.max_loras)
        _non_negative_int("lora_starvation_steps", self.lora_starvation_steps)
        w = self.watermark
        if (
            isinstance(w, bool)
            or not isinstance(w, int | float)
            or not math.isfinite(w)
            or not (0.0 <= w < 1.0)
        ):
            raise SchedulerConfigError(
                f"watermark must be a fraction of the KV blocks in [0, 1); got {w!r}"
            )
        if self.max_model_len < 2:
            raise SchedulerConfigError(
                f"max_model_len must be at least 2 (one prompt token and one output token); "
                f"got {self.max_model_len}"
            )
        names = available_policies()
        if self.policy not in names:
            raise SchedulerConfigError(
                f"unknown scheduling policy {self.policy!r}; choose one of {', '.join(names)}"
            )
        try:
            create_policy(self.policy, **self.policy_options)
        except (TypeError, ValueError) as exc:
            raise SchedulerConfigError(f"scheduling policy {self.policy!r}: {exc}") from None
        mode = self.preemption_mode
        if mode not in SUPPORTED_PREEMPTION_MODES:
            raise SchedulerConfigError(
                f"unknown preemption_mode {mode!r}; choose one of "
                f"{', '.join(SUPPORTED_PREEMPTION_MODES)}"
            )

    @property
    def watermark_blocks(self) -> int:
        """Blocks kept free when admitting a waiting request (while others run)."""
        return int(self.watermark * self.num_blocks)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SchedulerConfigError(f"{name} must be an integer >= 1; got {value!r}")


def _non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchedulerConfigError(f"{name} must be an integer >= 0; got {value!r}")
