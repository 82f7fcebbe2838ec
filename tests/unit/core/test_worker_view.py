"""WorkerView: what the worker holds of a request decides how it travels in a step."""

from __future__ import annotations

from scheduler_svc.core.step_state import StepState
from scheduler_svc.core.worker_view import WorkerView
from tests.factories import prompt, request


def test_a_request_the_worker_lacks_travels_new_with_its_prompt_output_and_table():
    view, step = WorkerView(), StepState(step_id=0, budget=64)
    view.send(request("r", prompt(6), out=[9, 8]), [3, 4], 4, step)
    (new,) = step.new_reqs
    assert (new.request_id, new.prompt_token_ids, new.block_ids) == ("r", prompt(6), [3, 4])
    assert new.num_computed_tokens == 4 and new.output_token_ids == [9, 8]
    assert not step.cached_reqs and "r" in view.known


def test_a_request_the_worker_holds_resumes_with_its_whole_table():
    view, step = WorkerView(), StepState(step_id=1, budget=64)
    view.known.add("r")
    view.send(request("r", prompt(6), out=[9]), [3, 4], 5, step)
    (cached,) = step.cached_reqs
    assert cached.resumed and cached.new_block_ids == [3, 4] and cached.num_computed_tokens == 5
    assert cached.new_token_ids == [9] and not step.new_reqs


def test_a_withdrawn_new_request_stays_unknown_to_the_worker():
    view, step = WorkerView(), StepState(step_id=0, budget=64)
    view.send(request("r", prompt(4)), [1], 0, step)
    view.withdraw("r", step)
    assert not step.new_reqs and "r" not in view.known


def test_ended_requests_are_reported_once_and_forgotten():
    view = WorkerView()
    view.known.add("r")
    view.end("r")
    assert view.take_finished() == {"r"} and view.take_finished() == set()
    assert "r" not in view.known
