"""Synthetic traces: Poisson arrivals, long-tailed (log-normal) prompt and output lengths,
tenants, priorities and deadlines (or TTFT and TPOT targets). Deterministic for a seed."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class TraceConfig:
    num_requests: int = 400
    request_rate: float = 8.0  # Poisson arrivals per second; 0 or inf: all at t=0 (a burst)
    prompt_median: float = 256.0  # log-normal
    prompt_sigma: float = 0.9
    prompt_min: int = 4
    prompt_max: int = 2048
    output_median: float = 96.0
    output_sigma: float = 0.8
    output_min: int = 1
    output_max: int = 1024
    tenants: dict[str, float] = field(default_factory=dict)  # name -> share of requests
    priorities: tuple[int, ...] = (0,)  # drawn uniformly
    # deadline = arrival + deadline_base_s + deadline_per_token_s * prompt
    #            + deadline_per_output_s * output; all 0 = no deadlines
    deadline_base_s: float = 0.0
    deadline_per_token_s: float = 0.0
    deadline_per_output_s: float = 0.0
    shared_prefix_len: int = 0  # a system prompt every request starts with
    seed: int = 0


@dataclass(slots=True)
class TraceRequest:
    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    tenant: str | None = None
    priority: int = 0
    deadline: float | None = None  # absolute, simulated seconds
    ttft_target_s: float | None = None  # first token within this many seconds of arrival
    tpot_target_s: float | None = None  # mean seconds between output tokens, at most

    def prompt_token_ids(self, index: int, shared_prefix_len: int = 0) -> list[int]:
        """Distinct token ids per request (index), after a shared prefix."""
        shared = min(shared_prefix_len, self.prompt_len - 1)
        own = self.prompt_len - shared
        head = [(7 * j) % 40000 + 5 for j in range(shared)]
        return (
            head
            + [(index % 40000) + 5]
            + [(index * 131 + j * 17) % 40000 + 5 for j in range(1, own)]
        )


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    value = median * math.exp(rng.gauss(0.0, sigma)) if sigma > 0 else median
    return max(low, min(high, round(value)))


def make_trace(cfg: TraceConfig) -> list[TraceRequest]:
    rng = random.Random(cfg.seed)
    names = list(cfg.tenants)
    weights = [cfg.tenants[n] for n in names]
    burst = not cfg.request_rate or math.isinf(cfg.request_rate)
    t = 0.0
    out = []
    for i in range(cfg.num_requests):
        if not burst and i:
            t += rng.expovariate(cfg.request_rate)
        prompt = _lognormal(
            rng, cfg.prompt_median, cfg.prompt_sigma, cfg.prompt_min, cfg.prompt_max
        )
        output = _lognormal(
            rng, cfg.output_median, cfg.output_sigma, cfg.output_min, cfg.output_max
        )
        tenant = rng.choices(names, weights)[0] if names else None
        priority = rng.choice(cfg.priorities)
        deadline = None
        if cfg.deadline_base_s or cfg.deadline_per_token_s or cfg.deadline_per_output_s:
            deadline = (
                t
                + cfg.deadline_base_s
                + cfg.deadline_per_token_s * prompt
                + cfg.deadline_per_output_s * output
            )
        out.append(TraceRequest(f"r{i}", t, prompt, output, tenant, priority, deadline))
    return out


def parse_mix(spec: str) -> dict[str, float]:
    """'a:3,b:1' (or 'a=3,b=1') -> {'a': 3.0, 'b': 1.0}; a name alone weighs 1."""
    mix: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = item.replace("=", ":", 1).partition(":")
        try:
            weight = float(value) if value else 1.0
        except ValueError:
            weight = math.nan
        if not name or not weight > 0 or math.isinf(weight):
            raise ValueError(f"bad item {item!r}; use name[:weight>0],...")
        mix[name] = weight
    return mix
