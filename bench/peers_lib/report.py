"""Per-run summaries, the ratio table, JSON and the bar-chart plot."""

from __future__ import annotations

import math

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from splitserve.loadgen import RequestResult, stats_ms

PCTS = [50.0, 90.0, 99.0]

LABELS = {
    "splitserve-grpc": "splitserve gRPC (scheduler + 1 worker)",
    "splitserve-inproc": "splitserve in-process",
    "llama-server": "llama.cpp llama-server -np {slots} -cb",
    "generate-batch": "transformers continuous batching",
    "hf-static": "HF generate, static batches of {static}",
    "hf": "HF generate, one at a time",
}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "input_tokens": sum(r.prompt_len for r in ok),
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration if duration else 0.0,
        "ttft_ms": stats_ms([r.ttft for r in ok], PCTS),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot) is not None], PCTS),
        "itl_ms": stats_ms([x for r in ok for x in r.itl], PCTS),
        "e2e_ms": stats_ms([r.e2e for r in ok], PCTS),
        "requests": [
            {
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "arrival_s": round(r.start, 4),
                "ttft_s": round(r.ttft, 4),
                "e2e_s": round(r.e2e, 4),
                "ok": r.ok,
            }
            for r in results
        ],
    }


def _fmt_s(ms: float) -> str:
    if math.isnan(ms):
        return "-"
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"


def _ratio(value: float, ref: float | None) -> str:
    if not ref or math.isnan(value) or math.isnan(ref):
        return ""
    return f"{value / ref:.2f}×"


def label(system: str, args) -> str:
    return LABELS[system].format(slots=args.llama_slots, static=args.static_batch)


def print_tables(res: dict, args, console: Console | None = None) -> None:
    console = console or Console(width=150)
    ref_name = res["reference"]
    for mode, rows in res["runs"].items():
        ref = rows.get(ref_name)
        table = Table(
            title=f"{res['workload']['name']} · arrivals: {mode} · {args.threads} threads · "
            f"ratios are system ÷ {ref_name}",
            title_justify="left",
        )
        cols = [
            "system",
            "out tok/s",
            "÷",
            "TTFT p50",
            "÷",
            "TTFT p99",
            "÷",
            "TPOT p50",
            "÷",
            "TPOT p99",
            "÷",
            "ok",
        ]
        for c in cols:
            table.add_column(c, justify="left" if c == "system" else "right")
        for system, s in rows.items():
            name = escape(system + (" [est.]" if s.get("estimated") else ""))
            g = ref or {}
            cells = [
                name,
                f"{s['output_tok_s']:.1f}",
                _ratio(s["output_tok_s"], g.get("output_tok_s")),
            ]
            for key, p in (
                ("ttft_ms", "p50"),
                ("ttft_ms", "p99"),
                ("tpot_ms", "p50"),
                ("tpot_ms", "p99"),
            ):
                v = s[key][p]
                cells += [_fmt_s(v), _ratio(v, g.get(key, {}).get(p))]
            cells.append(f"{s['completed']}/{s['completed'] + s['failed']}")
            table.add_row(*cells)
        if res.get("target") and mode == "burst":
            t, g = res["target"], ref or {}
            ttft = g.get("ttft_ms", {})
            table.add_row(
                t["label"],
                f"{t['output_tok_s']:.1f}",
                _ratio(t["output_tok_s"], g.get("output_tok_s")),
                _fmt_s(t["ttft_p50_ms"]),
                _ratio(t["ttft_p50_ms"], ttft.get("p50")),
                _fmt_s(t["ttft_p99_ms"]),
                _ratio(t["ttft_p99_ms"], ttft.get("p99")),
                *[""] * 5,
            )
        console.print(table)
    for system in dict.fromkeys(s for rows in res["runs"].values() for s in rows):
        console.print(f"  {system}: {escape(label(system, args))}")
    for note in res["notes"]:
        console.print(f"- {escape(note)}")


def write_plot(res: dict, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(res["runs"])
    systems = list(dict.fromkeys(s for m in modes for s in res["runs"][m]))
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    width = 0.8 / max(1, len(modes))
    colors = ["#2f6fde", "#f08c2e", "#2f9e5b"]
    panels = (
        ("output tokens/s (higher is better)", lambda s: s["output_tok_s"], 1.0),
        ("TTFT p50, s, log scale (lower is better)", lambda s: s["ttft_ms"]["p50"], 1e-3),
        ("TTFT p99, s, log scale (lower is better)", lambda s: s["ttft_ms"]["p99"], 1e-3),
    )
    for ax, (title, get, scale) in zip(axes, panels, strict=True):
        for k, mode in enumerate(modes):
            xs, ys = [], []
            for i, system in enumerate(systems):
                if system in res["runs"][mode]:
                    xs.append(i + k * width)
                    ys.append(get(res["runs"][mode][system]) * scale)
            ax.bar(xs, ys, width=width, label=mode, color=colors[k % len(colors)])
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(systems))])
        est = {s for m in modes for s, v in res["runs"][m].items() if v.get("estimated")}
        names = [s + (" (est.)" if s in est else "") for s in systems]
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        if scale != 1.0:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{res['workload']['name']}: SmolLM2-135M, {args.threads} CPU threads "
        "(llama.cpp runs Q4_1 weights, the others dequantized float32)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
