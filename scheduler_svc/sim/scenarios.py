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
- ``goodput``: fcfs, priority, deadline and goodput at 0.8, 1.0, 1.2 and 1.5 x capacity on the
  policies trace and on a bursty one (the same requests, each period's arrivals squeezed into
  its first third) and on one where every other request carries TTFT and TPOT targets instead
  of its deadline: requests that meet their targets per second.

Where settings meet: a run's settings are a ``ScenarioConfig`` (one field per `splitserve sim`
setting flag). ``resolve`` is the one place they are put together: ScenarioConfig's generic
defaults, over them the scenario's own ``defaults``, over those the flags the user gave. A
scenario never overrides a resolved value; a setting it varies across its runs is listed in its
``refuses`` (with the reason) and a flag for it is an error, not silently dropped. A field left
None (request_rate, aging_rate) is the scenario's to derive (from the cost model or the trace).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from scheduler_svc.sim.costmodel import StepCostModel
from scheduler_svc.sim.simulator import SimSettings, simulate
from scheduler_svc.sim.trace import TraceConfig, TraceRequest, make_trace

Run = tuple[SimSettings, list[TraceRequest]]


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


def resolve(name: str, given: Mapping[str, Any] | None = None) -> ScenarioConfig:
    """The one place a scenario's own settings and the user's flags meet: ScenarioConfig's
    generic defaults, over them the scenario's ``defaults``, over those ``given`` (the flags the
    user gave, by field name). A setting the scenario refuses is a ScenarioFlagError."""
    given = dict(given or {})
    if name not in SCENARIOS:
        raise ScenarioFlagError(f"no scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    scenario = SCENARIOS[name]
    unknown = sorted(set(given) - set(CONFIG_FIELDS))
    if unknown:
        raise ScenarioFlagError(f"not a sim setting: {', '.join(unknown)}")
    refused = [k for k in CONFIG_FIELDS if k in given and k in scenario.refuses]
    if refused:
        raise ScenarioFlagError(
            "; ".join(
                f"--scenario {name} does not take {flag_name(k)}: {scenario.refuses[k]}"
                for k in refused
            )
        )
    return ScenarioConfig(**copy.deepcopy({**scenario.defaults, **given}))


def build_runs(name: str, cost: StepCostModel, **given: Any) -> list[Run]:
    """The runs of scenario ``name`` with the settings ``given`` (ScenarioConfig fields)."""
    return SCENARIOS[name].build(resolve(name, given), cost)


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


_FCFS_ONLY = "it runs fcfs only"
_RUNS_FCFS = {
    "policies": _FCFS_ONLY,
    "aging_rate": _FCFS_ONLY,
    "weights": _FCFS_ONLY,
    "shed_hopeless": _FCFS_ONLY,
}


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


_SMALL_POOL_DEFAULTS = {
    "max_model_len": 960,
    "max_num_seqs": 32,
    "prompt_median": 160,
    "prompt_sigma": 0.6,
    "prompt_max": 480,
    "output_median": 160,
    "output_sigma": 0.6,
    "output_max": 460,
}

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "policies",
            policies,
            "every policy on one mixed trace (tenants, priorities, deadlines) at 1.2 x capacity",
            defaults={
                "tenants": {"a": 1.0, "b": 1.0},
                "priorities": (0, 1, 2),
                "weights": {"a": 3.0, "b": 1.0},
            },
        ),
        Scenario(
            "goodput",
            goodput,
            "fcfs, priority, deadline, goodput at 0.8-1.5 x capacity: steady, bursty, TTFT/TPOT",
            defaults={
                "num_requests": 300,
                "tenants": {"a": 1.0, "b": 1.0},
                "priorities": (0, 1, 2),
            },
        ),
        Scenario(
            "budget128",
            budget128,
            "token budget 128, chunked prefill off then on, at 0.5 x capacity",
            defaults={
                "max_num_batched_tokens": 128,
                "prompt_median": 90,
                "prompt_sigma": 0.8,
                "prompt_max": 1024,
                "output_median": 48,
                "output_sigma": 0.6,
            },
            refuses={
                "enable_chunked_prefill": "it runs chunked prefill off, then on",
                **_RUNS_FCFS,
            },
        ),
        Scenario(
            "small-pool",
            small_pool,
            "KV pools of 480, 120 and 60 blocks, then 60 with backpressure, at 0.5 x capacity",
            defaults=_SMALL_POOL_DEFAULTS,
            refuses={
                "num_blocks": "it runs pools of 480, 120 and 60 blocks",
                "thrash_backpressure": "its last run turns backpressure on, the others off",
                **_RUNS_FCFS,
            },
        ),
        Scenario(
            "sjf",
            sjf,
            "fcfs, sjf, sjf-aging at 1.1 x capacity until the trace ends",
            defaults={
                "prompt_median": 200,
                "prompt_sigma": 1.0,
                "prompt_max": 3000,
                "output_median": 24,
                "output_sigma": 0.5,
            },
        ),
        Scenario(
            "starvation",
            starvation,
            f"3 prompts of {STARVATION_LONG_PROMPT} tokens in short ones at 1.2 x capacity",
            defaults={
                "max_num_seqs": 16,
                "prompt_median": 48,
                "prompt_sigma": 0.3,
                "prompt_max": 96,
                "output_median": 16,
                "output_sigma": 0.3,
                "output_max": 32,
            },
        ),
        Scenario(
            "preemption",
            preemption,
            "recompute, swap and auto (with host blocks) on small-pool's 60-block pool",
            defaults={**_SMALL_POOL_DEFAULTS, "num_blocks": 60, "num_host_blocks": 400},
            refuses={"preemption_mode": "it runs recompute, swap and auto", **_RUNS_FCFS},
        ),
    )
}


def describe() -> str:
    """Each scenario's own settings and the flags it refuses (for --help)."""
    lines = ["scenarios (a flag given wins over the scenario's setting):"]
    for s in SCENARIOS.values():
        lines.append(f"  {s.name}: {s.summary}")
        if s.defaults:
            sets = ", ".join(f"{flag_name(k)} {show_value(v)}" for k, v in s.defaults.items())
            lines.append(f"    sets {sets}")
        if s.refuses:
            lines.append(f"    refuses {', '.join(flag_name(k) for k in s.refuses)}")
    return "\n".join(lines)


def show_value(value: Any) -> str:
    """A setting's value as its flag takes it."""
    if isinstance(value, dict):
        return ",".join(f"{k}:{v:g}" for k, v in value.items()) or "none"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)
