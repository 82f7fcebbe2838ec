"""The benchmark client's pieces: length distributions, percentiles, summary and table."""

from __future__ import annotations

import argparse
import random

import pytest

from splitserve.loadgen import (
    RequestResult,
    add_arguments,
    format_table,
    percentile,
    sample_lengths,
    summarize,
    synthetic_requests,
)


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    ns = p.parse_args(list(argv))
    ns.percentile_list = [50.0, 90.0, 99.0]
    return ns


def test_fixed_uniform_and_lognormal_lengths():
    rng = random.Random(0)
    assert sample_lengths(rng, 5, 32, "fixed", 0.5, 1.0, 128) == [32] * 5
    uni = sample_lengths(rng, 2000, 100, "uniform", 0.5, 1.0, 1000)
    assert min(uni) >= 50 and max(uni) <= 150 and 95 < sum(uni) / len(uni) < 105
    logn = sample_lengths(rng, 20000, 100, "lognormal", 0.5, 1.0, 10**6)
    assert 95 < sum(logn) / len(logn) < 105  # the mean is the requested one
    assert sorted(logn)[len(logn) // 2] < 100  # long-tailed: the median is below the mean
    assert max(logn) > 500
    assert max(sample_lengths(rng, 1000, 100, "lognormal", 0.5, 1.5, 300)) == 300  # clipped
    with pytest.raises(ValueError):
        sample_lengths(rng, 1, 10, "zipf", 0.5, 1.0, 100)


def test_synthetic_prompts_have_exact_lengths_and_a_shared_prefix():
    ns = args(
        "--num-prompts", "8", "--input-len", "20", "--output-len", "5", "--shared-prefix-len", "4"
    )
    reqs = synthetic_requests(ns, list(range(100, 200)))
    assert [len(r.prompt_token_ids) for r in reqs] == [24] * 8
    assert all(r.max_tokens == 5 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:4]) for r in reqs}) == 1
    assert all(100 <= t < 200 for r in reqs for t in r.prompt_token_ids)
    assert synthetic_requests(ns, list(range(100, 200)))[3] == reqs[3]  # seeded


def test_percentiles_interpolate_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)


def test_summary_and_table():
    ns = args("--backend", "grpc", "--max-concurrency", "2")
    results = [
        RequestResult(ok=True, prompt_len=10, output_len=5, ttft=0.1, e2e=0.5, itl=[0.1] * 4),
        RequestResult(ok=True, prompt_len=10, output_len=3, ttft=0.2, e2e=0.4, itl=[0.1] * 2),
        RequestResult(ok=False, error="UNAVAILABLE: no worker", prompt_len=10),
    ]
    res = summarize(ns, "m", results, 2.0)
    assert res["completed"] == 2 and res["failed"] == 1
    assert res["errors"] == ["UNAVAILABLE: no worker"]
    assert res["total_output_tokens"] == 8 and res["output_throughput"] == 4.0
    assert res["total_token_throughput"] == 14.0 and res["request_throughput"] == 1.0
    assert res["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert res["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert res["request_rate"] == "inf" and res["max_concurrency"] == 2
    table = format_table(res)
    assert "TTFT" in table and "p99" in table and "UNAVAILABLE" in table
