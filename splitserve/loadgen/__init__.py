"""`splitserve bench serve`: load a server with synthetic requests, report throughput and latency.

Like `vllm bench serve`: prompts are random vocabulary token ids (so their lengths are exact)
with fixed, uniform or long-tailed (lognormal) prompt and output length distributions; requests
arrive as a Poisson process (--request-rate) and/or under a concurrency cap
(--max-concurrency). Two backends:

- grpc: splitserve's Generation API (token ids in, streamed token ids out);
- openai: any OpenAI-compatible HTTP server, streaming /v1/completions with the prompt as a list
  of token ids; inter-token latency comes from chunk arrival times. Plain httpx streaming, no
  client-side retries.

Prints a table (req/s, output tok/s, total tok/s; TTFT, TPOT, ITL and end-to-end latency: mean
and percentiles); --json PATH writes the results, --plot PATH.png draws them (matplotlib).

A client of the wire types (common/) only, outside the library's layers (test_layers.py holds it
to that); it lives in the splitserve package so that the command works wherever splitserve is
installed, and the bench/ scripts import it from here.

    dataset.py    the synthetic requests and their length distributions
    results.py    one request's measurements
    backends.py   grpc and openai
    runner.py     arrivals and the concurrency cap
    report.py     summary, table, plot
    cli.py        the flags and the command
"""

from splitserve.loadgen.backends import GrpcBackend, OpenAIBackend
from splitserve.loadgen.cli import add_arguments, run
from splitserve.loadgen.dataset import (
    DISTRIBUTIONS,
    BenchRequest,
    sample_lengths,
    synthetic_requests,
    token_pool,
)
from splitserve.loadgen.report import format_table, percentile, stats_ms, summarize, write_plot
from splitserve.loadgen.results import RequestResult
from splitserve.loadgen.runner import run_benchmark

__all__ = [
    "DISTRIBUTIONS",
    "BenchRequest",
    "GrpcBackend",
    "OpenAIBackend",
    "RequestResult",
    "add_arguments",
    "format_table",
    "percentile",
    "run",
    "run_benchmark",
    "sample_lengths",
    "stats_ms",
    "summarize",
    "synthetic_requests",
    "token_pool",
    "write_plot",
]
