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

A client of the wire types (common/) only, outside the library's layers; the one bench/ package
the distribution ships, so that the command works wherever splitserve is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from common import event_loop

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


# ---- the synthetic dataset ------------------------------------------------------------------
@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def sample_lengths(
    rng: random.Random, n: int, mean: int, dist: str, range_ratio: float, sigma: float, cap: int
) -> list[int]:
    """n lengths >= 1 with this mean: fixed, uniform in [mean(1-r), mean(1+r)], or lognormal
    with this mean and shape sigma (long-tailed), all clipped to [1, cap]."""
    if mean < 1:
        raise ValueError(f"a mean length must be >= 1; got {mean}")
    if dist == "fixed":
        values = [mean] * n
    elif dist == "uniform":
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1); got {range_ratio}")
        lo = max(1, math.floor(mean * (1 - range_ratio)))
        hi = max(lo, math.ceil(mean * (1 + range_ratio)))
        values = [rng.randint(lo, hi) for _ in range(n)]
    elif dist == "lognormal":
        if sigma <= 0:
            raise ValueError(f"--sigma must be > 0; got {sigma}")
        mu = math.log(mean) - sigma * sigma / 2  # E[X] = exp(mu + sigma^2 / 2) = mean
        values = [round(rng.lognormvariate(mu, sigma)) for _ in range(n)]
    else:
        raise ValueError(f"unknown length distribution {dist!r}; one of {DISTRIBUTIONS}")
    return [min(cap, max(1, v)) for v in values]


