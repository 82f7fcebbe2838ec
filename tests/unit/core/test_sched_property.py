"""Random workloads against invariants, with a fake worker that keeps a fake KV cache.

The fake worker applies each SchedulerOutput diff exactly as the contract says, writes the token
at each computed position into the slot its block table names, and samples the next token as a
function of the history it READS BACK from those slots. So a wrong block table, a bad prefix hit,
a block freed while still in use, or a wrong resume all change the tokens. Every request must
produce exactly what it would produce running alone, whatever the contention.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler_svc.core import (
    FinishReason,
    Request,
    RequestRejected,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

VOCAB = 12
EOS = 0


def next_token(history: list[int]) -> int:
    h = len(history) * 7919
    for t in history[-6:]:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


# ---- fake worker ------------------------------------------------------------------------------


@dataclass
class _WorkerReq:
    tokens: list[int]
    table: list[int]
    computed: int


@dataclass
class FakeWorker:
    block_size: int
    num_blocks: int
    reqs: dict[str, _WorkerReq] = field(default_factory=dict)
    kv: dict[tuple[int, int], int] = field(default_factory=dict)  # (block, slot) -> token
    host_kv: dict[tuple[int, int], int] = field(default_factory=dict)  # swapped-out copies
    prompt_lens: dict[str, int] = field(default_factory=dict)

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        bs = self.block_size
        for rid in out.finished_req_ids:
            self.reqs.pop(rid, None)
        for rid in out.preempted_req_ids:
            assert rid in self.reqs, "preempted a request the worker never saw"
        fresh: list[int] = []  # blocks newly given to a request: whatever they held is garbage
        for new in out.new_requests:
            assert new.request_id not in self.reqs, "new request the worker already holds"
            # after the prefix hit (or an adopted request's computed tokens, whose last block
            # may be partly written)
            fresh += new.block_ids[-(-new.num_computed_tokens // bs) :]
            self.reqs[new.request_id] = _WorkerReq(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
            )
        for c in out.cached_requests:
            w = self.reqs[c.request_id]  # KeyError: cached data for an unknown request
            if c.resumed:
                prompt_len = len(w.tokens) - self._outputs_len(c.request_id)
                w.tokens = w.tokens[:prompt_len] + list(c.new_token_ids)
                w.table = list(c.new_block_ids)
                w.computed = c.num_computed_tokens
                fresh += c.new_block_ids[c.num_computed_tokens // bs :]
            else:
                assert w.computed == c.num_computed_tokens, "worker and scheduler disagree"
                w.table.extend(c.new_block_ids)
                fresh += c.new_block_ids
        # like the model runner: copy out, then in, before the forward
        self._copy(out.blocks_to_swap_out, self.kv, self.host_kv, out_=True)
        self._copy(out.blocks_to_swap_in, self.host_kv, self.kv, out_=False)
        swapped_in = {dev for dev, _ in out.blocks_to_swap_in}
        for blk in fresh:  # a fresh block must be written before anything reads it
            if blk not in swapped_in:
                for slot in range(bs):
                    self.kv.pop((blk, slot), None)
        scheduled = {n.request_id for n in out.new_requests}
        scheduled |= {c.request_id for c in out.cached_requests}
        assert scheduled == set(out.num_scheduled_tokens), "diff entries != scheduled ids"
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            w = self.reqs[rid]
            assert n >= 1 and w.computed + n <= len(w.tokens), "scheduled beyond known tokens"
            assert len(set(w.table)) == len(w.table), "block twice in one table"
            assert all(0 <= b < self.num_blocks for b in w.table)
            for p in range(w.computed, w.computed + n):
                self.kv[(w.table[p // bs], p % bs)] = w.tokens[p]
            w.computed += n
            if w.computed == len(w.tokens):
                history = [self.kv[(w.table[p // bs], p % bs)] for p in range(w.computed)]
                tok = next_token(history)
                w.tokens.append(tok)
                sampled[rid] = [tok]
            else:
                sampled[rid] = []
        return sampled

    def _copy(self, pairs, src, dst, out_: bool) -> None:
        for dev, host in pairs:
            s_blk, d_blk = (dev, host) if out_ else (host, dev)
            for slot in range(self.block_size):
                if (s_blk, slot) in src:
                    dst[(d_blk, slot)] = src[(s_blk, slot)]
                else:
                    dst.pop((d_blk, slot), None)

    def _outputs_len(self, rid: str) -> int:
        """Output tokens the worker holds for a request (its prompt length never changes)."""
        return len(self.reqs[rid].tokens) - self.prompt_lens[rid]


# ---- reference: the request alone -------------------------------------------------------------


def run_alone(prompt, outputs, params: SamplingParams, eos, length_limit):
    tokens = list(prompt) + list(outputs)
    out = list(outputs)
    while True:
        tok = next_token(tokens)
        tokens.append(tok)
        out.append(tok)
        if len(out) >= params.max_tokens or len(tokens) >= length_limit:
            return out, FinishReason.LENGTH
        if len(out) < params.min_tokens:
            continue
        if (tok == eos and not params.ignore_eos) or tok in params.stop_token_ids:
            return out, FinishReason.STOP


# ---- workloads --------------------------------------------------------------------------------


@dataclass
class Spec:
    rid: str
    prompt: list[int]
    params: SamplingParams
    eos: int | None
    priority: int
    arrive: int
    abort_at: int | None
    abort_mid: bool
    migrated: int  # outputs produced before (as if moved from a lost worker)


tokens_st = st.integers(0, VOCAB - 1)


@st.composite
def workloads(draw, pressure: bool = False):
    """Random configs and requests; ``pressure``: tiny pools, many long requests at once, so
    preemption (recompute and swap) happens in most examples."""
    cfg = SchedulerConfig(
        block_size=draw(st.sampled_from([2, 4] if pressure else [2, 4, 8])),
        num_blocks=draw(st.integers(8, 16) if pressure else st.integers(8, 40)),
        max_num_batched_tokens=draw(st.integers(4, 48)),
        max_num_seqs=draw(st.integers(3, 8) if pressure else st.integers(1, 8)),
        enable_chunked_prefill=draw(st.booleans()),
        enable_prefix_caching=draw(st.integers(0, 3)) > 0,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        watermark=0.0 if pressure else draw(st.sampled_from([0.0, 0.0, 0.0, 0.05, 0.2])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 8])),
        max_model_len=draw(st.integers(60, 120) if pressure else st.integers(6, 120)),
        preemption_mode=draw(st.sampled_from(["recompute", "swap", "auto"])),
        num_host_blocks=draw(st.sampled_from([0, 6, 16, 40])),
        auto_swap_min_tokens=draw(st.integers(0, 16)),
    )
    bs = cfg.block_size
    prefixes = []
    for _ in range(draw(st.integers(1, 3))):
        # often a whole number of blocks, so a later prompt may be entirely cached
        size = bs * draw(st.integers(1, 4)) if draw(st.booleans()) else draw(st.integers(2, 24))
        prefixes.append(draw(st.lists(tokens_st, min_size=size, max_size=size)))
    specs = []
    for i in range(draw(st.integers(5, 12) if pressure else st.integers(1, 12))):
        shared = draw(st.integers(0, 3)) > 0
        base = draw(st.sampled_from(prefixes)) if shared else []
        tail_size = draw(st.sampled_from([0, 0, 1, 2, 5, 9, 16]))
        prompt = base + draw(st.lists(tokens_st, min_size=tail_size, max_size=tail_size))
        if not prompt:
            prompt = [1]
        max_tokens = draw(st.integers(10, 40) if pressure else st.integers(1, 40))
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, min(3, max_tokens))),
            ignore_eos=draw(st.booleans()) and draw(st.booleans()),
            stop_token_ids=draw(st.sampled_from([[], [], [], [5], [3, 7]])),
        )
        abort_at = draw(st.integers(0, 30)) if draw(st.integers(0, 4)) == 0 else None
        specs.append(
            Spec(
                rid=f"r{i}",
                prompt=prompt,
                params=params,
                eos=draw(st.sampled_from([EOS, None, None])),
                priority=draw(st.integers(0, 3)),
                arrive=draw(
                    st.integers(0, 3) if pressure or draw(st.booleans()) else st.integers(0, 20)
                ),
                abort_at=abort_at,
                abort_mid=draw(st.booleans()),
                migrated=draw(st.integers(0, 2)) if draw(st.integers(0, 3)) == 0 else 0,
            )
        )
    return cfg, specs


def expected_rejection(cfg: SchedulerConfig, spec: Spec, outputs: list[int]) -> bool:
    n = len(spec.prompt) + len(outputs)
    return (
        len(spec.prompt) >= cfg.max_model_len
        or n >= cfg.max_model_len
        or len(outputs) >= spec.params.max_tokens
        or (not cfg.enable_chunked_prefill and len(spec.prompt) > cfg.max_num_batched_tokens)
        or -(-n // cfg.block_size) > cfg.num_blocks
    )


# ---- the property -----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    run_workload(workload)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(pressure=True))
def test_random_workloads_under_memory_pressure_keep_every_invariant(workload):
    run_workload(workload)


def run_workload(workload) -> None:
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
    finished_reported: list[str] = []
    by_arrival: dict[int, list[Spec]] = {}
    for spec in specs:
        by_arrival.setdefault(spec.arrive, []).append(spec)

    last_step = max(spec.arrive for spec in specs)
    for step in range(3000):
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
                assert expected_rejection(cfg, spec, prior), "rejected a runnable request"
                continue
            assert not expected_rejection(cfg, spec, prior), "accepted an impossible request"
            accepted[spec.rid] = spec
            worker.prompt_lens[spec.rid] = len(spec.prompt)
            reference[spec.rid] = run_alone(spec.prompt, prior, spec.params, spec.eos, length_limit)
            got[spec.rid] = list(prior)
        for rid, spec in accepted.items():
            if spec.abort_at == step and not spec.abort_mid and rid not in reasons:
                if s.abort_request(rid):
                    aborted.add(rid)

        before = {r.request_id: (r.num_computed_tokens, r.num_tokens) for r in s.running}
        swapped = {r.request_id: r.num_computed_tokens for r in s.swapped}
        order = list(before)
        out = s.schedule()
        for rid in out.preempted_req_ids:
            if any(
                order.index(rid) < order.index(o) for o in out.num_scheduled_tokens if o in before
            ):
                event("preempted a request ahead of a scheduled one")
        _check_step(s, cfg, out, before, swapped)
        finished_reported += list(out.finished_req_ids)
        sampled = worker.execute(out)
        for blk in pool.cached.values():  # a cached block holds K/V for every slot
            assert all((blk.block_id, i) in worker.kv for i in range(cfg.block_size)), (
                f"block {blk.block_id} is in the prefix cache but was never fully written"
            )

        for rid, spec in accepted.items():  # aborts between schedule() and the results
            if spec.abort_at == step and spec.abort_mid and rid not in reasons:
                if s.abort_request(rid):
                    aborted.add(rid)
        # every other step hand back an equal copy (as if rebuilt from the wire)
        result = out if step % 2 else copy.copy(out)
        for o in s.update_from_output(result, sampled):
            assert o.request_id not in reasons, "output after the finish"
            got[o.request_id] += o.new_token_ids
            assert o.num_output_tokens == len(got[o.request_id])
            if o.finish_reason is not None:
                reasons[o.request_id] = o.finish_reason
        pool.check_invariants()
        st_ = s.stats()
        assert st_.num_free_blocks + st_.num_used_blocks == st_.num_total_blocks
        if step > last_step and not s.has_unfinished_requests():
            break
    else:
        raise AssertionError("workload did not finish in 3000 steps")

    out = s.schedule()  # flush the last finished ids
    finished_reported += list(out.finished_req_ids)
    assert sorted(finished_reported) == sorted(set(finished_reported)), "finished twice"
    assert set(finished_reported) == set(accepted), "a request was lost"
    assert s.stats().kv_usage == 0.0 and pool.num_free_blocks == cfg.num_blocks
    assert s.stats().num_free_host_blocks == cfg.num_host_blocks
    assert not s.running and len(s.waiting) == 0 and len(s.swapped) == 0
    for rid in accepted:
        want, reason = reference[rid]
        if rid in aborted:
            assert want[: len(got[rid])] == got[rid], f"{rid}: wrong tokens before the abort"
            assert rid not in reasons
        else:
            assert got[rid] == want, f"{rid}: tokens differ from running alone"
            assert reasons[rid] is reason
    stats = s.stats()
    if stats.num_preemptions == 0:
        assert stats.num_recomputed_tokens == 0
    event(f"preemptions: {min(stats.num_preemptions, 3)}+")
    event(f"prefix hits: {bool(stats.prefix_cache_hits)}")
    event(f"recomputed tokens: {bool(stats.num_recomputed_tokens)}")
    event(f"swap outs: {min(stats.num_swap_outs, 1)}+")
    event(f"aborted: {bool(aborted)}; rejected: {len(accepted) < len(specs)}")
    event(f"finish reasons: {sorted({r.value for r in reasons.values()})}")


def _check_step(s: Scheduler, cfg: SchedulerConfig, out: SchedulerOutput, before, swapped) -> None:
    bs = cfg.block_size
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(s.running) <= cfg.max_num_seqs
    for r in s.running:  # a running request holds exactly the blocks its computed tokens need
        assert s.kv.num_blocks_of(r.request_id) == -(-r.num_computed_tokens // bs)
    ids = [r.request_id for r in s.running]
    assert len(ids) == len(set(ids)), "request twice in running"
    assert not set(ids) & {r.request_id for r in s.waiting}, "request both running and waiting"
    assert not out.preempted_req_ids & set(out.num_scheduled_tokens)
    host_in_use = sum(len(h) for h in s.kv.req_host_blocks.values())
    assert host_in_use + s.stats().num_free_host_blocks == cfg.num_host_blocks
    assert set(s.kv.req_host_blocks) == {r.request_id for r in s.swapped}
    if cfg.preemption_mode == "recompute" or not cfg.num_host_blocks:
        assert not out.blocks_to_swap_out and not s.swapped
    for rid in out.preempted_req_ids:
        r = s.get_request(rid)
        assert s.kv.num_blocks_of(rid) == 0
        if r.status is RequestStatus.SWAPPED:  # progress kept, computed KV on the host
            assert r.num_computed_tokens == before[rid][0]
            host = s.kv.req_host_blocks[rid]
            assert len(host) == -(-r.num_computed_tokens // bs)
        else:  # recompute from scratch
            assert r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0
    admitted = [n.request_id for n in out.new_requests]
    admitted += [c.request_id for c in out.cached_requests if c.resumed]
    if out.preempted_req_ids:
        assert not admitted, "admitted a waiting request in a step that preempted"
    for rid, n in out.num_scheduled_tokens.items():
        r = s.get_request(rid)
        assert r.status is RequestStatus.RUNNING
        if rid in before:
            computed, total = before[rid]
            assert 1 <= n <= total - computed
            if cfg.long_prefill_token_threshold and cfg.enable_chunked_prefill:
                assert n <= cfg.long_prefill_token_threshold
    swap_ins = 0
    for c in out.cached_requests:
        if c.resumed and c.request_id in swapped:  # swapped in: right where it stopped
            assert c.num_computed_tokens == swapped[c.request_id]
            swap_ins += -(-c.num_computed_tokens // bs)
    assert len(out.blocks_to_swap_in) == swap_ins
    entries = {n.request_id: n.num_computed_tokens for n in out.new_requests}
    entries |= {
        c.request_id: c.num_computed_tokens
        for c in out.cached_requests
        if c.resumed and c.request_id not in swapped
    }
    for rid, hit in entries.items():
        r = s.get_request(rid)
        n = out.num_scheduled_tokens[rid]
        # admitted: starts at its prefix hit (whole blocks, last token always computed)
        assert hit % bs == 0 and hit <= r.num_tokens - 1
        assert hit + n == r.num_computed_tokens <= r.num_tokens
        if not cfg.enable_prefix_caching:
            assert hit == 0
        if not cfg.enable_chunked_prefill and r.num_tokens - hit <= cfg.max_num_batched_tokens:
            assert n == r.num_tokens - hit, "chunked prefill off: a prompt runs whole"
        assert len(s.kv.block_ids(rid)) == -(-r.num_computed_tokens // bs)
