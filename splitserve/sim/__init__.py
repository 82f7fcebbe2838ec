"""`splitserve sim`: the real scheduler core against cost-model workers, in simulated time.

from splitserve.sim import SimSettings, TraceConfig, make_trace, simulate, StepCostModel
result = simulate(SimSettings(policy="sjf"), make_trace(TraceConfig(num_requests=500)),
                  StepCostModel.load())
print(summarize(result))
"""

from splitserve.sim.costmodel import StepCostModel
from splitserve.sim.report import percentile, plot_ttft, print_table, summarize
from splitserve.sim.simulator import RequestRecord, SimResult, SimSettings, Simulator, simulate
from splitserve.sim.trace import TraceConfig, TraceRequest, make_trace, parse_mix

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
