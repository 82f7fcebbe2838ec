"""Predicted Outputs in the scheduler core (prediction.py): drafts are the prediction's next
tokens where the output is in it, found again after the output departs from it, prompt lookup
when it has nothing; a request with a prediction drafts on a server without speculation, the
others do not; greedy verification (played here by a deterministic "model") keeps the output."""

from __future__ import annotations

import pytest

from common.messages import SamplingParams
from scheduler_svc.core import Request, RequestRejected
from scheduler_svc.core.prediction import PredictionProposer
from scheduler_svc.core.speculative import MAX_MISSES, NgramProposer, SpeculativeConfig
from tests.factories import request, scheduler_factory

make = scheduler_factory(
    block_size=4, num_blocks=512, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512
)
PREDICTION = tuple(range(10, 30))


def proposer(everyone: bool = False) -> PredictionProposer:
    return PredictionProposer(NgramProposer(SpeculativeConfig()), everyone)


def predicted(output=(), prompt=(1, 2, 3, 4, 5), prediction=PREDICTION) -> Request:
    return Request(
        "r", list(prompt), SamplingParams(prediction=prediction), output_token_ids=output
    )


def test_drafts_follow_the_output_along_the_prediction():
    p = proposer()
    req = predicted()
    assert p.active(req) and p.wants(req)
    assert p.propose(req, 4) == [10, 11, 12, 13]
    req.output_token_ids += [10, 11, 12]  # drafts kept: the cursor moves on
    assert p.propose(req, 3) == [13, 14, 15]
    req.output_token_ids += [13, 14, 15, 16, 17]
    assert p.propose(req, 10) == [18, 19, 20, 21, 22, 23, 24, 25, 26, 27]


def test_the_alignment_is_found_again_after_the_output_departs():
    p = proposer()
    req = predicted([10, 99])  # 11 became 99: lost at index 1
    assert p.propose(req, 4) == []  # "10 99" is nowhere; the prompt does not repeat either
    req.output_token_ids.append(12)
    assert p.propose(req, 4) == []  # "99 12": still one token (12) of a match, two needed
    req.output_token_ids.append(13)
    assert p.propose(req, 4) == [14, 15, 16, 17]  # "12 13" ends at index 4
    # a token dropped from the output (15 never comes): found again two tokens on
    req.output_token_ids += [14, 16, 17]
    assert p.propose(req, 2) == [18, 19]


def test_realignment_prefers_the_longest_then_the_nearest_match_after_the_loss():
    p = proposer()
    prediction = (1, 2, 3, 4, 1, 2, 3, 5, 6)
    req = predicted([9, 1, 2], prediction=prediction)
    assert p.propose(req, 3) == [3, 4, 1]  # "1 2" at 0..2 and 4..6: the nearest
    p.forget("r")
    req = predicted([1, 2, 3, 4, 9, 2, 3], prediction=prediction)
    assert p.propose(req, 3) == [5, 6]  # lost at index 4: "2 3" only from there on
    p.forget("r")
    req = predicted([7, 8, 2, 3], prediction=(2, 3, 9, 9, 8, 2, 3, 4))
    assert p.propose(req, 2) == [4]  # "8 2 3" beats the nearer "2 3"


def test_a_used_up_prediction_falls_back_to_prompt_lookup():
    p = proposer()
    prompt = [40, 41, 42, 43, 44, 45]
    req = predicted(list(PREDICTION), prompt=prompt, prediction=PREDICTION)
    assert p.propose(req, 4) == []  # the output is the whole prediction; the prompt has no "28 29"
    req.output_token_ids += [42, 43]  # "42 43" is in the prompt: 44, 45, 10, 11 followed it
    assert p.propose(req, 4) == [44, 45, 10, 11]


def test_requests_without_a_prediction_draft_only_with_speculation_on():
    repetitive = Request("n", [5, 6, 7, 8, 5, 6, 7], SamplingParams())
    off = proposer(everyone=False)
    assert not off.active(repetitive) and not off.wants(repetitive)
    on = proposer(everyone=True)
    assert on.active(repetitive) and on.wants(repetitive)
    assert on.propose(repetitive, 2) == [8, 5]


