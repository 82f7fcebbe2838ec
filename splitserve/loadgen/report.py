"""The results: percentiles, the summary (--json), the table printed and the plot (--plot)."""

from __future__ import annotations

import math
from dataclasses import asdict

from splitserve.loadgen.results import RequestResult


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
