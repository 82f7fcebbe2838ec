"""Summaries, the comparison table and the TTFT plot of simulator runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from splitserve.sim.simulator import SimResult


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (q in [0, 100]); nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _met_rate(recs: Sequence[Any]) -> dict[str, Any]:
    """Targets met among the requests that had any (refused and shed ones count as missed)."""
    with_target = [r for r in recs if r.has_target]
    met = sum(1 for r in with_target if r.met_deadline)
    return {
        "met": met,
        "of": len(with_target),
        "rate": met / len(with_target) if with_target else None,
    }


def goodput_summary(res: SimResult) -> dict[str, Any]:
    """Requests that met their deadlines per second of the trace's arrivals (the same time for
    every policy on one trace), and the goodput and met rate overall, per tenant and per
    priority."""
    recs = res.records
    arrivals = [r.arrival for r in recs]
    span = max(arrivals) - min(arrivals) if len(arrivals) > 1 else 0.0
    overall = _met_rate(recs)
    by_tenant = {
        t: _met_rate([r for r in recs if (r.tenant or "-") == t])
        for t in sorted({r.tenant or "-" for r in recs})
    }
    by_priority = {
        p: _met_rate([r for r in recs if r.priority == p])
        for p in sorted({r.priority for r in recs})
    }

    def per_s(met: int) -> float:
        return met / span if span > 0 else 0.0

    return {
        "goodput_rps": per_s(overall["met"]),
        "met": overall["met"],
        "met_rate": overall["rate"],
        "with_targets": overall["of"],
        "shed": sum(1 for r in recs if r.refused == "shed"),
        "goodput_rps_by_tenant": {t: per_s(m["met"]) for t, m in by_tenant.items()},
        "met_rate_by_tenant": {t: m["rate"] for t, m in by_tenant.items()},
        "goodput_rps_by_priority": {p: per_s(m["met"]) for p, m in by_priority.items()},
        "met_rate_by_priority": {p: m["rate"] for p, m in by_priority.items()},
    }


def summarize(res: SimResult) -> dict[str, Any]:
    recs = res.records
    done = [r for r in recs if r.finish is not None]
    ttft = [r.ttft for r in recs if r.ttft is not None]
    tpot = [r.tpot for r in recs if r.tpot is not None]
    refused: dict[str, int] = {}
    for r in recs:
        if r.refused:
            refused[r.refused] = refused.get(r.refused, 0) + 1
    served = [r for r in recs if r.ttft is not None]
    longest = sorted(served, key=lambda r: r.prompt_len)[-max(1, len(served) // 10) :]
    out_tokens = sum(r.num_output for r in recs)
    t = res.sim_time_s
    new = res.computed_tokens - res.recomputed_tokens
    shares_src = res.tenant_tokens_contended or res.tenant_tokens
    total_share = sum(shares_src.values())
    deadlines = [r.met_deadline for r in recs if r.met_deadline is not None]
    by_priority: dict[int, list[float]] = {}
    for r in served:
        by_priority.setdefault(r.priority, []).append(r.ttft)  # type: ignore[arg-type]
    s = res.settings
    return {
        "label": res.label,
        "policy": s.policy,
        "preemption_mode": s.preemption_mode,
        "cost_model": res.cost_model,
        "requests": len(recs),
        "finished": len(done),
        "refused": refused,
        "unfinished": len(recs) - len(done) - sum(refused.values()),
        "sim_time_s": t,
        "wall_s": res.wall_s,
        "steps": res.steps,
        "output_tok_s": out_tokens / t if t > 0 else 0.0,
        "requests_s": len(done) / t if t > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_max_s": max(ttft) if ttft else math.nan,
        "ttft_longest10_mean_s": (
            sum(r.ttft for r in longest) / len(longest) if served else math.nan  # type: ignore[misc]
        ),
        "tpot_p50_ms": percentile(tpot, 50) * 1e3,
        "tpot_p90_ms": percentile(tpot, 90) * 1e3,
        "tpot_p99_ms": percentile(tpot, 99) * 1e3,
        "preemptions": res.preemptions,
        "swap_outs": res.swap_outs,
        "recomputed_tokens": res.recomputed_tokens,
        "recompute_ratio": res.recomputed_tokens / new if new > 0 else 0.0,
        "thrash_max_ratio": res.thrash_max_ratio,
        "backpressure_fired": res.thrash_episodes > 0,
        "thrash_first_at_s": res.thrash_first_at,
        "tenant_shares": {(k or "-"): v / total_share for k, v in sorted(shares_src.items())}
        if total_share
        else {},
        "deadlines_met": sum(deadlines) / len(deadlines) if deadlines else None,
        "ttft_p50_by_priority_s": {p: percentile(v, 50) for p, v in sorted(by_priority.items())},
        "stuck": res.stuck,
        **goodput_summary(res),
    }


def _fmt(v: float, scale: float = 1.0, digits: int = 2) -> str:
    return (
        "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * scale:.{digits}f}"
    )


def print_table(results: Sequence[SimResult], title: str = "splitserve sim", console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = [summarize(r) for r in results]
    table = Table(title=title)
    cols = [
        "run",
        "done/refused",
        "out tok/s",
        "TTFT p50/p90/p99 s",
        "TTFT longest10% s",
        "TPOT p50/p90/p99 ms",
        "preempt",
        "recomputed",
        "thrash max",
        "shares",
        "deadline",
        "goodput/s",
        "TTFT p50 by priority",
    ]
    for c in cols:
        left = c in ("run", "shares", "TTFT p50 by priority")
        table.add_column(c, justify="left" if left else "right")
    for s in rows:
        refused = sum(s["refused"].values())
        shares = " ".join(f"{k}:{100 * v:.0f}%" for k, v in s["tenant_shares"].items())
        thrash = (
            _fmt(s["thrash_max_ratio"], 100, 0) + "%" + (" !" if s["backpressure_fired"] else "")
        )
        met = s["deadlines_met"]
        table.add_row(
            s["label"],
            f"{s['finished']}/{refused}" + (" stuck" if s["stuck"] else ""),
            _fmt(s["output_tok_s"], 1, 0),
            "/".join(_fmt(s[k]) for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")),
            _fmt(s["ttft_longest10_mean_s"]),
            "/".join(_fmt(s[k], 1, 0) for k in ("tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms")),
            str(s["preemptions"]),
            str(s["recomputed_tokens"]),
            thrash,
            shares if len(s["tenant_shares"]) > 1 else "",
            "" if met is None else f"{100 * met:.0f}%",
            "" if met is None else f"{s['goodput_rps']:.3f}",
            " ".join(f"{p}:{v:.1f}" for p, v in s["ttft_p50_by_priority_s"].items())
            if len(s["ttft_p50_by_priority_s"]) > 1
            else "",
        )
    if console is None:
        console = Console(width=200)
    console.print(table)
    groups = group_table(rows)
    if groups is not None:
        console.print(groups)


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.0f}%"


def group_table(rows: Sequence[dict[str, Any]]):
    """Goodput and met rate per tenant and per priority, one column each ("met t:a" the met
    rate of tenant a's requests with targets, "goodput t:a" those met per second), one row per
    run; a dimension with one value in every run (no tenants, one priority) gets no columns.
    None when neither has more than one value."""
    from rich.table import Table

    tenants = sorted({t for s in rows for t in s["met_rate_by_tenant"]})
    priorities = sorted({p for s in rows for p in s["met_rate_by_priority"]})
    groups = [("t", "tenant", t) for t in tenants] if len(tenants) > 1 else []
    groups += [("p", "priority", p) for p in priorities] if len(priorities) > 1 else []
    if not groups:
        return None
    table = Table(title="targets met per tenant and per priority (met rate, met per second)")
    table.add_column("run")
    for c in ("goodput/s", "met", "shed"):
        table.add_column(c, justify="right")
    for key, _, value in groups:
        table.add_column(f"met {key}:{value}", justify="right")
    for key, _, value in groups:
        table.add_column(f"goodput {key}:{value}", justify="right")
    for s in rows:
        rates = [s[f"met_rate_by_{dim}"].get(v) for _, dim, v in groups]
        per_s = [s[f"goodput_rps_by_{dim}"].get(v) for _, dim, v in groups]
        table.add_row(
            s["label"],
            f"{s['goodput_rps']:.3f}",
            f"{s['met']}/{s['with_targets']}",
            str(s["shed"]),
            *(_pct(r) for r in rates),
            # no requests with targets in the group: no goodput to speak of
            *("-" if r is None else f"{g:.3f}" for r, g in zip(rates, per_s, strict=True)),
        )
    return table


def plot_ttft(results: Sequence[SimResult], path: Path | str, title: str = "") -> Path:
    """TTFT distributions side by side (one violin per run, log scale) and their CDFs."""
    plt = _pyplot()
    labels = [r.label for r in results]
    data = [
        [max(x.ttft, 1e-4) for x in r.records if x.ttft is not None] or [math.nan] for r in results
    ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(results) + 6), 4.8))
    ok = [i for i, d in enumerate(data) if not math.isnan(d[0])]
    if ok:
        parts = ax1.violinplot(
            [data[i] for i in ok], positions=[i + 1 for i in ok], showmedians=True, showextrema=True
        )
        for body in parts["bodies"]:
            body.set_alpha(0.5)
    ax1.set_yscale("log")
    ax1.set_xticks(range(1, len(labels) + 1), labels, rotation=20, ha="right")
    ax1.set_ylabel("time to first token (s)")
    ax1.set_title("TTFT per run")
    for r, d in zip(results, data, strict=True):
        if math.isnan(d[0]):
            continue
        xs = sorted(d)
        ax2.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], label=r.label)
    ax2.set_xscale("log")
    ax2.set_xlabel("time to first token (s)")
    ax2.set_ylabel("fraction of requests")
    ax2.set_title("TTFT CDF")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize="small")
    return _save(fig, path, title)


def plot_goodput(results: Sequence[SimResult], path: Path | str, title: str = "") -> Path:
    """Requests meeting their targets per second against load, one line per policy, one panel
    per trace (the goodput scenario's labels: "POLICY LOADx TRACE")."""
    plt = _pyplot()
    curves: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in results:
        policy, load, trace = r.label.split(" ", 2)
        point = (float(load.rstrip("x")), goodput_summary(r)["goodput_rps"])
        curves.setdefault(trace, {}).setdefault(policy, []).append(point)
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), squeeze=False)
    for ax, (trace, by_policy) in zip(axes[0], curves.items(), strict=True):
        for policy, points in by_policy.items():
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", label=policy)
        ax.set_xlabel("offered load (x capacity)")
        ax.set_ylabel("requests meeting their targets per second")
        ax.set_title(f"{trace} trace")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path, title)


def _pyplot():
    """matplotlib's pyplot on the file backend (imported on demand: plotting is optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path | str, title: str) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path
