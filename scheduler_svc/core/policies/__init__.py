"""Built-in scheduling policies beyond fcfs and priority (those live in core/policy.py).

Importing this package registers them by name:

- ``sjf``: shortest remaining prompt first (tokens still to prefill; a preempted request counts
  its prompt and output, which it recomputes).
- ``sjf-aging`` / ``priority-aging``: the same with linear aging, ``aging_rate`` tokens
  (sjf) or priority levels (priority) per second waited, so nothing starves.
- ``fair``: weighted fair share of computed tokens across tenants (``weights``).
- ``deadline``: earliest deadline first; requests that can no longer meet theirs are demoted.
- ``goodput``: the most requests within their deadlines (predicted work, feasible-set EDF).
"""

from scheduler_svc.core.policies.deadline import DeadlinePolicy
from scheduler_svc.core.policies.fair import FairSharePolicy, TenantFairQueue
from scheduler_svc.core.policies.goodput import GoodputPolicy
from scheduler_svc.core.policies.ordering import PriorityAgingPolicy, SJFAgingPolicy, SJFPolicy

__all__ = [
    "DeadlinePolicy",
    "FairSharePolicy",
    "GoodputPolicy",
    "PriorityAgingPolicy",
    "SJFAgingPolicy",
    "SJFPolicy",
    "TenantFairQueue",
]
