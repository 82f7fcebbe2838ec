"""What structured output costs a real cluster, and what n > 1 saves.

One scheduler and one SmolLM2 worker (real processes, gRPC). Three parts, in one run:

1. 64 concurrent streams, unconstrained against JSON-schema-constrained, alternated for
   `--rounds` rounds: output tokens per second and TPOT p50/p99. Every stream produces exactly
   `--max-tokens` tokens either way: the unconstrained ones ignore EOS, and the schema asks for
   more items than fit, so the constrained ones end on `length` too (the batch stays full in
   both). Every constrained output is checked to be a prefix the schema allows.
2. Grammar compile times (llguidance, in this process) for the schemas the tests use.
3. n = 8 samples of one prompt against 8 separate requests of it: prompt tokens the worker
   computed (the scheduler's `scheduled_prefill_tokens`) and wall time.

    python bench/structured.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import structured  # noqa: E402
from common.client import SplitserveClient  # noqa: E402
from common.messages import StructuredOutput  # noqa: E402
from common.tokenizer import load_tokenizer  # noqa: E402
from tests.e2e.procs import Cluster, free_port  # noqa: E402

# more items than max_tokens can hold: a constrained stream ends on `length`, like an
# unconstrained one that ignores EOS
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "facts": {
            "type": "array",
            "items": {"type": "string", "maxLength": 40},
            "minItems": 60,
        },
    },
    "required": ["city", "facts"],
}
PROMPT = "List facts about a city as JSON with the keys city and facts:"
N_PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "The story should have a beginning, a middle and an end, and a twist."
)


def test_schemas() -> dict[str, dict]:
    """The schemas tests/e2e/test_http_openai.py checks outputs against."""
    from tests.e2e import test_http_openai as t

    return {name: value for name, value in vars(t).items() if _is_schema(value)} | {
        "bench_long": LONG_SCHEMA
    }


def _is_schema(value) -> bool:
    return isinstance(value, dict) and value.get("type") in ("object", "array")


def stream_one(client, kwargs, times: list[float], texts: list[str]) -> None:
    for msg in client.stream(PROMPT, **kwargs):
        if msg.token_ids:
            now = time.perf_counter()
            times.extend([now] * len(msg.token_ids))
            texts.append(msg.text)


def run_round(client, constrained: bool, args, bar) -> dict:
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    if constrained:
        kwargs["structured"] = {"kind": "json_schema", "spec": json.dumps(LONG_SCHEMA)}
    else:
        kwargs["ignore_eos"] = True
    times = [[] for _ in range(args.streams)]
    texts = [[] for _ in range(args.streams)]
    threads = [
        threading.Thread(
            target=stream_one,
            args=(client, dict(kwargs, seed=i), times[i], texts[i]),
        )
        for i in range(args.streams)
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    bar.update(1)
    tokens = sum(len(t) for t in times)
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    if constrained:
        check_prefixes(["".join(parts) for parts in texts])
    return {
        "mode": "json_schema" if constrained else "unconstrained",
        "out_tok_s": tokens / wall,
        "tokens": tokens,
        "tpot_p50_ms": 1000 * statistics.median(tpots),
        "tpot_p99_ms": 1000 * statistics.quantiles(tpots, n=100)[98],
        "wall_s": wall,
    }


def check_prefixes(outputs: list[str]) -> None:
    """Each truncated output is the start of a document the schema allows."""
    start = re.compile(r'\s*\{\s*("city"\s*:\s*"(Paris|London|Tokyo)"\s*,\s*)?"')
    for text in outputs:
        assert start.match(text), f"not a schema prefix: {text[:80]!r}"


def prefill_tokens(http: httpx.Client) -> float:
    body = http.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("splitserve:scheduled_prefill_tokens_total")
    )


def n_versus_separate(client, http, n: int, prompt_len: int) -> list[dict]:
    """Each mode on a prompt of its own (same length, different from the first token), so
    neither finds the other's blocks in the prefix cache."""
    kwargs = dict(max_tokens=32, temperature=1.0, ignore_eos=True)
    rows = []
    for mode, prompt in (("n", "First: " + N_PROMPT), ("separate", "Second: " + N_PROMPT)):
        before = prefill_tokens(http)
        start = time.perf_counter()
        if mode == "n":
            client.generate_choices(prompt, n=n, seed=100, **kwargs)
        else:
            threads = [
                threading.Thread(
                    target=client.generate, args=(prompt,), kwargs=dict(kwargs, seed=100 + i)
                )
                for i in range(n)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = time.perf_counter() - start
        time.sleep(1.0)  # the counters come with the worker's step replies
        rows.append(
            {
                "mode": f"n={n}" if mode == "n" else f"{n} requests",
                "prompt_tokens": prompt_len,
                "prompt_tokens_computed": prefill_tokens(http) - before,
                "wall_s": wall,
            }
        )
    return rows


def compile_times(tokenizer) -> list[dict]:
    """Grammar text plus matcher, as the worker builds one per constrained request."""
    from llguidance import LLMatcher

    ll_tok = structured.ll_tokenizer(tokenizer, tokenizer.eos_token_id)
    rows = []
    for name, schema in test_schemas().items():
        start = time.perf_counter()
        text = structured.grammar(StructuredOutput("json_schema", json.dumps(schema)))
        LLMatcher(ll_tok, text, log_level=0)
        rows.append({"schema": name, "compile_ms": 1000 * (time.perf_counter() - start)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    console = Console()

    compiles = compile_times(load_tokenizer(None))
    http_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp))
        try:
            cluster.start_scheduler(
                "--max-model-len",
                "1024",
                "--max-num-seqs",
                str(args.streams),
                "--max-num-batched-tokens",
                "2048",
                "--http-port",
                str(http_port),
            )
            cluster.start_worker("w0", "--num-gpu-blocks", "1024", "--num-threads", "2")
            with (
                SplitserveClient(cluster.target, timeout=600) as client,
                httpx.Client(base_url=f"http://127.0.0.1:{http_port}") as http,
            ):
                client.wait_for_workers(1, timeout=300)
                rounds = []
                with tqdm(total=2 * args.rounds + 2, desc="rounds", unit="round") as bar:
                    run_round(client, False, args, bar)  # warm-up: every batch shape once
                    run_round(client, True, args, bar)
                    for _ in range(args.rounds):
                        rounds.append(run_round(client, False, args, bar))
                        rounds.append(run_round(client, True, args, bar))
                prompt_len = len(load_tokenizer(None).encode("First: " + N_PROMPT))
                n_rows = n_versus_separate(client, http, args.n, prompt_len)
        except BaseException:
            print(cluster.logs())
            raise
        finally:
            cluster.stop_all()

    table = Table(
        title=f"{args.streams} concurrent streams x {args.max_tokens} tokens, T={args.temperature}"
    )
    for col in ("round", "mode", "out tok/s", "TPOT p50 (ms)", "TPOT p99 (ms)", "wall (s)"):
        table.add_column(col)
    for i, r in enumerate(rounds):
        table.add_row(
            str(i // 2),
            r["mode"],
            f"{r['out_tok_s']:.1f}",
            f"{r['tpot_p50_ms']:.0f}",
            f"{r['tpot_p99_ms']:.0f}",
            f"{r['wall_s']:.1f}",
        )
    console.print(table)
    mean = {
        mode: statistics.mean(r["out_tok_s"] for r in rounds if r["mode"] == mode)
        for mode in ("unconstrained", "json_schema")
    }
    ratio = mean["json_schema"] / mean["unconstrained"]
    console.print(f"constrained / unconstrained out tok/s over {args.rounds} rounds: {ratio:.3f}")
    table = Table(title="grammar compile (llguidance, cold)")
    table.add_column("schema")
    table.add_column("ms")
    for r in compiles:
        table.add_row(r["schema"], f"{r['compile_ms']:.2f}")
    console.print(table)
    table = Table(title=f"n={args.n} against {args.n} separate requests (32 tokens each)")
    for col in ("mode", "prompt tokens", "prompt tokens computed", "wall (s)"):
        table.add_column(col)
    for r in n_rows:
        table.add_row(
            r["mode"],
            str(r["prompt_tokens"]),
            f"{r['prompt_tokens_computed']:.0f}",
            f"{r['wall_s']:.2f}",
        )
    console.print(table)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"rounds": rounds, "ratio": ratio, "compile": compiles, "n": n_rows}, indent=2
            )
        )


if __name__ == "__main__":
    main()
