"""`splitserve sim`: run a scenario (or compare policies) in simulated time; print, plot, save.

splitserve sim                                    # every policy on a mixed trace
splitserve sim --scenario sjf --plot sjf.png      # fcfs vs sjf vs sjf-aging on a burst
splitserve sim --scenario small-pool --json out.json
splitserve sim --policies fcfs,fair --tenants a:1,b:1 --weights a:10,b:1 --num-requests 2000
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from scheduler_svc.sim.costmodel import CALIBRATION_FILE, StepCostModel
from scheduler_svc.sim.report import plot_ttft, print_table, summarize
from scheduler_svc.sim.scenarios import SCENARIOS
from scheduler_svc.sim.simulator import SimSettings, simulate
from scheduler_svc.sim.trace import TraceConfig, parse_mix


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scenario",
        default="policies",
        choices=sorted(SCENARIOS),
        help="experiment to run (see scheduler_svc/sim/scenarios.py)",
    )
    p.add_argument(
        "--policies", default="", help="comma list of policies (default: the scenario's)"
    )
    g = p.add_argument_group("trace")
    g.add_argument("--num-requests", type=int, default=400)
    g.add_argument(
        "--request-rate",
        type=float,
        default=0.0,
        help="Poisson arrivals/s (0: the scenario's load, from the cost model)",
    )
    g.add_argument("--prompt-median", type=float, default=256.0)
    g.add_argument("--prompt-sigma", type=float, default=0.9, help="log-normal sigma")
    g.add_argument("--prompt-max", type=int, default=2048)
    g.add_argument("--output-median", type=float, default=96.0)
    g.add_argument("--output-sigma", type=float, default=0.8)
    g.add_argument("--output-max", type=int, default=1024)
    g.add_argument("--tenants", default="", help="request mix per tenant, e.g. a:1,b:1")
    g.add_argument("--priorities", default="0", help="priorities drawn uniformly, e.g. 0,1,2")
    g.add_argument("--shared-prefix-len", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("scheduler")
    g.add_argument("--workers", type=int, default=1)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=2048)
    g.add_argument("--num-host-blocks", type=int, default=0)
    g.add_argument("--preemption-mode", default="recompute", choices=("recompute", "swap", "auto"))
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--aging-rate", type=float, default=0.0, help="0: the scenario's or default")
    g.add_argument("--weights", default="", help="fair share weights, e.g. a:10,b:1")
    g.add_argument("--ttft-slo-ms", type=float, default=0.0)
    g.add_argument("--thrash-threshold", type=float, default=0.2)
    g.add_argument("--thrash-window-s", type=float, default=10.0)
    g.add_argument("--thrash-backpressure", action=argparse.BooleanOptionalAction, default=False)
    g = p.add_argument_group("cost model and output")
    g.add_argument("--calibration", default=None, help=f"profile in {CALIBRATION_FILE.name}")
    g.add_argument("--calibration-file", type=Path, default=None)
    g.add_argument("--json", type=Path, default=None, help="write the summaries here")
    g.add_argument("--plot", type=Path, default=None, help="TTFT distributions per run (PNG)")


def run(args: argparse.Namespace) -> int:
    cost = StepCostModel.load(args.calibration, args.calibration_file)
    options: dict = {}
    if args.aging_rate:
        options["aging_rate"] = args.aging_rate
    if args.weights:
        options["weights"] = parse_mix(args.weights)
    base = SimSettings(
        num_workers=args.workers,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        num_host_blocks=args.num_host_blocks,
        preemption_mode=args.preemption_mode,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        max_model_len=args.max_model_len,
        ttft_slo_ms=args.ttft_slo_ms,
        thrash_threshold=args.thrash_threshold,
        thrash_window_s=args.thrash_window_s,
        thrash_backpressure=args.thrash_backpressure,
        shared_prefix_len=args.shared_prefix_len,
        policy_options=options,
    )
    tc = TraceConfig(
        num_requests=args.num_requests,
        request_rate=args.request_rate,
        prompt_median=args.prompt_median,
        prompt_sigma=args.prompt_sigma,
        prompt_max=args.prompt_max,
        output_median=args.output_median,
        output_sigma=args.output_sigma,
        output_max=args.output_max,
        tenants=parse_mix(args.tenants) if args.tenants else {},
        priorities=tuple(int(x) for x in args.priorities.split(",") if x),
        shared_prefix_len=args.shared_prefix_len,
        seed=args.seed,
    )
    names = [x for x in args.policies.split(",") if x] or None
    runs = SCENARIOS[args.scenario](base, tc, cost, names)
    results = [simulate(s, trace, cost) for s, trace in runs]
    title = f"splitserve sim: {args.scenario}, cost model {cost.name} (simulated time)"
    print_table(results, title)
    if args.plot:
        print(f"plot: {plot_ttft(results, args.plot, title)}")
    if args.json:
        summaries = [_clean(summarize(r)) for r in results]
        args.json.write_text(json.dumps(summaries, indent=2) + "\n")
        print(f"json: {args.json}")
    return 0


def _clean(value):
    """JSON has no NaN or infinity: None instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value
