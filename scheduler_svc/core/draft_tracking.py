"""Speculative decoding across steps: how many drafts a step takes, the drafts each step still
in flight carries, and what verification kept (speculative.py and prediction.py draft,
draft_budget.py sizes).

Without --speculative-config only requests that carry a prediction (OpenAI's Predicted Outputs)
draft, with the defaults of SpeculativeConfig (PREDICTION_DEFAULTS); while none is known to this
scheduler a step costs nothing more than with speculation off."""

from __future__ import annotations

from collections.abc import Iterable
from time import perf_counter

from common.messages import NewRequestData, SchedulerOutput
from scheduler_svc.core.draft_budget import DraftBudget
from scheduler_svc.core.prediction import PredictionProposer
from scheduler_svc.core.preemption_cost import WorkerCosts
from scheduler_svc.core.request import Request
from scheduler_svc.core.speculative import (
    UNMEASURED_MAX_BATCH,
    NgramProposer,
    Proposer,
    SpecCounters,
    SpeculativeConfig,
    drafts_allowed,
)
from scheduler_svc.core.step_state import MAX_STEPS_IN_FLIGHT

# drafting for requests with a prediction on a server without --speculative-config: k is its
# num_speculative_tokens (docs/speculative.md, "Predicted Outputs")
PREDICTION_DEFAULTS = SpeculativeConfig()


class DraftTracker:
    __slots__ = (
        "proposer",
        "max_drafts",
        "max_batch",
        "budget",
        "in_flight",
        "counts",
        "everyone",
        "predicted",
    )

    def __init__(self, spec: SpeculativeConfig | None, costs: WorkerCosts | None) -> None:
        # everyone drafts with --speculative-config; else only requests with a prediction
        self.everyone = spec is not None
        config = spec if spec is not None else PREDICTION_DEFAULTS
        self.proposer: Proposer | None = PredictionProposer(NgramProposer(config), self.everyone)
        self.predicted: set[str] = set()  # requests with a prediction that reached a worker
        self.max_drafts = config.num_speculative_tokens
        self.max_batch = config.max_batch
        # sized by the worker's measured step times where it measured them
        self.budget = (
            DraftBudget(costs.verify_step_s) if costs is not None and costs.verify_step_s else None
        )
        if self.budget is None and self.max_batch is None:
            self.max_batch = UNMEASURED_MAX_BATCH
        self.in_flight: dict[int, dict[str, int]] = {}  # step -> request -> drafts sent
        self.counts = SpecCounters(accepted_per_pos=[0] * self.max_drafts)

    def for_step(self, rows: int) -> int:
        """The most drafted tokens this step takes with `rows` running requests."""
        cap = self.max_batch
        if cap is not None and rows > cap:
            return 0
        drafting = rows if self.everyone else min(rows, len(self.predicted))
        most = drafting * self.max_drafts
        return most if self.budget is None or not most else self.budget.best(rows, most)

    def admitted(self, new_requests: Iterable[NewRequestData]) -> None:
        """Requests sent to the worker this step: those with a prediction may draft from now."""
        for new in new_requests:
            if new.sampling_params.prediction:
                self.predicted.add(new.request_id)

    def awaiting_latest_token(self, proposer: Proposer, running: Iterable[Request]) -> bool:
        """A running request that will draft has its last token still on its way."""
        everyone = self.everyone
        return any(
            r.num_output_placeholders
            and (everyone or r.sampling_params.prediction)
            and drafts_allowed(r)
            and proposer.active(r)
            for r in running
        )

    def propose(self, proposer: Proposer, request: Request, room: int) -> list[int] | None:
        """Up to `room` drafts for the request's next step; None when nothing matched."""
        started = perf_counter()
        drafts = proposer.propose(request, room) or None
        self.counts.draft_time_s += perf_counter() - started
        self.counts.lookups += 1
        return drafts

    def sent(self, step_id: int, drafts: dict[str, list[int]]) -> None:
        in_flight = self.in_flight
        in_flight[step_id] = {rid: len(d) for rid, d in drafts.items()}
        if len(in_flight) > MAX_STEPS_IN_FLIGHT:
            del in_flight[min(in_flight)]

    def take_step(self, step_id: int) -> dict[str, int] | None:
        """The drafts step `step_id` carried, by request, now that its outputs are back."""
        return self.in_flight.pop(step_id, None) if self.in_flight else None

    def in_flight_for(self, request_id: str) -> bool:
        return any(request_id in drafts for drafts in self.in_flight.values())

    def verified(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        self.counts.verified(num_drafted, num_accepted)
        if self.budget is not None:
            self.budget.verified(num_drafted, num_accepted)
        if self.proposer is not None:
            self.proposer.record(request, num_drafted, num_accepted)

    def worker_waited(self, step: SchedulerOutput, idle_s: float) -> None:
        """The worker's idle time before `step`: before a step with drafts it is what verifying
        costs beyond the forward pass (the batch waited for its tokens)."""
        if step.spec_token_ids and self.budget is not None:
            self.budget.waited(idle_s)

    def forget(self, request_id: str) -> None:
        self.predicted.discard(request_id)
        if self.proposer is not None:
            self.proposer.forget(request_id)
