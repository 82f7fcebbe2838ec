"""Async scheduling: step N+1 is scheduled before step N's tokens come back (output
placeholders). The same random workloads and fake worker as test_sched_property.py, run with
one step always in flight: every request still produces exactly what it produces alone, no
request exceeds max_tokens, and block accounting stays exact."""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, given, settings

from scheduler_svc.core import (
    FinishReason,
    Request,
    RequestRejected,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from tests.unit.core.test_sched_property import (
    FakeWorker,
    Spec,
    expected_rejection,
    run_alone,
    workloads,
)


def run_pipelined(workload, depth: int = 2) -> None:
    cfg, specs = workload
    s = Scheduler(cfg)
    worker = FakeWorker(cfg.block_size, cfg.num_blocks)
    pool = s.kv.pool
    length_limit = min(cfg.max_model_len, cfg.num_blocks * cfg.block_size + 1)
    accepted: dict[str, Spec] = {}
    reference: dict[str, tuple[list[int], FinishReason]] = {}
    got: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    aborted: set[str] = set()
    pending: deque = deque()
    by_arrival: dict[int, list[Spec]] = {}
    for spec in specs:
        by_arrival.setdefault(spec.arrive, []).append(spec)
    last_arrival = max(spec.arrive for spec in specs)

    def apply_oldest() -> None:
        out, sampled = pending.popleft()
        for o in s.update_from_output(out, sampled):
            assert o.request_id not in reasons, "output after the finish"
            got[o.request_id] += o.new_token_ids
            assert len(got[o.request_id]) <= accepted[o.request_id].params.max_tokens
            if o.finish_reason is not None:
                reasons[o.request_id] = o.finish_reason

    for step in range(4000):
        for spec in by_arrival.get(step, []):
            alone, _ = run_alone(spec.prompt, [], spec.params, spec.eos, length_limit)
            prior = alone[: spec.migrated] if spec.migrated < len(alone) else []
            request = Request(
                spec.rid,
                spec.prompt,
                spec.params,
                priority=spec.priority,
                arrival_time=float(step),
                eos_token_id=spec.eos,
                output_token_ids=prior,
            )
            try:
                s.add_request(request)
            except RequestRejected:
                assert expected_rejection(cfg, spec, prior)
                continue
            accepted[spec.rid] = spec
            worker.prompt_lens[spec.rid] = len(spec.prompt)
            reference[spec.rid] = run_alone(spec.prompt, prior, spec.params, spec.eos, length_limit)
            got[spec.rid] = list(prior)
        for rid, spec in accepted.items():
            if spec.abort_at == step and rid not in reasons and s.abort_request(rid):
                aborted.add(rid)
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        pending.append((out, worker.execute(out)))  # the worker runs steps in order
        for blk in pool.cached.values():
            assert all((blk.block_id, i) in worker.kv for i in range(cfg.block_size)), (
                f"block {blk.block_id} is cached but was never fully written"
            )
        if len(pending) >= depth:
            apply_oldest()
        pool.check_invariants()
        st_ = s.stats()
        assert st_.num_free_blocks + st_.num_used_blocks == st_.num_total_blocks
        if step > last_arrival and not s.has_unfinished_requests():
            while pending:
                apply_oldest()
            if not s.has_unfinished_requests():
                break
    else:
        raise AssertionError("workload did not finish in 4000 steps")
    assert pool.num_free_blocks == cfg.num_blocks
    assert s.stats().num_free_host_blocks == cfg.num_host_blocks
    assert all(r.num_output_placeholders == 0 for r in s.running)
    for rid in accepted:
        want, reason = reference[rid]
        if rid in aborted:
            assert want[: len(got[rid])] == got[rid], f"{rid}: wrong tokens before the abort"
        else:
            assert got[rid] == want, f"{rid}: tokens differ from running alone"
            assert reasons[rid] is reason


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_pipelined_random_workloads(workload):
    run_pipelined(workload)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(pressure=True))
def test_pipelined_random_workloads_under_memory_pressure(workload):
    run_pipelined(workload)


def test_decode_is_scheduled_ahead_with_a_placeholder():
    s = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=4, block_size=4, num_blocks=16, max_model_len=64
        )
    )
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    first = s.schedule()  # prefill, samples token 1
    second = s.schedule()  # before the first returns: decode the placeholder
    assert first.num_scheduled_tokens == {"a": 3}
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.cached_requests[0].num_computed_tokens == 3
    third = s.schedule()  # the third token is the last one: scheduled too
    assert third.num_scheduled_tokens == {"a": 1}
    assert s.schedule().num_scheduled_tokens == {}  # max_tokens reached by placeholders
    outs = [s.update_from_output(o, {"a": [t]}) for o, t in ((first, 7), (second, 8), (third, 9))]
    assert [o[0].new_token_ids for o in outs] == [[7], [8], [9]]
    assert outs[-1][0].finish_reason is FinishReason.LENGTH
    assert s.schedule().finished_req_ids == {"a"}
    assert s.kv.pool.num_free_blocks == 16
