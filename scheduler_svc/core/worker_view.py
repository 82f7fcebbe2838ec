"""What the worker holds of each request, and the diff entries that tell it more.

The worker keeps a row per request it was sent as new, until the request is reported finished.
A request (re)joining the running set travels as new where the worker has no row for it and as
a resumed row with its full block table where it has one. An adopted request (adoption.py) runs
with no row on the worker until its first step. Requests that ended are reported once, in the
next step's finished ids.
"""

from __future__ import annotations

from common.messages import CachedRequestData, NewRequestData
from scheduler_svc.core.request import Request
from scheduler_svc.core.step_state import StepState


def new_request_data(
    request: Request, block_ids: list[int], num_computed_tokens: int
) -> NewRequestData:
    """The diff entry that gives the worker a row: the request's prompt, sampling params, block
    table, how many tokens its KV holds already, its output so far and its adapter."""
    return NewRequestData(
        request.request_id,
        request.prompt_token_ids,
        request.sampling_params,
        block_ids,
        num_computed_tokens,
        list(request.output_token_ids),
        lora_name=request.lora_name,
    )


class WorkerView:
    __slots__ = ("known", "adopted_unsent", "finished")

    def __init__(self) -> None:
        self.known: set[str] = set()  # sent to the worker as new and not finished since
        self.adopted_unsent: set[str] = set()  # adopted and running, the worker forgot the row
        self.finished: set[str] = set()  # ended since the last step: its finished ids

    def send(
        self, request: Request, block_ids: list[int], num_computed_tokens: int, step: StepState
    ) -> None:
        """``request`` joins this step's batch holding ``block_ids`` (its whole table), its KV
        holding ``num_computed_tokens``: resumed where the worker has its row, else new."""
        rid = request.request_id
        if rid in self.known:
            step.cached_reqs.append(
                CachedRequestData(
                    rid,
                    block_ids,
                    num_computed_tokens,
                    resumed=True,
                    new_token_ids=list(request.output_token_ids),
                )
            )
        else:
            self.known.add(rid)
            step.new_reqs.append(new_request_data(request, block_ids, num_computed_tokens))

    def withdraw(self, request_id: str, step: StepState) -> None:
        """Take the request's entry out of this step's diff (preempted after it was scheduled);
        one that was to travel as new stays unknown to the worker."""
        cached = step.cached_reqs
        for j in range(len(cached) - 1, -1, -1):
            if cached[j].request_id == request_id:
                del cached[j]
                return
        new = step.new_reqs
        for j in range(len(new) - 1, -1, -1):
            if new[j].request_id == request_id:
                del new[j]
                self.known.discard(request_id)
                return

    def end(self, request_id: str) -> None:
        """The request finished, was aborted or shed: the next diff tells the worker to drop it."""
        self.finished.add(request_id)
        self.known.discard(request_id)

    def take_finished(self) -> set[str]:
        finished, self.finished = self.finished, set()
        return finished
