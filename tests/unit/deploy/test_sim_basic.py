"""The simulator: traces, the cost model, determinism, simulated time, the CLI, JSON and plot."""

from __future__ import annotations

import json
import statistics

import pytest

from scheduler_svc.core import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from splitserve.cli import main as cli_main
from splitserve.sim import (
    SimSettings,
    StepCostModel,
    TraceConfig,
    make_trace,
    percentile,
    simulate,
    summarize,
)

COST = StepCostModel(
    base_s=0.01,
    per_token_s=1e-4,
    per_ctx_token_s=1e-7,
    per_seq_s=1e-4,
    swap_bytes_per_s=1e9,
    swap_latency_s=1e-3,
    kv_bytes_per_block=1 << 20,
)


def test_trace_poisson_long_tailed_tenants_priorities_deadlines():
    tc = TraceConfig(
        num_requests=2000,
        request_rate=20.0,
        prompt_median=200,
        prompt_sigma=1.0,
        prompt_max=4000,
        tenants={"a": 3, "b": 1},
        priorities=(0, 1, 2),
        deadline_base_s=1.0,
        deadline_per_output_s=0.05,
        seed=3,
    )
    trace = make_trace(tc)
    assert trace == make_trace(tc)  # deterministic
    gaps = [b.arrival - a.arrival for a, b in zip(trace, trace[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.1)
    prompts = sorted(r.prompt_len for r in trace)
    assert percentile(prompts, 50) == pytest.approx(200, rel=0.15)
    assert percentile(prompts, 99) > 5 * percentile(prompts, 50)  # long tail
    assert max(prompts) <= 4000 and min(prompts) >= 4
    share_a = sum(r.tenant == "a" for r in trace) / len(trace)
    assert share_a == pytest.approx(0.75, abs=0.05)
    assert {r.priority for r in trace} == {0, 1, 2}
    r = trace[7]
    assert r.deadline == pytest.approx(r.arrival + 1.0 + 0.05 * r.output_len)
    ids = r.prompt_token_ids(7, shared_prefix_len=16)
    assert len(ids) == r.prompt_len and ids[:16] == trace[8].prompt_token_ids(8, 16)[:16]
    assert all(x.arrival == 0.0 for x in make_trace(TraceConfig(num_requests=5, request_rate=0)))


def test_cost_model_step_time_and_calibration_file():
    out = SchedulerOutput(
        new_requests=[NewRequestData("a", [1] * 10, SamplingParams(), [0], 4)],
        cached_requests=[CachedRequestData("b", [], 100)],
        num_scheduled_tokens={"a": 6, "b": 1},
        total_num_scheduled_tokens=7,
        blocks_to_swap_out=[(1, 0), (2, 1)],
    )
    pairs = (6 * 4 + 21) + (100 + 1)
    expected = 0.01 + 7e-4 + 1e-7 * pairs + 2e-4 + (1e-3 + 2 * (1 << 20) / 1e9)
    assert COST.step_time(out) == pytest.approx(expected)
    assert COST.step_time(SchedulerOutput()) == 0.0
    default = StepCostModel.load()
    assert default.per_token_s > 0 and default.command.startswith("python bench/sim_calibrate.py")
    assert default.name in StepCostModel.profiles()
    with pytest.raises(ValueError, match="no calibration profile"):
        StepCostModel.load("nope")
    costs = COST.worker_costs()
    assert costs.known and costs.prefill_s_per_token == 1e-4


def test_simulation_is_deterministic_fast_and_complete():
    trace = make_trace(TraceConfig(num_requests=300, request_rate=10.0, seed=1))
    a = simulate(SimSettings(policy="sjf"), trace, COST)
    b = simulate(SimSettings(policy="sjf"), trace, COST)
    assert [r.ttft for r in a.records] == [r.ttft for r in b.records]
    assert all(r.finish is not None and r.num_output == r.output_len for r in a.records)
    s = summarize(a)
    assert s["finished"] == 300 and s["output_tok_s"] > 0 and s["ttft_p50_s"] > 0
    assert s["ttft_p50_s"] <= s["ttft_p90_s"] <= s["ttft_p99_s"] <= s["ttft_max_s"]
    assert a.wall_s < 0.2 * a.sim_time_s  # simulated time: nothing sleeps
    assert not a.stuck


def test_swap_and_two_workers_and_slo_refusals_in_the_simulator():
    trace = make_trace(
        TraceConfig(
            num_requests=80,
            request_rate=40.0,
            prompt_median=300,
            prompt_max=1500,
            output_median=200,
            seed=2,
        )
    )
    small = dict(num_blocks=120, max_model_len=1900)
    rec = simulate(SimSettings(**small), trace, COST)
    swap = simulate(SimSettings(preemption_mode="swap", num_host_blocks=400, **small), trace, COST)
    assert rec.preemptions > 0 and rec.recomputed_tokens > 0
    assert swap.swap_outs > 0 and swap.recomputed_tokens < rec.recomputed_tokens
    two = simulate(SimSettings(num_workers=2, **small), trace, COST)
    assert summarize(two)["ttft_p50_s"] < summarize(rec)["ttft_p50_s"]
    slo = simulate(SimSettings(ttft_slo_ms=500, **small), trace, COST)
    refused = [r for r in slo.records if r.refused == "slo"]
    assert refused and "predicted time to first token" in refused[0].refused_reason
    served = [r.ttft for r in slo.records if r.ttft is not None]
    assert percentile(served, 90) < percentile([r.ttft for r in rec.records if r.ttft], 90)


def test_cli_prints_a_table_and_writes_json_and_a_png(tmp_path, capsys):
    out_json, out_png = tmp_path / "sim.json", tmp_path / "ttft.png"
    rc = cli_main(
        [
            "sim",
            "--scenario",
            "policies",
            "--policies",
            "fcfs,sjf,fair",
            "--num-requests",
            "80",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    main, groups = _tables(printed)
    assert main[0][:4] == ["run", "done/refused", "out tok/s", "TTFT p50/p90/p99 s"]
    assert {"deadline", "goodput/s", "TTFT p50 by priority"} <= set(main[0])
    assert [r[0] for r in main[1:]] == ["fcfs", "sjf", "fair"]
    # the policies trace has two tenants and priorities 0-2: a column for each
    assert groups[0] == [
        "run",
        "goodput/s",
        "met",
        "shed",
        *("met t:a", "met t:b", "met p:0", "met p:1", "met p:2"),
        *("goodput t:a", "goodput t:b", "goodput p:0", "goodput p:1", "goodput p:2"),
    ]
    rows = json.loads(out_json.read_text())
    assert [r["label"] for r in rows] == ["fcfs", "sjf", "fair"]
    assert {
        "ttft_p99_s",
        "tpot_p50_ms",
        "preemptions",
        "recomputed_tokens",
        "tenant_shares",
        "output_tok_s",
    } <= set(rows[0])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _tables(printed: str) -> list[list[list[str]]]:
    """The rich tables in ``printed``: per table its header row, then its data rows, as cells
    (a table here never wraps a cell: one line a row)."""
    tables: list[list[list[str]]] = []
    for line in printed.splitlines():
        line = line.strip()
        if line.startswith("┏"):
            tables.append([])
        elif line[:1] in ("┃", "│"):
            tables[-1].append([c.strip() for c in line.strip("┃│").split(line[0])])
    return tables


def test_cli_prints_goodput_and_met_rate_per_tenant_and_priority_as_in_the_json(tmp_path, capsys):
    out_json = tmp_path / "goodput.json"
    rc = cli_main(
        [
            "sim",
            "--scenario",
            "goodput",
            "--policies",
            "deadline,goodput",
            "--shed-hopeless",
            "--num-requests",
            "40",
            "--request-rate",
            "3",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    rows = json.loads(out_json.read_text())
    _, groups = _tables(capsys.readouterr().out)
    header, printed = groups[0], groups[1:]
    assert len(printed) == len(rows) == 24  # two policies, four loads, three traces
    assert sum(r["shed"] for r in rows) > 0  # the goodput runs shed at this rate
    for line, s in zip(printed, rows, strict=True):
        cells = dict(zip(header, line, strict=True))
        assert cells["run"] == s["label"]
        assert float(cells["goodput/s"]) == pytest.approx(s["goodput_rps"], abs=5e-4)
        assert cells["met"] == f"{s['met']}/{s['with_targets']}" and s["with_targets"] == 40
        assert int(cells["shed"]) == s["shed"]
        for key, dim, values in (("t", "tenant", "ab"), ("p", "priority", "012")):
            assert set(s[f"met_rate_by_{dim}"]) == set(values)
            met = 0.0
            for v in values:
                rate, per_s = s[f"met_rate_by_{dim}"][v], s[f"goodput_rps_by_{dim}"][v]
                assert cells[f"met {key}:{v}"] == f"{100 * rate:.0f}%"
                assert float(cells[f"goodput {key}:{v}"]) == pytest.approx(per_s, abs=5e-4)
                met += per_s
            # the groups split the run's goodput
            assert met == pytest.approx(s["goodput_rps"])
    # not all the same: the columns tell the groups apart somewhere
    assert len({line[header.index("met t:a")] for line in printed}) > 1
