"""Failover as a property: a new scheduler adopts the rows the worker holds at a random step.

The fake worker of test_sched_property samples from the history it reads back out of its fake
KV cache, so an adopted block table that names the wrong blocks, a block freed while another
request still reads it, or a wrong num_computed_tokens changes the tokens. Every request must
still produce exactly what it would produce running alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler_svc.core import Request, RequestStatus, Scheduler, SchedulerOutput
from tests.unit.core.test_sched_property import FakeWorker, run_alone, workloads


@dataclass
class RowWorker(FakeWorker):
    """Keeps rows like the model runner: a preempted request leaves its row (not held); a
    link loss forgets every row but keeps the KV cache."""

    rows: set[str] = field(default_factory=set)

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        # a request preempted before it was ever sent (adopted, then a victim at once) is
        # named in preempted_req_ids although the worker never heard of it: ignored, as the
        # model runner ignores unknown ids
        known = copy.copy(out)
        known.preempted_req_ids = {r for r in out.preempted_req_ids if r in self.reqs}
        self.rows -= out.finished_req_ids | out.preempted_req_ids
        self.rows |= {n.request_id for n in out.new_requests}
        self.rows |= {c.request_id for c in out.cached_requests if c.resumed}
        return super().execute(known)

    def held(self) -> dict[str, tuple[list[int], int, int]]:
        """Per held row: block table, tokens its KV holds, tokens known."""
        return {
            rid: (list(self.reqs[rid].table), self.reqs[rid].computed, len(self.reqs[rid].tokens))
            for rid in self.rows
        }

    def lose_link(self) -> None:
        self.reqs.clear()
        self.rows.clear()


def _rebuild(spec, outputs: list[int]) -> Request:
    return Request(
        spec.rid,
        spec.prompt,
        spec.params,
        priority=spec.priority,
        arrival_time=float(spec.arrive),
        eos_token_id=spec.eos,
        output_token_ids=list(outputs),
    )


def _fail_over(old: Scheduler, worker: RowWorker, accepted, got, reasons) -> Scheduler:
    """A new leader: adopt what the worker holds, queue the rest (from what clients saw)."""
    new = Scheduler(old.config)
    held = worker.held()
    worker.lose_link()
    unfinished = [rid for rid in accepted if rid not in reasons]
    for rid in sorted(unfinished, key=lambda r: accepted[r].arrive):
        request = _rebuild(accepted[rid], got[rid])
        if rid in held:
            table, computed, known = held[rid]
            assert known == request.num_tokens  # synchronous: every sampled token applied
            new.adopt_request(request, table, min(computed, request.num_tokens - 1))
        else:
            new.add_request(request)
    event(
        f"a block shared by adopted requests: {max(new.kv._adopted_refs.values(), default=0) > 1}"
    )
    # rows of requests that finished in the last step are still held (the worker hears of
    # the finish with the next step): the new leader does not adopt those
    assert {r.request_id for r in new.running} == set(held) & set(unfinished)
    return new


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(pressure=True), st.integers(1, 40), st.integers(0, 2))
def test_a_new_leader_adopting_the_workers_rows_keeps_every_invariant(workload, at, again):
    cfg, specs = workload
    s = Scheduler(cfg)
    worker = RowWorker(cfg.block_size, cfg.num_blocks)
    length_limit = min(cfg.max_model_len, cfg.num_blocks * cfg.block_size + 1)
    accepted, got, reasons, reference = {}, {}, {}, {}
    for spec in specs:  # every request from the start; the failover lands mid-flight
        request = _rebuild(spec, [])
        try:
            s.add_request(request)
        except ValueError:
            continue
        accepted[spec.rid] = spec
        worker.prompt_lens[spec.rid] = len(spec.prompt)
        reference[spec.rid] = run_alone(spec.prompt, [], spec.params, spec.eos, length_limit)
        got[spec.rid] = []
    failovers = {at, at + 1 + 3 * again} if again else {at}
    adopted_any = False
    for step in range(3000):
        if step in failovers:
            s = _fail_over(s, worker, accepted, got, reasons)
            adopted_any |= bool(s.running)
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        for r in s.running:  # a running request holds exactly the blocks its tokens need
            assert s.kv.num_blocks_of(r.request_id) == -(-r.num_computed_tokens // cfg.block_size)
            assert r.status is RequestStatus.RUNNING
        sampled = worker.execute(out)
        for o in s.update_from_output(out, sampled):
            got[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                reasons[o.request_id] = o.finish_reason
        s.kv.pool.check_invariants()
        if step > max(failovers) and not s.has_unfinished_requests():
            break
    else:
        raise AssertionError("workload did not finish in 3000 steps")
    s.schedule()
    assert s.stats().kv_usage == 0.0 and s.kv.pool.num_free_blocks == cfg.num_blocks
    assert not s.kv._adopted and not s.kv._adopted_refs
    for rid in accepted:
        want, reason = reference[rid]
        assert got[rid] == want, f"{rid}: tokens differ from running alone"
        assert reasons[rid] is reason
    event(f"adopted requests: {adopted_any}")
    event(f"preemptions after failover: {min(s.stats().num_preemptions, 2)}+")
