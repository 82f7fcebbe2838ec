"""What a client sees when the leader scheduler dies: `splitserve up --workers 2 --schedulers 2
--frontends 2` (local etcd), 64 concurrent greedy streams, the leader killed (SIGKILL) at a
random point of each run. Per run: the stall each stream saw (its largest gap between two
messages) p50/p99/max, tokens lost or duplicated against an undisturbed run (must be 0), and
what the takeover rebuilt: requests resumed, adopted on their worker's KV, tokens recomputed.

`--fault freeze` stops the leader (SIGSTOP) instead, as a host that vanished looks to the rest:
its sockets neither close nor refuse, so only its lease ends it. Each run then also breaks the
outage down, in seconds from the freeze, from the schedulers' logs and the streams: the leader
key gone (the lease expired, as the standby saw it), the standby elected, its rebuild done, and
the first token any stream got from it. The frozen leader is woken once the streams are done;
it finds its lease gone and exits, and `up` starts it again as a standby.

    python bench/failover.py --runs 10 [--fault kill|freeze] [--lease-ttl 2] [--simulate]
                             [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.client import SplitserveClient  # noqa: E402
from tests.e2e.ha_cluster import ha_up_argv, wait_ha_ready  # noqa: E402
from tests.e2e.procs import free_port, interrupt  # noqa: E402


@dataclass
class Stream:
    token_ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def max_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)), default=0.0)


def run_streams(port: int, n: int, max_tokens: int, kill_after_s: float | None, kill) -> list:
    streams = [Stream() for _ in range(n)]

    def one(i: int) -> None:
        s = streams[i]
        with SplitserveClient(f"127.0.0.1:{port}", timeout=300, own_connection=True) as client:
            try:
                for msg in client.stream(
                    f"Stream {i}: tell a long story about the sea.",
                    max_tokens=max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                ):
                    if msg.token_ids:
                        s.token_ids += msg.token_ids
                        s.times.append(time.monotonic())
            except Exception as exc:  # noqa: BLE001 - counted as a failed stream
                s.error = str(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    if kill_after_s is not None:
        time.sleep(kill_after_s)
        kill()
    for t in threads:
        t.join()
    return streams


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


# the standby's view of a takeover, as its log names each step (JSON lines, UTC timestamps)
PHASES = {"leader_vacant": "key_gone_s", "leader_elected": "elected_s", "leader_ready": "ready_s"}


def breakdown(log_path: Path, frozen_at: float, epoch: int) -> dict[str, float | None]:
    """Seconds from the freeze (a wall-clock time) to the first of each phase after it that
    belongs to the takeover of the leader of `epoch`."""
    found: dict[str, float | None] = dict.fromkeys(PHASES.values())
    for line in log_path.read_text(errors="replace").splitlines():
        if not line.startswith("{") or '"leader_' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        phase = PHASES.get(record.get("event"))
        if phase is None or found[phase] is not None:
            continue
        at = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
        if at >= frozen_at and (phase == "key_gone_s" or record.get("epoch", 0) > epoch):
            found[phase] = round(at - frozen_at, 3)
    return found


def first_token_after(streams: list[Stream], frozen_at: float, elected_s: float | None):
    """Seconds from the freeze (monotonic) to the first token any stream got after the new
    leader was elected: tokens the frozen leader sent just before may still arrive after it."""
    if elected_s is None:
        return None
    times = [t for s in streams for t in s.times if t > frozen_at + elected_s]
    return round(min(times) - frozen_at, 3) if times else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--simulate", action="store_true", help="simulated workers (no model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lease-ttl", type=float, default=2.0, help="the schedulers' etcd lease")
    parser.add_argument(
        "--fault",
        choices=("kill", "freeze"),
        default="kill",
        help="kill: SIGKILL the leader (a crashed process); freeze: SIGSTOP it (a vanished host)",
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    port, http_port = free_port(), free_port()
    log_path = Path(tempfile.mkdtemp(prefix="bench-failover-")) / "up.log"
    # the freeze's breakdown reads the schedulers' info events
    log_level = "info" if args.fault == "freeze" else "warning"
    argv = ha_up_argv(
        port,
        http_port,
        *("--max-num-seqs", "64", "--log-level", log_level, "--worker-arg=--num-gpu-blocks=512"),
        *("--lease-ttl", str(args.lease_ttl)),
        # every run kills a scheduler: restart it each time, at once
        *("--max-restarts", "1000", "--restart-backoff", "0.2"),
    )
    if args.simulate:
        argv += ["--worker-arg=--simulate", "--worker-arg=--sim-step-base-ms=20"]
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        body = wait_ha_ready(http_port, popen, log_path)
        started = time.monotonic()
        baseline = run_streams(port, args.streams, args.max_tokens, None, None)
        duration = time.monotonic() - started
        assert not any(s.error for s in baseline), [s.error for s in baseline if s.error][:3]
        for run in tqdm(range(args.runs), desc=f"leader {args.fault}s"):
            leader = next(s for s in body["schedulers"] if s["role"] == "leader")
            kill_at = rng.uniform(0.2, 0.8) * duration
            victim = psutil.Process(leader["pid"])
            frozen_at = [0.0, 0.0]  # wall clock, monotonic

            def fault(victim=victim, frozen_at=frozen_at) -> None:
                if args.fault == "kill":
                    victim.kill()
                    return
                frozen_at[:] = time.time(), time.monotonic()
                victim.send_signal(signal.SIGSTOP)

            streams = run_streams(port, args.streams, args.max_tokens, kill_at, fault)
            if args.fault == "freeze":
                victim.send_signal(signal.SIGCONT)  # it finds its lease gone and exits
            body = wait_ha_ready(http_port, popen, log_path, min_epoch=leader["epoch"] + 1)
            lost = dup = failed = 0
            for got, want in zip(streams, baseline, strict=True):
                failed += bool(got.error)
                common = sum(
                    1 for a, b in zip(got.token_ids, want.token_ids, strict=False) if a == b
                )
                lost += max(0, len(want.token_ids) - len(got.token_ids))
                dup += max(0, len(got.token_ids) - len(want.token_ids))
                dup += min(len(got.token_ids), len(want.token_ids)) - common
            gaps = [s.max_gap for s in streams if not s.error]
            takeover = body["last_takeover"]
            rows.append(
                {
                    "run": run,
                    "kill_at_s": round(kill_at, 2),
                    "stall_p50_s": round(pct(gaps, 50), 3),
                    "stall_p99_s": round(pct(gaps, 99), 3),
                    "stall_max_s": round(max(gaps), 3),
                    "failed": failed,
                    "lost": lost,
                    "duplicated": dup,
                    "takeover_s": takeover["seconds"],
                    "resumed": takeover["resumed"],
                    "adopted": takeover["adopted"],
                    "recomputed_tokens": takeover["recomputed_tokens"],
                    "total_tokens": sum(len(s.token_ids) for s in baseline),
                }
            )
            if args.fault == "freeze":
                rows[-1].update(breakdown(log_path, frozen_at[0], leader["epoch"]))
                rows[-1]["first_token_s"] = first_token_after(
                    streams, frozen_at[1], rows[-1]["elected_s"]
                )
    except (TimeoutError, RuntimeError, AssertionError, StopIteration) as exc:
        print(f"stopped after {len(rows)} runs: {exc!r} (log: {log_path})", file=sys.stderr)
    finally:
        interrupt(popen, 60)
    header = list(rows[0]) if rows else []
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(row[k]) for k in header))
    if rows:
        stalls = [r["stall_max_s"] for r in rows]
        print(
            f"\nover {len(rows)} runs: max stall p50 {statistics.median(stalls):.3f} s, "
            f"max {max(stalls):.3f} s; lost {sum(r['lost'] for r in rows)}, duplicated "
            f"{sum(r['duplicated'] for r in rows)}, failed {sum(r['failed'] for r in rows)}; "
            f"adopted {sum(r['adopted'] for r in rows)}/{sum(r['resumed'] for r in rows)} "
            f"resumed; recomputed {sum(r['recomputed_tokens'] for r in rows)} tokens "
            f"of {sum(r['total_tokens'] for r in rows)}"
        )
        for phase in (*PHASES.values(), "first_token_s"):
            seen = [r[phase] for r in rows if r.get(phase) is not None]
            if seen:
                print(
                    f"{phase} after the freeze: p50 {statistics.median(seen):.3f} s, "
                    f"max {max(seen):.3f} s ({len(seen)} runs)"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
