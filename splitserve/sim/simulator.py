"""The discrete-event simulator: the real scheduler core against cost-model workers.

Each simulated worker owns a real ``Scheduler`` (block pool, running set); all share one waiting
queue ordered by one policy object, as the serving engine's workers do. Time is simulated: a
step's duration comes from the StepCostModel, nothing sleeps, so thousands of requests take
seconds. The "model" samples a fixed token; requests ignore EOS and stop at their trace output
length. Arrivals pass the same SLO admission and thrash backpressure checks as the service
(scheduler_svc/engine/slo_admission.py), then the core's own validation (a request that can
never run is refused at once).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.core import (
    Request,
    RequestRejected,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    create_policy,
    create_request_queue,
)
from scheduler_svc.core.remaining_work import targets_met
from scheduler_svc.engine.slo_admission import SloAdmission
from scheduler_svc.engine.tenant_admission import Overloaded
from splitserve.sim.costmodel import StepCostModel
from splitserve.sim.trace import TraceRequest

TOKEN = 5  # what the simulated model samples


@dataclass(slots=True)
class SimSettings:
    label: str = ""
    policy: str = "fcfs"
    policy_options: dict[str, Any] = field(default_factory=dict)
    num_workers: int = 1
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    block_size: int = 16
    num_blocks: int = 2048
    num_host_blocks: int = 0
    preemption_mode: str = "recompute"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int = 4096
    watermark: float = 0.01
    ttft_slo_ms: float = 0.0
    thrash_threshold: float = 0.2
    thrash_window_s: float = 10.0
    thrash_backpressure: bool = False
    shared_prefix_len: int = 0
    max_sim_time_s: float = math.inf

    def scheduler_config(self, cost: StepCostModel) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            num_host_blocks=self.num_host_blocks,
            watermark=self.watermark,
            policy=self.policy,
            preemption_mode=self.preemption_mode,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            max_model_len=self.max_model_len,
            policy_options=dict(self.policy_options),
            worker_costs=cost.worker_costs(),
        )


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    tenant: str | None
    priority: int
    prompt_len: int
    output_len: int
    arrival: float
    deadline: float | None = None
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None
    first_token: float | None = None
    finish: float | None = None
    num_output: int = 0
    refused: str | None = None  # "invalid" | "slo" | "thrash" | "shed" (hopeless, ended early)
    refused_reason: str = ""
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None or self.num_output < 2:
            return None
        return (self.finish - self.first_token) / (self.num_output - 1)

    @property
    def has_target(self) -> bool:
        return not (
            self.deadline is None and self.ttft_target_s is None and self.tpot_target_s is None
        )

    @property
    def met_deadline(self) -> bool | None:
        """All its targets met (deadline, TTFT, TPOT); None without targets or when refused."""
        if not self.has_target or self.refused:
            return None
        if self.finish is None:
            return False
        return targets_met(
            arrival=self.arrival,
            first_token=self.first_token,
            finish=self.finish,
            num_outputs=self.num_output,
            deadline=self.deadline,
            ttft_target_s=self.ttft_target_s,
            tpot_target_s=self.tpot_target_s,
        )


@dataclass(slots=True)
class SimResult:
    settings: SimSettings
    cost_model: str
    records: list[RequestRecord]
    sim_time_s: float = 0.0  # first arrival to last finish
    wall_s: float = 0.0
    steps: int = 0
    preemptions: int = 0
    swap_outs: int = 0
    recomputed_tokens: int = 0
    computed_tokens: int = 0
    tenant_tokens: dict[str, int] = field(default_factory=dict)
    # tokens per tenant counted only while every tenant had requests waiting to start
    tenant_tokens_contended: dict[str, int] = field(default_factory=dict)
    thrash_episodes: int = 0
    thrash_first_at: float | None = None
    thrash_max_ratio: float = 0.0
    stuck: bool = False  # requests left that could not make progress

    @property
    def label(self) -> str:
        return self.settings.label or self.settings.policy


class Simulator:
    def __init__(
        self, settings: SimSettings, trace: list[TraceRequest], cost: StepCostModel | None = None
    ) -> None:
        self.settings = settings
        self.trace = sorted(trace, key=lambda r: r.arrival)
        self.cost = cost or StepCostModel()
        self.now = 0.0
        cfg = settings.scheduler_config(self.cost)
        self.policy = create_policy(settings.policy, **settings.policy_options)
        self.policy.clock = self._clock  # type: ignore[method-assign]
        self.queue = create_request_queue(self.policy)
        self.schedulers = [
            Scheduler(cfg, waiting_queue=self.queue) for _ in range(settings.num_workers)
        ]
        self.slo = SloAdmission(
            ttft_slo_s=settings.ttft_slo_ms / 1e3,
            thrash_threshold=settings.thrash_threshold,
            thrash_window_s=settings.thrash_window_s,
            backpressure=settings.thrash_backpressure,
            clock=self._clock,
        )
        self.records: dict[str, RequestRecord] = {}
        self._in_system: dict[str | None, int] = {}  # arrived, not finished
        self._queued: dict[str | None, int] = {}  # arrived, never scheduled yet
        self._requests: dict[str, Request] = {}
        self._tenants: set[str | None] = set()

    def _clock(self) -> float:
        return self.now

    # -- arrivals ---------------------------------------------------------------------------
    def _arrive(self, index: int, tr: TraceRequest) -> None:
        rec = RequestRecord(
            tr.request_id,
            tr.tenant,
            tr.priority,
            tr.prompt_len,
            tr.output_len,
            tr.arrival,
            tr.deadline,
            tr.ttft_target_s,
            tr.tpot_target_s,
        )
        self.records[tr.request_id] = rec
        request = Request(
            request_id=tr.request_id,
            prompt_token_ids=tr.prompt_token_ids(index, self.settings.shared_prefix_len),
            sampling_params=SamplingParams(
                max_tokens=tr.output_len, temperature=0.0, ignore_eos=True
            ),
            priority=tr.priority,
            arrival_time=tr.arrival,
            tenant=tr.tenant,
            deadline=tr.deadline,
            ttft_deadline=None if tr.ttft_target_s is None else tr.arrival + tr.ttft_target_s,
            tpot_target_s=tr.tpot_target_s,
        )
        try:
            self.slo.check(request, [self.queue], self.schedulers)
            self.schedulers[0].add_request(request)
        except Overloaded as exc:
            rec.refused = "thrash" if "paused" in str(exc) else "slo"
            rec.refused_reason = str(exc)
            return
        except RequestRejected as exc:
            rec.refused = "invalid"
            rec.refused_reason = str(exc)
            return
        self._in_system[tr.tenant] = self._in_system.get(tr.tenant, 0) + 1
        self._queued[tr.tenant] = self._queued.get(tr.tenant, 0) + 1
        self._requests[tr.request_id] = request

    def _shed(self, request: Request) -> None:
        rec = self.records[request.request_id]
        rec.refused = "shed"
        rec.refused_reason = f"could no longer meet its {request.missed_target or 'deadline'}"
        self._in_system[rec.tenant] -= 1
        if request.num_cached_tokens < 0:  # never admitted: still counted as queued
            self._queued[rec.tenant] -= 1

    # -- steps ------------------------------------------------------------------------------
    def _complete(self, sched: Scheduler, out: SchedulerOutput, step_s: float, res) -> None:
        sampled = {}
        for rid in out.num_scheduled_tokens:
            r = sched.get_request(rid)
            sampled[rid] = (
                [TOKEN] if r is not None and r.num_computed_tokens >= r.num_tokens else []
            )
        contended = len(self._tenants) > 1 and all(
            self._queued.get(t, 0) > 0 for t in self._tenants
        )
        records = self.records
        tt, tc = res.tenant_tokens, res.tenant_tokens_contended
        for rid, n in out.num_scheduled_tokens.items():
            t = records[rid].tenant or ""
            tt[t] = tt.get(t, 0) + n
            if contended:
                tc[t] = tc.get(t, 0) + n
        for o in sched.update_from_output(out, sampled):
            rec = records[o.request_id]
            if o.new_token_ids and rec.first_token is None:
                rec.first_token = self.now
            rec.num_output = o.num_output_tokens
            if o.finish_reason is not None:
                rec.finish = self.now
                self._in_system[rec.tenant] -= 1
        self.slo.on_step(sched, out, step_s)

    def run(self) -> SimResult:
        started = time.perf_counter()
        s = self.settings
        res = SimResult(s, self.cost.name, [])
        self._tenants = {tr.tenant for tr in self.trace}
        trace, n = self.trace, len(self.trace)
        scheds = self.schedulers
        busy: list[tuple[float, int]] = []
        pending: dict[int, tuple[SchedulerOutput, float]] = {}
        i = 0
        while True:
            while i < n and trace[i].arrival <= self.now:
                self._arrive(i, trace[i])
                i += 1
            for w, sched in enumerate(scheds):
                if w in pending or not sched.has_unfinished_requests():
                    continue
                out = sched.schedule()
                for shed in sched.take_shed():
                    self._shed(shed)
                if not (
                    out.total_num_scheduled_tokens
                    or out.blocks_to_swap_out
                    or out.blocks_to_swap_in
                ):
                    continue
                for new in out.new_requests:
                    self._queued[self.records[new.request_id].tenant] -= 1
                dt = max(1e-6, self.cost.step_time(out))
                pending[w] = (out, dt)
                heapq.heappush(busy, (self.now + dt, w))
                res.steps += 1
            t_next = min(trace[i].arrival if i < n else math.inf, busy[0][0] if busy else math.inf)
            if t_next == math.inf or t_next > s.max_sim_time_s:
                res.stuck = any(sched.has_unfinished_requests() for sched in scheds)
                break
            self.now = t_next
            while busy and busy[0][0] <= self.now:
                _, w = heapq.heappop(busy)
                out, dt = pending.pop(w)
                self._complete(scheds[w], out, dt, res)
        for sched in scheds:
            st = sched.stats()
            res.preemptions += st.num_preemptions
            res.swap_outs += st.num_swap_outs
            res.recomputed_tokens += st.num_recomputed_tokens
            res.computed_tokens += st.num_scheduled_tokens
        for rid, request in self._requests.items():
            self.records[rid].preemptions = request.num_preemptions
        res.records = list(self.records.values())
        arrivals = [r.arrival for r in res.records]
        finishes = [r.finish for r in res.records if r.finish is not None]
        if arrivals and finishes:
            res.sim_time_s = max(finishes) - min(arrivals)
        mon = self.slo.thrash
        res.thrash_episodes, res.thrash_first_at = mon.num_episodes, mon.first_at
        res.thrash_max_ratio = mon.max_ratio
        res.wall_s = time.perf_counter() - started
        return res


def simulate(
    settings: SimSettings, trace: list[TraceRequest], cost: StepCostModel | None = None
) -> SimResult:
    return Simulator(settings, trace, cost).run()