def test_a_request_whose_lookups_keep_missing_backs_off():
    p = proposer()
    req = predicted([99], prompt=[1, 2, 3, 4])
    for _ in range(MAX_MISSES):
        assert p.wants(req)
        assert p.propose(req, 4) == []
        req.output_token_ids.append(100 + len(req.output_token_ids))
        if p.active(req):
            continue
        assert not p.wants(req)  # the one step a miss skips
    assert not p.active(req)  # backed off for several steps
    skipped = 0
    while not p.wants(req):
        skipped += 1
    assert skipped > 1


def next_token(seq: list[int]) -> int:
    """The 'model': greedy, a function of the whole sequence."""
    return (sum(seq[-3:]) * 31 + len(seq)) % 97 + 3


def drive(sched, reqs: list[Request]) -> tuple[dict[str, list[int]], set[str], int]:
    """Run to the end with greedy verification; the outputs, the requests that drafted and the
    number of steps."""
    by_id = {r.request_id: r for r in reqs}
    for r in reqs:
        sched.add_request(r)
    drafted: set[str] = set()
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps += 1
        sampled = {}
        for rid in out.num_scheduled_tokens:
            req = by_id[rid]
            seq = req.prompt_token_ids + req.output_token_ids
            drafts = out.spec_token_ids.get(rid, [])
            if drafts:
                drafted.add(rid)
            tokens: list[int] = []
            for d in drafts:
                tokens.append(next_token(seq + tokens))
                if tokens[-1] != d:
                    break
            else:
                tokens.append(next_token(seq + tokens))
            sampled[rid] = tokens
        sched.update_from_output(out, sampled)
    return {r.request_id: r.output_token_ids for r in reqs}, drafted, steps


def job(rid: str, prediction=()) -> Request:
    return request(
        rid, [7, 8, 9, 10 + len(rid)], max_tokens=60, temperature=0.0, prediction=prediction
    )


def reference() -> dict[str, list[int]]:
    out, drafted, _ = drive(make(), [job("a"), job("bb")])
    assert not drafted
    return out


def test_a_prediction_drafts_with_speculation_off_and_keeps_the_output():
    ref = reference()
    sched = make()
    out, drafted, steps = drive(sched, [job("a", tuple(ref["a"])), job("bb")])
    assert out == ref
    assert drafted == {"a"}  # the request without a prediction never drafts
    stats = sched.stats()
    assert stats.num_spec_draft_tokens > 0
    assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens  # all right
    # a's 59 tokens after the prefill came up to 11 a step (10 drafts kept, one of its own)
    assert stats.num_spec_accepted_tokens >= 45 and steps == 60
    assert sched._draft_tracker.predicted == set()  # noqa: SLF001 (forgotten when finished)


@pytest.mark.parametrize("spec", [None, SpeculativeConfig(num_speculative_tokens=4)])
def test_wrong_predictions_keep_the_output(spec):
    ref = reference()
    wrong = list(ref["a"])
    for i in range(3, len(wrong), 7):
        wrong[i] = (wrong[i] + 1) % 97 + 3  # a changed token every 7
    del wrong[20:22]  # and two dropped
    sched = make(speculative=spec)
    out, drafted, _ = drive(sched, [job("a", tuple(wrong)), job("bb", (1, 2, 3) * 20)])
    assert out == ref
    stats = sched.stats()
    assert "a" in drafted and 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens


def test_without_predictions_nothing_drafts_when_speculation_is_off():
    sched = make()
    _, drafted, _ = drive(sched, [job("a"), job("bb")])
    assert not drafted and sched.stats().num_spec_lookups == 0


def test_a_prediction_longer_than_max_model_len_is_refused():
    sched = make()
    with pytest.raises(RequestRejected, match="prediction"):
        sched.add_request(job("a", tuple(range(3, 3 + 257))))
    with pytest.raises(RequestRejected, match="prediction"):
        sched.add_request(job("b", (5, -1)))