def token_pool(tokenizer_name: str | None, vocab_size: int | None) -> list[int]:
    """Token ids to draw prompts from: the vocabulary without special/added tokens."""
    if vocab_size:
        return list(range(min(1000, vocab_size // 2), vocab_size))
    from common.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_name)
    special = set(tok.backend.get_added_tokens_decoder())
    return [i for i in range(tok.vocab_size) if i not in special]


def synthetic_requests(args: argparse.Namespace, pool: list[int]) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    n = args.num_prompts
    ins = sample_lengths(
        rng,
        n,
        args.input_len,
        args.input_dist,
        args.range_ratio,
        args.sigma,
        args.max_input_len or 4 * args.input_len,
    )
    outs = sample_lengths(
        rng,
        n,
        args.output_len,
        args.output_dist,
        args.range_ratio,
        args.sigma,
        args.max_output_len or 4 * args.output_len,
    )
    prefix = [rng.choice(pool) for _ in range(args.shared_prefix_len)]
    return [
        BenchRequest(prefix + [rng.choice(pool) for _ in range(i)], o)
        for i, o in zip(ins, outs, strict=True)
    ]


# ---- one request's measurements -------------------------------------------------------------
@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    start: float = 0.0  # seconds since the benchmark started
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between token arrivals
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time since start, tokens)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


class _Timer:
    """Records token arrivals relative to the request's send time and the benchmark's start."""

    def __init__(self, result: RequestResult, t0: float) -> None:
        self.result = result
        self.t0 = t0
        self.sent = time.perf_counter()
        result.start = self.sent - t0
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        now = time.perf_counter()
        r = self.result
        if self.last is None:
            r.ttft = now - self.sent
        else:
            r.itl.append(now - self.last)
        self.last = now
        r.arrivals.append((now - self.t0, n))

    def done(self) -> None:
        self.result.e2e = time.perf_counter() - self.sent


# ---- backends -------------------------------------------------------------------------------
class GrpcBackend:
    name = "grpc"

    def __init__(self, args: argparse.Namespace) -> None:
        import grpc

        from common.pb import generation_pb2_grpc

        self.grpc = grpc
        self.args = args
        self.channel = grpc.aio.insecure_channel(args.target)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None

    async def check(self) -> str:
        from common.pb import generation_pb2 as pb

        info = await self.stub.GetServerInfo(
            pb.ServerInfoRequest(), metadata=self.metadata, timeout=30
        )
        if not info.workers:
            print("warning: the server has no worker attached", file=sys.stderr)
        return self.args.model or info.model

    async def send(self, req: BenchRequest, t0: float) -> RequestResult:
        from common.client import build_request

        result = RequestResult(prompt_len=len(req.prompt_token_ids))
        msg = build_request(
            token_ids=req.prompt_token_ids,
            model=self.args.model or "",
            max_tokens=req.max_tokens,
            temperature=self.args.temperature,
            ignore_eos=self.args.ignore_eos or None,
        )
        timer = _Timer(result, t0)
        try:
            call = self.stub.Generate(msg, metadata=self.metadata, timeout=self.args.timeout)
            async for out in call:
                if out.token_ids:
                    timer.tokens(len(out.token_ids))
                if out.finish_reason:
                    result.output_len = out.completion_tokens
                    result.ok = not out.error
                    result.error = out.error
            timer.done()
            if not result.ok and not result.error:
                result.error = "the stream ended without a finish reason"
        except self.grpc.RpcError as exc:
            result.error = f"{exc.code().name}: {exc.details()}"
        return result

    async def close(self) -> None:
        await self.channel.close()


class OpenAIBackend:
    name = "openai"

    def __init__(self, args: argparse.Namespace) -> None:
        import httpx

        self.args = args
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.client = httpx.AsyncClient(
            base_url=args.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(args.timeout, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self.model = args.model

    async def check(self) -> str:
        if not self.model:
            r = await self.client.get("/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def send(self, req: BenchRequest, t0: float) -> RequestResult:
        import httpx

        result = RequestResult(prompt_len=len(req.prompt_token_ids))
        payload = {
            "model": self.model,
            "prompt": req.prompt_token_ids,
            "max_tokens": req.max_tokens,
            "temperature": self.args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.args.ignore_eos:
            payload["ignore_eos"] = True
        timer = _Timer(result, t0)
        chunks = 0
        try:
            async with self.client.stream("POST", "/completions", json=payload) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    result.error = f"HTTP {resp.status_code}: {body[:300]}"
                    return result
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        result.ok = not result.error
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = str(chunk["error"].get("message", chunk["error"]))
                        continue
                    if chunk.get("usage"):
                        result.output_len = chunk["usage"].get("completion_tokens", 0)
                    for choice in chunk.get("choices") or ():
                        if choice.get("text") or choice.get("finish_reason") is None:
                            timer.tokens(1)
                            chunks += 1
            timer.done()
            if not result.ok and not result.error:
                result.error = "the stream ended without data: [DONE]"
            if not result.output_len:  # a server without usage in streams
                result.output_len = chunks
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    async def close(self) -> None:
        await self.client.aclose()


# ---- the run --------------------------------------------------------------------------------
async def run_benchmark(args: argparse.Namespace, requests: list[BenchRequest]) -> dict:
    backend = GrpcBackend(args) if args.backend == "grpc" else OpenAIBackend(args)
    try:
        model = await backend.check()
        progress = None
        if not args.no_progress:
            from tqdm import tqdm

            progress = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed + 1)

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                result = await backend.send(req, t0)
            else:
                async with sem:
                    result = await backend.send(req, t0)
            if progress is not None:
                progress.update(1)
            return result

        t0 = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            if i and math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if progress is not None:
            progress.close()
    finally:
        await backend.close()
    return summarize(args, model, results, duration)


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats_ms(values: list[float], percentiles: list[float]) -> dict:
    out = {"mean": sum(values) / len(values) * 1000 if values else float("nan")}
    for p in percentiles:
        out[f"p{p:g}"] = percentile(values, p) * 1000
    out["max"] = max(values) * 1000 if values else float("nan")
    return out


def summarize(args, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    pct = args.percentile_list
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    return {
        "backend": args.backend,
        "target": args.target if args.backend == "grpc" else args.base_url,
        "model": model,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration_s": duration,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "ttft_ms": stats_ms([r.ttft for r in ok if r.output_len], pct),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot) is not None], pct),
        "itl_ms": stats_ms([x for r in ok for x in r.itl], pct),
        "e2e_ms": stats_ms([r.e2e for r in ok], pct),
        "config": {
            k: v if not isinstance(v, float) or math.isfinite(v) else str(v)
            for k, v in vars(args).items()
            if k not in ("func", "api_key", "percentile_list")
        },
        "requests": [
            {k: v for k, v in asdict(r).items() if k not in ("itl", "arrivals")} for r in results
        ],
        "_timeline": [(t, n) for r in ok for t, n in r.arrivals],
    }


def format_table(res: dict) -> str:
    lines = [
        "=" * 62,
        f" splitserve bench serve · {res['backend']} · {res['target']} · {res['model']}",
        "=" * 62,
        f" requests: {res['completed']} ok, {res['failed']} failed, in {res['duration_s']:.2f} s"
        f"   (rate {res['request_rate']} req/s, concurrency {res['max_concurrency'] or 'inf'})",
        f" tokens: {res['total_input_tokens']} in, {res['total_output_tokens']} out",
        "-" * 62,
        f" {'throughput':<22}{'req/s':>12}{'output tok/s':>14}{'total tok/s':>14}",
        f" {'':<22}{res['request_throughput']:>12.2f}{res['output_throughput']:>14.1f}"
        f"{res['total_token_throughput']:>14.1f}",
        "-" * 62,
    ]
    keys = [k for k in res["ttft_ms"] if k != "max"]
    lines.append(f" {'latency (ms)':<14}" + "".join(f"{k:>12}" for k in keys))
    for name, key in (
        ("TTFT", "ttft_ms"),
        ("TPOT", "tpot_ms"),
        ("ITL", "itl_ms"),
        ("E2E", "e2e_ms"),
    ):
        lines.append(f" {name:<14}" + "".join(f"{res[key][k]:>12.2f}" for k in keys))
    lines.append("=" * 62)
    if res["errors"]:
        lines.append(" errors: " + "; ".join(res["errors"][:3]))
    return "\n".join(lines)


def write_plot(res: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'splitserve[dev]'") from exc
    ok = [r for r in res["requests"] if r["ok"]]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    fig.suptitle(
        f"{res['backend']} · {res['model']} · {res['completed']} requests · "
        f"{res['output_throughput']:.0f} output tok/s"
    )
    ax[0, 0].hist([r["ttft"] * 1000 for r in ok], bins=30, color="#f08c2e")
    ax[0, 0].set(title="time to first token", xlabel="ms", ylabel="requests")
    ax[0, 1].hist([r["e2e"] * 1000 for r in ok], bins=30, color="#2f6fde")
    ax[0, 1].set(title="end-to-end latency", xlabel="ms", ylabel="requests")
    for i, r in enumerate(sorted(ok, key=lambda r: r["start"])):
        ax[1, 0].plot([r["start"], r["start"] + r["ttft"]], [i, i], color="#f08c2e", lw=1.5)
        ax[1, 0].plot([r["start"] + r["ttft"], r["start"] + r["e2e"]], [i, i], color="#2f6fde")
    ax[1, 0].set(title="requests over time (queue+prefill | decode)", xlabel="s", ylabel="request")
    timeline = res.get("_timeline", [])
    if timeline:
        width = max(0.1, res["duration_s"] / 50)
        bins: dict[int, int] = {}
        for t, n in timeline:
            bins[int(t / width)] = bins.get(int(t / width), 0) + n
        xs = sorted(bins)
        ax[1, 1].bar(
            [x * width for x in xs],
            [bins[x] / width for x in xs],
            width=width,
            align="edge",
            color="#2f9e5b",
        )
    ax[1, 1].set(title="output tokens per second", xlabel="s", ylabel="tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- command line ---------------------------------------------------------------------------
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
