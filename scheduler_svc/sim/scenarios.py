"""Named experiments. Each is a list of (settings, trace) runs compared in one table and plot.

- ``policies``: every policy on one mixed trace (two tenants weighted 3:1, priorities 0-2,
  deadlines), at 1.2 x the workers' capacity until the trace ends.
- ``budget128``: token budget 128 with chunked prefill off, then on (seed experiment 1): off,
  prompts longer than the budget are refused at once (never starved in the queue); on, all run.
- ``small-pool``: the same load on KV pools of 480, 120 and 60 blocks (seed experiment 2):
  preemptions and recomputed tokens rise as the pool shrinks and the thrash signal fires; the
  last run also applies backpressure.
- ``sjf``: sustained load, then the queue drains (seed experiment 3): sjf beats fcfs on median
  TTFT while the longest prompts wait longer; sjf-aging caps their wait.
- ``starvation``: a few long prompts in a stream of short ones that never lets up: sjf starves
  them until the stream ends, sjf-aging bounds their wait.
- ``preemption``: recompute, swap and auto on a small pool with host blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from scheduler_svc.sim.costmodel import StepCostModel
from scheduler_svc.sim.simulator import SimSettings, simulate
from scheduler_svc.sim.trace import TraceConfig, TraceRequest, make_trace

Run = tuple[SimSettings, list[TraceRequest]]


def capacity_rps(cost: StepCostModel, s: SimSettings, tc: TraceConfig, n: int = 150) -> float:
    """Requests per second the workers finish with a queue that never empties: measured on a
    burst of ``n`` requests like ``tc``'s (simulated, so it takes a moment)."""
    burst = make_trace(dataclasses.replace(tc, num_requests=n, request_rate=0.0, seed=tc.seed + 1))
    res = simulate(s, burst, cost)
    return n / max(res.sim_time_s, 1e-9)


def rate_for(load: float, cost: StepCostModel, s: SimSettings, tc: TraceConfig) -> float:
    """Arrivals per second that put ``load`` (1 = capacity) on the workers."""
    return load * capacity_rps(cost, s, tc)


def policy_options(cost: StepCostModel, **extra) -> dict:
    """Options every policy may take, from the cost model (deadline's service estimate)."""
    return {
        "prefill_s_per_token": cost.per_token_s,
        "decode_s_per_token": cost.compute_s(1, 512, 1),
        **extra,
    }


def _replace(s: SimSettings, **kw) -> SimSettings:
    kw.setdefault("policy_options", dict(s.policy_options))
    return dataclasses.replace(s, **kw)


