"""The experiments behind the named scenarios (scenarios.py): each builds, from its resolved
``ScenarioConfig`` and the cost model, a list of (settings, trace) runs compared in one table
and plot.

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
- ``goodput``: fcfs, priority, deadline and goodput at 0.8, 1.0, 1.2 and 1.5 x capacity on the
  policies trace and on a bursty one (the same requests, each period's arrivals squeezed into
  its first third) and on one where every other request carries TTFT and TPOT targets instead
  of its deadline: requests that meet their targets per second.
"""

from __future__ import annotations

import dataclasses

from splitserve.sim.costmodel import StepCostModel
from splitserve.sim.scenario_config import Run, ScenarioConfig
from splitserve.sim.simulator import SimSettings, simulate
from splitserve.sim.trace import TraceConfig, TraceRequest, make_trace


def capacity_rps(cost: StepCostModel, s: SimSettings, tc: TraceConfig, n: int = 150) -> float:
    """Requests per second the workers finish with a queue that never empties: measured on a
    burst of ``n`` requests like ``tc``'s (simulated, so it takes a moment)."""
    burst = make_trace(dataclasses.replace(tc, num_requests=n, request_rate=0.0, seed=tc.seed + 1))
    res = simulate(s, burst, cost)
    return n / max(res.sim_time_s, 1e-9)


def rate_for(load: float, cost: StepCostModel, s: SimSettings, tc: TraceConfig) -> float:
    """Arrivals per second that put ``load`` (1 = capacity) on the workers."""
    return load * capacity_rps(cost, s, tc)


def policy_options(cost: StepCostModel, batch: int = 32, workers: int = 1, **extra) -> dict:
    """Options every policy may take, from the cost model (deadline's and goodput's service
    estimates: a decode step alone, and one output token's share of a step of ``batch``)."""
    return {
        "prefill_s_per_token": cost.per_token_s,
        "decode_s_per_token": cost.compute_s(1, 512, 1),
        "decode_work_s_per_token": cost.compute_s(batch, batch * 512, batch) / batch,
        "decode_s_per_seq": cost.compute_s(2, 2 * 512, 2) - cost.compute_s(1, 512, 1),
        "num_workers": workers,
        **extra,
    }


def _replace(s: SimSettings, **kw) -> SimSettings:
    kw.setdefault("policy_options", dict(s.policy_options))
    return dataclasses.replace(s, **kw)


def _rate(
    cfg: ScenarioConfig, tc: TraceConfig, load: float, cost: StepCostModel, s: SimSettings
) -> TraceConfig:
    """``tc`` at the user's request rate, else at ``load`` x the capacity of ``s``."""
    rate = cfg.request_rate if cfg.request_rate is not None else rate_for(load, cost, s, tc)
    return dataclasses.replace(tc, request_rate=rate)


def _compare_policies(
    cfg: ScenarioConfig, s: SimSettings, trace: list[TraceRequest], opts: dict, default: list[str]
) -> list[Run]:
    names = list(cfg.policies or default)
    return [(_replace(s, policy=n, label=n, policy_options=opts), trace) for n in names]


