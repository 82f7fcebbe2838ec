"""`splitserve bench serve`'s flags, and the command: build the requests, run, print, save."""

from __future__ import annotations

import argparse
import json

from common import event_loop
from splitserve.loadgen.dataset import DISTRIBUTIONS, synthetic_requests, token_pool
from splitserve.loadgen.report import format_table, write_plot
from splitserve.loadgen.runner import run_benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    p.add_argument("--target", default="localhost:50051", help="grpc: the scheduler HOST:PORT")
    p.add_argument(
        "--base-url", default="http://localhost:8000/v1", help="openai: the API's base URL"
    )
    p.add_argument("--model", default=None, help="model name (default: the server's)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer whose vocabulary prompts are drawn from "
        "(anything --model of splitserve takes; default: SmolLM2)",
    )
    p.add_argument("--vocab-size", type=int, default=None, help="draw ids below this instead")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="mean max_tokens")
    p.add_argument("--input-dist", choices=DISTRIBUTIONS, default="fixed")
    p.add_argument("--output-dist", choices=DISTRIBUTIONS, default="fixed")
    p.add_argument("--range-ratio", type=float, default=0.5, help="uniform: mean*(1 +- r)")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal: shape (tail weight)")
    p.add_argument("--max-input-len", type=int, default=None, help="clip (default 4x the mean)")
    p.add_argument("--max-output-len", type=int, default=None, help="clip (default 4x the mean)")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens all prompts share")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals, requests/s (default inf: all at once)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--percentiles", default="50,90,99", help="comma-separated")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="draw the results (PNG)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise SystemExit("--num-prompts must be >= 1")
    if not args.request_rate > 0:
        raise SystemExit("--request-rate must be > 0 (inf sends all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be >= 1")
    args.percentile_list = [float(x) for x in args.percentiles.split(",") if x.strip()]
    try:
        requests = synthetic_requests(args, token_pool(args.tokenizer, args.vocab_size))
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    res = event_loop.run(run_benchmark(args, requests))
    print(format_table(res))
    if args.plot:
        write_plot(res, args.plot)
    res.pop("_timeline", None)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    return 0 if res["completed"] else 1