def policies(base: SimSettings, tc: TraceConfig, cost: StepCostModel, names=None) -> list[Run]:
    priorities = tc.priorities if len(tc.priorities) > 1 else (0, 1, 2)
    tc = dataclasses.replace(tc, tenants=tc.tenants or {"a": 1.0, "b": 1.0}, priorities=priorities)
    if not (tc.deadline_base_s or tc.deadline_per_token_s or tc.deadline_per_output_s):
        # slack: twice a prompt token's prefill, and per output token two decode steps of a
        # half-full batch
        seqs = max(1, base.max_num_seqs // 2)
        step = cost.compute_s(seqs, seqs * 512, seqs)
        tc = dataclasses.replace(
            tc,
            deadline_base_s=2.0,
            deadline_per_token_s=2 * cost.per_token_s,
            deadline_per_output_s=1.5 * step,
        )
    if not tc.request_rate:  # a queue builds up (then drains): the policies differ
        tc = dataclasses.replace(tc, request_rate=rate_for(1.2, cost, base, tc))
    trace = make_trace(tc)
    opts = policy_options(cost, weights={"a": 3.0, "b": 1.0}, **base.policy_options)
    names = names or ["fcfs", "priority", "sjf", "sjf-aging", "priority-aging", "fair", "deadline"]
    return [(_replace(base, policy=n, label=n, policy_options=opts), trace) for n in names]


def budget128(base: SimSettings, tc: TraceConfig, cost: StepCostModel, names=None) -> list[Run]:
    s = _replace(base, max_num_batched_tokens=128)
    tc = dataclasses.replace(
        tc, prompt_median=90, prompt_sigma=0.8, prompt_max=1024, output_median=48, output_sigma=0.6
    )
    if not tc.request_rate:
        tc = dataclasses.replace(tc, request_rate=rate_for(0.5, cost, s, tc))
    trace = make_trace(tc)
    return [
        (_replace(s, enable_chunked_prefill=False, label="budget 128, chunked off"), trace),
        (_replace(s, enable_chunked_prefill=True, label="budget 128, chunked on"), trace),
    ]


def small_pool(base: SimSettings, tc: TraceConfig, cost: StepCostModel, names=None) -> list[Run]:
    s = _replace(base, max_model_len=960, max_num_seqs=32)
    tc = dataclasses.replace(
        tc,
        prompt_median=160,
        prompt_sigma=0.6,
        prompt_max=480,
        output_median=160,
        output_sigma=0.6,
        output_max=460,
    )
    if not tc.request_rate:  # comfortable for the largest pool
        tc = dataclasses.replace(
            tc, request_rate=rate_for(0.5, cost, _replace(s, num_blocks=480), tc)
        )
    trace = make_trace(tc)
    runs = [(_replace(s, num_blocks=n, label=f"{n} blocks"), trace) for n in (480, 120, 60)]
    runs.append(
        (
            _replace(s, num_blocks=60, thrash_backpressure=True, label="60 blocks + backpressure"),
            trace,
        )
    )
    return runs


def sjf(base: SimSettings, tc: TraceConfig, cost: StepCostModel, names=None) -> list[Run]:
    """Sustained load (1.1 x capacity: the queue grows), then it drains (a finite trace)."""
    tc = dataclasses.replace(
        tc, prompt_median=200, prompt_sigma=1.0, prompt_max=3000, output_median=24, output_sigma=0.5
    )
    if not tc.request_rate:
        tc = dataclasses.replace(tc, request_rate=rate_for(1.1, cost, base, tc))
    trace = make_trace(tc)
    # aging: the longest prompt is passed by shorter ones for at most 30% of the trace
    rate = tc.prompt_max / (0.3 * max(1e-9, trace[-1].arrival - trace[0].arrival))
    opts = policy_options(cost, aging_rate=rate, **base.policy_options)
    names = names or ["fcfs", "sjf", "sjf-aging"]
    return [(_replace(base, policy=n, label=n, policy_options=opts), trace) for n in names]


def starvation(base: SimSettings, tc: TraceConfig, cost: StepCostModel, names=None) -> list[Run]:
    s = _replace(base, max_num_seqs=16)
    shorts = dataclasses.replace(
        tc,
        prompt_median=48,
        prompt_sigma=0.3,
        prompt_max=96,
        output_median=16,
        output_sigma=0.3,
        output_max=32,
    )
    rate = rate_for(1.2, cost, s, shorts)  # more than the workers can take
    shorts = dataclasses.replace(shorts, request_rate=rate)
    trace = make_trace(shorts)
    longs = [TraceRequest(f"long{k}", 0.5 + k, 1500, 16) for k in range(3)]
    trace = sorted(trace + longs, key=lambda r: r.arrival)
    # aging: the long prompts are passed by short ones for at most a quarter of the stream
    aging = 1500 / (0.25 * max(1e-9, trace[-1].arrival))
    opts = policy_options(cost, aging_rate=aging, **base.policy_options)
    names = names or ["fcfs", "sjf", "sjf-aging"]
    return [(_replace(s, policy=n, label=n, policy_options=opts), trace) for n in names]


def preemption(base: SimSettings, tc: TraceConfig, cost: StepCostModel, names=None) -> list[Run]:
    runs = small_pool(base, tc, cost)[2:3]
    s, trace = runs[0]
    return [
        (
            _replace(
                s,
                preemption_mode=m,
                num_host_blocks=0 if m == "recompute" else 400,
                label=f"60 blocks, {m}",
            ),
            trace,
        )
        for m in ("recompute", "swap", "auto")
    ]


SCENARIOS: dict[str, Callable[..., list[Run]]] = {
    "policies": policies,
    "budget128": budget128,
    "small-pool": small_pool,
    "sjf": sjf,
    "starvation": starvation,
    "preemption": preemption,
}