def _with_deadlines(tc: TraceConfig, cost: StepCostModel, s: SimSettings) -> TraceConfig:
    """Slack: twice a prompt token's prefill, and per output token 1.5 decode steps of a
    half-full batch."""
    seqs = max(1, s.max_num_seqs // 2)
    step = cost.compute_s(seqs, seqs * 512, seqs)
    return dataclasses.replace(
        tc,
        deadline_base_s=2.0,
        deadline_per_token_s=2 * cost.per_token_s,
        deadline_per_output_s=1.5 * step,
    )


def _options(cfg: ScenarioConfig, cost: StepCostModel, s: SimSettings, **extra) -> dict:
    batch = max(1, s.max_num_seqs // 2)
    return policy_options(cost, batch, s.num_workers, **{**cfg.user_options(), **extra})


def policies(cfg: ScenarioConfig, cost: StepCostModel) -> list[Run]:
    base = cfg.sim_settings()
    tc = _with_deadlines(cfg.trace_config(), cost, base)
    tc = _rate(cfg, tc, 1.2, cost, base)  # a queue builds up (then drains): the policies differ
    opts = _options(cfg, cost, base)
    names = ["fcfs", "priority", "sjf", "sjf-aging", "priority-aging", "fair", "deadline"]
    return _compare_policies(cfg, base, make_trace(tc), opts, names)


GOODPUT_LOADS = (0.8, 1.0, 1.2, 1.5)
BURST_PERIOD_S = 30.0


def bursty(trace: list[TraceRequest], period_s: float = BURST_PERIOD_S) -> list[TraceRequest]:
    """The same requests, each period's arrivals squeezed into its first third (three times the
    rate, then nothing); the mean rate and every request's slack are kept."""
    out = []
    for r in trace:
        start = r.arrival // period_s * period_s
        shift = (r.arrival - start) * 2 / 3
        d = None if r.deadline is None else r.deadline - shift
        out.append(dataclasses.replace(r, arrival=r.arrival - shift, deadline=d))
    return sorted(out, key=lambda r: r.arrival)


def with_targets(trace: list[TraceRequest], tc: TraceConfig) -> list[TraceRequest]:
    """The same requests, every other one with TTFT and TPOT targets instead of its deadline:
    the deadline's slack split into a first token within the base slack and the prompt's
    prefill slack, then each output token within the deadline's per-output slack."""
    out = []
    for k, r in enumerate(trace):
        if k % 2 or r.deadline is None:
            out.append(r)
            continue
        ttft = tc.deadline_base_s + tc.deadline_per_token_s * r.prompt_len
        tpot = tc.deadline_per_output_s
        out.append(dataclasses.replace(r, deadline=None, ttft_target_s=ttft, tpot_target_s=tpot))
    return out


def goodput_label(policy: str, load: float, trace: str) -> str:
    return f"{policy} {load:g}x {trace}"


def goodput(cfg: ScenarioConfig, cost: StepCostModel) -> list[Run]:
    base = cfg.sim_settings()
    tc = _with_deadlines(cfg.trace_config(), cost, base)
    capacity = None if cfg.request_rate is not None else capacity_rps(cost, base, tc)
    names = list(cfg.policies or ("fcfs", "priority", "deadline", "goodput"))
    runs: list[Run] = []
    for load in GOODPUT_LOADS:
        rate = cfg.request_rate if capacity is None else load * capacity
        steady = make_trace(dataclasses.replace(tc, request_rate=rate))
        traces = (
            ("policies", steady),
            ("bursty", bursty(steady)),
            ("targets", with_targets(steady, tc)),
        )
        for trace_name, trace in traces:
            for n in names:
                opts = _options(cfg, cost, base)
                label = goodput_label(n, load, trace_name)
                runs.append((_replace(base, policy=n, label=label, policy_options=opts), trace))
    return runs


def budget128(cfg: ScenarioConfig, cost: StepCostModel) -> list[Run]:
    s = cfg.sim_settings()
    tc = _rate(cfg, cfg.trace_config(), 0.5, cost, s)
    trace = make_trace(tc)
    budget = f"budget {s.max_num_batched_tokens}"
    return [
        (_replace(s, enable_chunked_prefill=False, label=f"{budget}, chunked off"), trace),
        (_replace(s, enable_chunked_prefill=True, label=f"{budget}, chunked on"), trace),
    ]


SMALL_POOLS = (480, 120, 60)


def _small_pool_trace(cfg: ScenarioConfig, cost: StepCostModel) -> list[TraceRequest]:
    """small-pool's trace: a load comfortable for its largest pool."""
    s = _replace(cfg.sim_settings(), num_blocks=SMALL_POOLS[0])
    return make_trace(_rate(cfg, cfg.trace_config(), 0.5, cost, s))


def small_pool(cfg: ScenarioConfig, cost: StepCostModel) -> list[Run]:
    s = cfg.sim_settings()
    trace = _small_pool_trace(cfg, cost)
    runs = [(_replace(s, num_blocks=n, label=f"{n} blocks"), trace) for n in SMALL_POOLS]
    n = SMALL_POOLS[-1]
    bp = _replace(s, num_blocks=n, thrash_backpressure=True, label=f"{n} blocks + backpressure")
    return [*runs, (bp, trace)]


def sjf(cfg: ScenarioConfig, cost: StepCostModel) -> list[Run]:
    """Sustained load (1.1 x capacity: the queue grows), then it drains (a finite trace)."""
    base = cfg.sim_settings()
    tc = _rate(cfg, cfg.trace_config(), 1.1, cost, base)
    trace = make_trace(tc)
    # aging: the longest prompt is passed by shorter ones for at most 30% of the trace
    aging = cfg.aging_rate
    if aging is None:
        aging = tc.prompt_max / (0.3 * max(1e-9, trace[-1].arrival - trace[0].arrival))
    opts = _options(cfg, cost, base, aging_rate=aging)
    return _compare_policies(cfg, base, trace, opts, ["fcfs", "sjf", "sjf-aging"])


STARVATION_LONG_PROMPT = 1500


def starvation(cfg: ScenarioConfig, cost: StepCostModel) -> list[Run]:
    s = cfg.sim_settings()
    shorts = _rate(cfg, cfg.trace_config(), 1.2, cost, s)  # more than the workers can take
    trace = make_trace(shorts)
    longs = [TraceRequest(f"long{k}", 0.5 + k, STARVATION_LONG_PROMPT, 16) for k in range(3)]
    trace = sorted(trace + longs, key=lambda r: r.arrival)
    # aging: the long prompts are passed by short ones for at most a quarter of the stream
    aging = cfg.aging_rate
    if aging is None:
        aging = STARVATION_LONG_PROMPT / (0.25 * max(1e-9, trace[-1].arrival))
    opts = _options(cfg, cost, s, aging_rate=aging)
    return _compare_policies(cfg, s, trace, opts, ["fcfs", "sjf", "sjf-aging"])


def preemption(cfg: ScenarioConfig, cost: StepCostModel) -> list[Run]:
    """small-pool's trace on a small pool; the swap and auto runs get the host blocks."""
    s = cfg.sim_settings()
    # small-pool's load, measured as small-pool measures it (no host pool)
    trace = _small_pool_trace(dataclasses.replace(cfg, num_host_blocks=0), cost)
    return [
        (
            _replace(
                s,
                preemption_mode=m,
                num_host_blocks=0 if m == "recompute" else s.num_host_blocks,
                label=f"{s.num_blocks} blocks, {m}",
            ),
            trace,
        )
        for m in ("recompute", "swap", "auto")
    ]
