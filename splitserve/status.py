"""`splitserve status [--json]`: the cluster as a front-end's GET /cluster reports it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", default="http://localhost:8000", help="a front-end's (or scheduler's) HTTP address"
    )
    p.add_argument("--json", action="store_true", help="print GET /cluster's JSON as it is")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument(
        "--api-key",
        default=os.environ.get("SPLITSERVE_API_KEY", ""),
        help="the server's API key, where it has one (/cluster needs it); "
        "default: $SPLITSERVE_API_KEY",
    )


def fetch(url: str, timeout: float, api_key: str = "") -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url.rstrip("/") + "/cluster", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def render(body: dict) -> str:
    take = body.get("last_takeover", {})
    lines = [
        f"model {body['model']}  epoch {body['epoch']}  failovers {body['failovers']}  "
        f"last takeover {take.get('seconds', 0):g} s ({take.get('adopted', 0)} of "
        f"{take.get('resumed', 0)} requests adopted, {take.get('recomputed_tokens', 0)} tokens "
        f"recomputed)  in flight {body['requests_in_flight']}  waiting {body['waiting']}",
        "",
        f"{'KIND':<10} {'ID':<24} {'HOST':<24} {'PID':>7}  {'STATE':<10} DETAIL",
    ]
    for s in body["schedulers"]:
        detail = f"{s['role']}, epoch {s['epoch']}" if s["role"] == "leader" else s["role"]
        lines.append(_row("scheduler", s, detail))
    for shard in body.get("shards", ()):
        lines.append(_row("shard", shard, f"{shard['address']}, {shard['running']} running"))
    for f in body["frontends"]:
        lines.append(_row("frontend", f, f"{f['address']}, {f['requests_in_flight']} in flight"))
    for w in body["workers"]:
        detail = f"{w['running']} running, KV {100 * w['kv_usage']:.1f}%"
        if w.get("kernels"):
            detail += f", {w['kernels']}"
        lines.append(_row("worker", w, detail))
    return "\n".join(lines)


def _row(kind: str, m: dict, detail: str) -> str:
    return (
        f"{kind:<10} {m['id']:<24} {m['host']:<24} {m['pid'] or '':>7}  {m['state']:<10} {detail}"
    )


def run(args: argparse.Namespace) -> int:
    try:
        body = fetch(args.url, args.timeout, args.api_key)
    except urllib.error.HTTPError as exc:
        print(
            f"error: {args.url}/cluster answered {exc.code}: {exc.read().decode()}", file=sys.stderr
        )
        if exc.code == 401:
            print(
                "the server has an API key: pass --api-key (or set SPLITSERVE_API_KEY)",
                file=sys.stderr,
            )
        return 2
    except (urllib.error.URLError, OSError) as exc:
        print(f"error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(body, indent=2) if args.json else render(body))
    return 0
