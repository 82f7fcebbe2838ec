"""`splitserve sim`: run a scenario (or compare policies) in simulated time; print, plot, save.

splitserve sim                                    # every policy on a mixed trace
splitserve sim --scenario sjf --plot sjf.png      # fcfs vs sjf vs sjf-aging on a burst
splitserve sim --scenario small-pool --json out.json
splitserve sim --policies fcfs,fair --tenants a:1,b:1 --weights a:10,b:1 --num-requests 2000

Every setting flag defaults to None here (not given); scenarios.resolve puts the scenario's own
settings and the flags the user gave together, in one place.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from scheduler_svc.core import available_policies
from scheduler_svc.core.errors import SchedulerConfigError
from splitserve.sim.costmodel import CALIBRATION_FILE, StepCostModel
from splitserve.sim.report import plot_goodput, plot_ttft, print_table, summarize
from splitserve.sim.scenario_config import (
    CONFIG_FIELDS,
    ScenarioConfig,
    ScenarioFlagError,
    show_value,
)
from splitserve.sim.scenarios import SCENARIOS, describe, resolve
from splitserve.sim.simulator import simulate
from splitserve.sim.trace import parse_mix

_GENERIC = ScenarioConfig()


def _mix(spec: str) -> dict[str, float] | None:
    """name:weight,... (empty: not given)."""
    try:
        return parse_mix(spec) or None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints(spec: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: use integers, e.g. 0,1,2") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one integer")
    return values


def _policy_list(spec: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in spec.split(",") if x.strip())
    known = available_policies()
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(bad) or spec!r}; choose from {', '.join(known)}"
        )
    return names


def _rate_or_scenario(spec: str) -> float | None:
    """A rate >= 0; 0 means the scenario's (None: not given)."""
    try:
        value = float(spec)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{spec!r}: give a rate >= 0")
    return value or None


def _setting(g, name: str, help: str = "", **kw: Any) -> None:
    """A setting flag: stored under its ScenarioConfig field, None when not given."""
    dest = name[2:].replace("-", "_")
    assert dest in CONFIG_FIELDS, dest
    default = getattr(_GENERIC, dest)
    shown = "the scenario's" if default is None else show_value(default)
    text = f"{help}; " if help else ""
    g.add_argument(name, dest=dest, default=None, help=f"{text}default: {shown}", **kw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = describe()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "--scenario",
        default="policies",
        choices=sorted(SCENARIOS),
        help="experiment to run (see splitserve/sim/scenarios.py and below)",
    )
    _setting(p, "--policies", "comma list of policies", type=_policy_list)
    g = p.add_argument_group("trace (a scenario may set its own defaults; a flag given wins)")
    _setting(g, "--num-requests", type=int)
    _setting(
        g,
        "--request-rate",
        "Poisson arrivals/s (0: the scenario's load, from the cost model)",
        type=_rate_or_scenario,
    )
    _setting(g, "--prompt-median", type=float)
    _setting(g, "--prompt-sigma", "log-normal sigma", type=float)
    _setting(g, "--prompt-max", type=int)
    _setting(g, "--output-median", type=float)
    _setting(g, "--output-sigma", type=float)
    _setting(g, "--output-max", type=int)
    _setting(g, "--tenants", "request mix per tenant, e.g. a:1,b:1", type=_mix)
    _setting(g, "--priorities", "priorities drawn uniformly, e.g. 0,1,2", type=_ints)
    _setting(g, "--shared-prefix-len", type=int)
    _setting(g, "--seed", type=int)
    g = p.add_argument_group("scheduler (a scenario may set its own defaults; a flag given wins)")
    _setting(g, "--workers", type=int)
    _setting(g, "--max-num-batched-tokens", type=int)
    _setting(g, "--max-num-seqs", type=int)
    _setting(g, "--block-size", type=int)
    _setting(g, "--num-blocks", type=int)
    _setting(g, "--num-host-blocks", type=int)
    _setting(g, "--preemption-mode", choices=("recompute", "swap", "auto"))
    _setting(g, "--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    _setting(g, "--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    _setting(g, "--max-model-len", type=int)
    _setting(g, "--aging-rate", "0: the scenario's or the policy's default", type=_rate_or_scenario)
    _setting(g, "--weights", "fair share weights, e.g. a:10,b:1 (or a=10,b=1)", type=_mix)
    _setting(
        g,
        "--shed-hopeless",
        "goodput: end a waiting request at once when it can no longer make its deadline",
        action=argparse.BooleanOptionalAction,
    )
    _setting(g, "--ttft-slo-ms", type=float)
    _setting(g, "--thrash-threshold", type=float)
    _setting(g, "--thrash-window-s", type=float)
    _setting(g, "--thrash-backpressure", action=argparse.BooleanOptionalAction)
    g = p.add_argument_group("cost model and output")
    g.add_argument("--calibration", default=None, help=f"profile in {CALIBRATION_FILE.name}")
    g.add_argument("--calibration-file", type=Path, default=None)
    g.add_argument("--json", type=Path, default=None, help="write the summaries here")
    g.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="TTFT distributions per run (PNG); goodput: deadlines met per second by load",
    )


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The setting flags the user gave (by ScenarioConfig field)."""
    return {f: v for f in CONFIG_FIELDS if (v := getattr(args, f, None)) is not None}


def run(args: argparse.Namespace) -> int:
    try:
        cfg = resolve(args.scenario, given_settings(args))
    except ScenarioFlagError as exc:
        return _error(str(exc))
    try:
        cost = StepCostModel.load(args.calibration, args.calibration_file)
    except (OSError, ValueError, KeyError) as exc:
        return _error(f"cost model: {exc}")
    try:
        runs = SCENARIOS[args.scenario].build(cfg, cost)
        results = [simulate(s, trace, cost) for s, trace in runs]
    except SchedulerConfigError as exc:
        return _error(str(exc))
    title = f"splitserve sim: {args.scenario}, cost model {cost.name} (simulated time)"
    print_table(results, title)
    if args.plot:
        plot = plot_goodput if args.scenario == "goodput" else plot_ttft
        print(f"plot: {plot(results, args.plot, title)}")
    if args.json:
        summaries = [_clean(summarize(r)) for r in results]
        args.json.write_text(json.dumps(summaries, indent=2) + "\n")
        print(f"json: {args.json}")
    return 0


def _error(message: str) -> int:
    """argparse's way: one sentence on stderr, exit status 2."""
    print(f"splitserve sim: error: {message}", file=sys.stderr)
    return 2


def _clean(value):
    """JSON has no NaN or infinity: None instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value
