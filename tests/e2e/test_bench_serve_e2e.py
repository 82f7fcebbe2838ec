"""`splitserve bench serve` end to end against splitserve's gRPC and OpenAI HTTP APIs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.http_cluster import API_KEY, shared_http_cluster
from tests.e2e.procs import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEYS = {
    "backend",
    "target",
    "model",
    "num_prompts",
    "completed",
    "failed",
    "errors",
    "duration_s",
    "request_rate",
    "max_concurrency",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "config",
    "requests",
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return shared_http_cluster(tmp_path_factory)


def bench(tmp_path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "bench",
            "serve",
            "--api-key",
            API_KEY,
            "--num-prompts",
            "16",
            "--ignore-eos",
            "--no-progress",
            "--json",
            str(out),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_bench_serve_grpc_fixed_lengths(cluster, tmp_path):
    plot = tmp_path / "plot.png"
    res, table = bench(
        tmp_path,
        "--backend",
        "grpc",
        "--target",
        cluster.target,
        "--input-len",
        "24",
        "--output-len",
        "4",
        "--plot",
        str(plot),
    )
    assert KEYS <= set(res)
    assert res["completed"] == 16 and res["failed"] == 0, res["errors"]
    assert res["total_input_tokens"] == 16 * 24
    assert res["total_output_tokens"] == 16 * 4
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(res[key]) == {"mean", "p50", "p90", "p99", "max"}
        assert 0 < res[key]["p50"] <= res[key]["p99"] <= res[key]["max"]
    assert res["output_throughput"] > 0 and res["request_throughput"] > 0
    assert len(res["requests"]) == 16 and all(r["output_len"] == 4 for r in res["requests"])
    for word in ("req/s", "output tok/s", "total tok/s", "TTFT", "TPOT", "ITL", "E2E"):
        assert word in table
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_openai_poisson_with_length_distributions(cluster, tmp_path):
    res, _ = bench(
        tmp_path,
        "--backend",
        "openai",
        "--base-url",
        cluster.base_url + "/v1",
        "--input-len",
        "24",
        "--input-dist",
        "lognormal",
        "--output-len",
        "4",
        "--output-dist",
        "uniform",
        "--request-rate",
        "40",
        "--max-concurrency",
        "8",
    )
    assert KEYS <= set(res)
    assert res["completed"] == 16 and res["failed"] == 0, res["errors"]
    assert res["model"] == "SmolLM2-135M-Instruct"
    prompt_lens = [r["prompt_len"] for r in res["requests"]]
    assert len(set(prompt_lens)) > 1 and sum(prompt_lens) == res["total_input_tokens"]
    assert all(2 <= r["output_len"] <= 6 for r in res["requests"])
    assert res["max_concurrency"] == 8 and res["request_rate"] == 40
    assert res["itl_ms"]["p50"] > 0
