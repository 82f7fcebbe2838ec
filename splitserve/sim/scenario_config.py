"""What a `splitserve sim` scenario is run with, and what a scenario is.

``ScenarioConfig`` has one field per `splitserve sim` setting flag (the flag is the field's name,
dashed) with its generic default; ``Scenario`` names a builder of runs (experiments.py) with its
own ``defaults`` and the settings it ``refuses``. scenarios.py lists the scenarios and resolves a
scenario's settings with the user's flags.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from splitserve.sim.costmodel import StepCostModel
from splitserve.sim.simulator import SimSettings
from splitserve.sim.trace import TraceConfig, TraceRequest

Run = tuple[SimSettings, list[TraceRequest]]  # one run of a scenario: its settings and trace


_SIM, _TRACE = SimSettings(), TraceConfig()  # the defaults the flags start from


@dataclass(slots=True)
class ScenarioConfig:
    """Everything a scenario is run with: one field per `splitserve sim` setting flag (the flag
    is the field's name, dashed), with its generic default."""

    # trace
    num_requests: int = _TRACE.num_requests
    request_rate: float | None = None  # Poisson arrivals/s; None: the scenario's load
    prompt_median: float = _TRACE.prompt_median  # log-normal
    prompt_sigma: float = _TRACE.prompt_sigma
    prompt_max: int = _TRACE.prompt_max
    output_median: float = _TRACE.output_median
    output_sigma: float = _TRACE.output_sigma
    output_max: int = _TRACE.output_max
    tenants: dict[str, float] = field(default_factory=dict)  # name -> share of requests
    priorities: tuple[int, ...] = _TRACE.priorities  # drawn uniformly
    shared_prefix_len: int = _TRACE.shared_prefix_len
    seed: int = _TRACE.seed
    # scheduler
    policies: tuple[str, ...] | None = None  # None: the scenario's
    workers: int = _SIM.num_workers
    max_num_batched_tokens: int = _SIM.max_num_batched_tokens
    max_num_seqs: int = _SIM.max_num_seqs
    block_size: int = _SIM.block_size
    num_blocks: int = _SIM.num_blocks
    num_host_blocks: int = _SIM.num_host_blocks
    preemption_mode: str = _SIM.preemption_mode
    enable_chunked_prefill: bool = _SIM.enable_chunked_prefill
    enable_prefix_caching: bool = _SIM.enable_prefix_caching
    max_model_len: int = _SIM.max_model_len
    aging_rate: float | None = None  # None: the scenario's (from its trace) or the policy's
    weights: dict[str, float] | None = None  # fair share weights; None: the policy's
    shed_hopeless: bool | None = None  # goodput ends hopeless waiting requests; None: it does not
    ttft_slo_ms: float = _SIM.ttft_slo_ms
    thrash_threshold: float = _SIM.thrash_threshold
    thrash_window_s: float = _SIM.thrash_window_s
    thrash_backpressure: bool = _SIM.thrash_backpressure

    def sim_settings(self) -> SimSettings:
        """The scheduler settings every run of the scenario starts from."""
        return SimSettings(
            num_workers=self.workers,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            num_host_blocks=self.num_host_blocks,
            preemption_mode=self.preemption_mode,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            max_model_len=self.max_model_len,
            ttft_slo_ms=self.ttft_slo_ms,
            thrash_threshold=self.thrash_threshold,
            thrash_window_s=self.thrash_window_s,
            thrash_backpressure=self.thrash_backpressure,
            shared_prefix_len=self.shared_prefix_len,
        )

    def trace_config(self) -> TraceConfig:
        """The trace; request_rate 0 (a burst) until the scenario sets its load (``_rate``)."""
        return TraceConfig(
            num_requests=self.num_requests,
            request_rate=self.request_rate or 0.0,
            prompt_median=self.prompt_median,
            prompt_sigma=self.prompt_sigma,
            prompt_max=self.prompt_max,
            output_median=self.output_median,
            output_sigma=self.output_sigma,
            output_max=self.output_max,
            tenants=dict(self.tenants),
            priorities=self.priorities,
            shared_prefix_len=self.shared_prefix_len,
            seed=self.seed,
        )

    def user_options(self) -> dict[str, Any]:
        """Policy options the settings carry (aging_rate, weights, shed_hopeless), those set."""
        opts = {
            "aging_rate": self.aging_rate,
            "weights": self.weights,
            "shed_hopeless": self.shed_hopeless,
        }
        return {k: copy.deepcopy(v) for k, v in opts.items() if v is not None}


CONFIG_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ScenarioConfig))


def flag_name(name: str) -> str:
    """A ScenarioConfig field's flag: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + name.replace("_", "-")


class ScenarioFlagError(ValueError):
    """A flag the scenario does not take (it sets that setting itself)."""


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    build: Callable[[ScenarioConfig, StepCostModel], list[Run]]
    summary: str
    # the scenario's own settings, over ScenarioConfig's defaults (a flag the user gives wins)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # settings it varies across its runs (or has no use for): field -> why a flag is refused
    refuses: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "refuses", MappingProxyType(dict(self.refuses)))
        for what, names in (("defaults", self.defaults), ("refuses", self.refuses)):
            bad = sorted(set(names) - set(CONFIG_FIELDS))
            if bad:
                raise ValueError(f"scenario {self.name!r}: {what} names no setting: {bad}")
        both = sorted(set(self.defaults) & set(self.refuses))
        if both:
            raise ValueError(f"scenario {self.name!r} both defaults and refuses {both}")


def show_value(value: Any) -> str:
    """A setting's value as its flag takes it."""
    if isinstance(value, dict):
        return ",".join(f"{k}:{v:g}" for k, v in value.items()) or "none"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)
