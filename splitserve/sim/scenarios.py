"""Named experiments: the scenarios `splitserve sim --scenario` runs, each with its own settings
and the flags it refuses. The runs each builds are in experiments.py; ``ScenarioConfig`` and
``Scenario`` in scenario_config.py.

Where settings meet: a run's settings are a ``ScenarioConfig`` (one field per `splitserve sim`
setting flag). ``resolve`` is the one place they are put together: ScenarioConfig's generic
defaults, over them the scenario's own ``defaults``, over those the flags the user gave. A
scenario never overrides a resolved value; a setting it varies across its runs is listed in its
``refuses`` (with the reason) and a flag for it is an error, not silently dropped. A field left
None (request_rate, aging_rate) is the scenario's to derive (from the cost model or the trace).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from splitserve.sim.costmodel import StepCostModel
from splitserve.sim.experiments import (
    STARVATION_LONG_PROMPT,
    budget128,
    goodput,
    policies,
    preemption,
    sjf,
    small_pool,
    starvation,
)
from splitserve.sim.scenario_config import (
    CONFIG_FIELDS,
    Run,
    Scenario,
    ScenarioConfig,
    ScenarioFlagError,
    flag_name,
    show_value,
)

_FCFS_ONLY = "it runs fcfs only"
_RUNS_FCFS = {
    "policies": _FCFS_ONLY,
    "aging_rate": _FCFS_ONLY,
    "weights": _FCFS_ONLY,
    "shed_hopeless": _FCFS_ONLY,
}


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
