"""`splitserve sim`: the real scheduler core against cost-model workers, in simulated time.

from scheduler_svc.sim import SimSettings, TraceConfig, make_trace, simulate, StepCostModel
result = simulate(SimSettings(policy="sjf"), make_trace(TraceConfig(num_requests=500)),
                  StepCostModel.load())
print(summarize(result))
"""

from scheduler_svc.sim.costmodel import StepCostModel
from scheduler_svc.sim.report import percentile, plot_ttft, print_table, summarize
from scheduler_svc.sim.simulator import RequestRecord, SimResult, SimSettings, Simulator, simulate
from scheduler_svc.sim.trace import TraceConfig, TraceRequest, make_trace, parse_mix

__all__ = [
    "RequestRecord",
    "SimResult",
    "SimSettings",
    "Simulator",
    "StepCostModel",
    "TraceConfig",
    "TraceRequest",
    "make_trace",
    "parse_mix",
    "percentile",
    "plot_ttft",
    "print_table",
    "simulate",
    "summarize",
]
