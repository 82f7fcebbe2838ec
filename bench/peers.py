"""splitserve beside its peers: the same requests through each system, one command, one run.

    bash bench/llama_cpp_build.sh                         # once: builds llama-server (minutes)
    .venv/bin/python bench/peers.py --quick               # reduced run, every system
    .venv/bin/python bench/peers.py --json peers.json --plot peers.png
    .venv/bin/python bench/peers.py --workload w64 --systems splitserve-grpc,llama-server

Systems (--systems, in this order by default):
  splitserve-grpc    `splitserve scheduler` + one `splitserve worker` process, gRPC streaming
  splitserve-inproc  the scheduler core + ModelRunner in this process (splitserve.inprocess)
  llama-server       llama.cpp's server, -np 64 -cb, on the same SmolLM2 GGUF (Q4_1 weights)
  generate-batch     transformers' own continuous batching (the engine of generate_batch)
  hf-static          HF generate on left-padded static batches (--static-batch)
  hf                 HF generate one request at a time; run on --hf-requests of them and the
                     queue over all of them replayed from those service times (labelled [est.])

Workloads: `synthetic` (default): --num-requests prompts of 20-1000 tokens (lognormal, seeded
token ids from the SmolLM2 vocabulary), --max-tokens 128 output tokens, EOS ignored, arriving
all at once (burst) and as a Poisson process (--request-rate); `w64`: the 64 chat prompts of
bench/workloads/w64.json (a copy of shared/workloads/w64.json), 64 output tokens, all at once.

Every system gets the same token ids, greedy decoding, exactly max_tokens output tokens, no
prefix/prompt caching, and --threads CPU threads. Reported per system and arrival mode: output
tokens/s (output tokens ÷ time from the first arrival to the last token), TTFT and TPOT p50/p99,
and each as a ratio to splitserve (--reference).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from peers_lib import report, workload  # noqa: E402
from rich.console import Console  # noqa: E402

SYSTEMS = (
    "splitserve-grpc",
    "splitserve-inproc",
    "llama-server",
    "generate-batch",
    "hf-static",
    "hf",
)
W64_TARGET = {
    "label": "target: llama-server -np 64 (recorded)",
    "output_tok_s": 127.7,
    "ttft_p50_ms": 12900.0,
    "ttft_p99_ms": 20400.0,
}
console = Console(stderr=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of the systems above")
    p.add_argument("--workload", choices=("synthetic", "w64"), default="synthetic")
    p.add_argument(
        "--quick",
        action="store_true",
        help="reduced run: 32 requests x 32 tokens, HF one-by-one on 3",
    )
    p.add_argument("--num-requests", type=int, default=None, help="default 128 (w64: 64)")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens (default 128)")
    p.add_argument("--input-mean", type=int, default=200, help="mean prompt length (lognormal)")
    p.add_argument("--input-sigma", type=float, default=1.0, help="lognormal shape")
    p.add_argument("--min-input", type=int, default=20)
    p.add_argument("--max-input", type=int, default=1000)
    p.add_argument(
        "--arrivals", default=None, help="comma list of burst, poisson (default both; w64: burst)"
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals, requests/s (default 1.0; --quick 2.0)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 2,
        help="CPU threads of every system (torch, worker, llama -t/-tb)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="splitserve's step token budget (the scheduler default); also "
        "transformers' max_batch_tokens",
    )
    p.add_argument("--max-num-seqs", type=int, default=128, help="splitserve's running cap")
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="splitserve's KV cache")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="splitserve's weights and KV cache (HF baselines: float32)",
    )
    p.add_argument(
        "--quantization",
        choices=("none", "int8"),
        default="none",
        help="splitserve's weights (the worker's --quantization; int8: per output channel)",
    )
    p.add_argument("--llama-server", default=None, help="binary (default: the build script's)")
    p.add_argument("--llama-slots", type=int, default=64, help="llama-server -np")
    p.add_argument("--llama-args", default="", help="more llama-server flags, one string")
    p.add_argument("--gguf", default=None, help="GGUF for llama-server (default: SmolLM2's)")
    p.add_argument("--static-batch", type=int, default=16, help="HF static batch size")
    p.add_argument(
        "--hf-requests",
        type=int,
        default=None,
        help="requests HF one-by-one really runs (default 8; --quick 3)",
    )
    p.add_argument(
        "--reference",
        default=None,
        help="system the ratios divide by (default splitserve-grpc, else splitserve-inproc)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="bar charts (matplotlib)")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temp folder)")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    for s in args.systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; one of {', '.join(SYSTEMS)}")
    q = args.quick
    if args.workload == "w64":
        args.num_requests = args.num_requests or (32 if q else 64)
        args.arrivals = args.arrivals or "burst"
    else:
        args.num_requests = args.num_requests or (32 if q else 128)
        args.max_tokens = args.max_tokens or (32 if q else 128)
        args.arrivals = args.arrivals or "burst,poisson"
    args.arrivals = [a for a in args.arrivals.split(",") if a]
    for a in args.arrivals:
        if a not in ("burst", "poisson"):
            p.error(f"unknown arrival mode {a!r}")
    args.request_rate = args.request_rate or (2.0 if q else 1.0)
    args.hf_requests = args.hf_requests or (3 if q else 8)
    if args.reference is None:
        ref = [s for s in ("splitserve-grpc", "splitserve-inproc") if s in args.systems]
        args.reference = ref[0] if ref else args.systems[0]
    return args


def build_workload(args) -> workload.Workload:
    if args.workload == "w64":
        wl = workload.w64(n=args.num_requests)
        if args.max_tokens:
            wl.max_tokens = args.max_tokens
        return wl
    return workload.synthetic(
        args.num_requests,
        args.max_tokens,
        args.input_mean,
        args.input_sigma,
        args.min_input,
        args.max_input,
        args.seed,
    )


def run_system(system: str, args, wl, runs, log_dir: Path) -> tuple[dict, dict]:
    """{mode: (results, duration)}, extra info."""
    from peers_lib import servers

    if system == "splitserve-grpc":
        return servers.run_splitserve_grpc(args, wl, runs, log_dir), {}
    if system == "llama-server":
        binary = servers.find_llama_server(args.llama_server)
        if binary is None:
            raise FileNotFoundError("no llama-server: run `bash bench/llama_cpp_build.sh` first")
        return servers.run_llama_server(args, wl, runs, log_dir, binary), {"binary": str(binary)}
    from peers_lib import inproc

    if system == "splitserve-inproc":
        return inproc.run_splitserve_inproc(args, wl, runs)
    if system == "hf":
        return inproc.run_hf_one_by_one(args, wl, runs)
    if system == "hf-static":
        return inproc.run_hf_static(args, wl, runs), {}
    return inproc.run_generate_batch(args, wl, runs), {}


def notes(args, wl, info: dict) -> list[str]:
    out = [
        "llama.cpp runs the 4-bit Q4_1 GGUF weights (quantized matmuls, f16 KV cache); splitserve "
        f"runs the same weights dequantized to {args.dtype}"
        + (", then quantized to int8 per output channel" if args.quantization == "int8" else "")
        + f" ({args.dtype} KV cache), the "
        "transformers/HF baselines float32. Same model, not the same arithmetic: this is not a "
        "like-for-like kernel race.",
        f"{args.threads} CPU threads per system on a {os.cpu_count()}-core machine "
        f"(load average at start {info['loadavg']}; per system in the JSON); on a shared machine "
        "the numbers are noisy and depend on what else runs (and on the order of the systems).",
        "Greedy decoding, EOS ignored, exactly max_tokens per request; no prefix/prompt caching "
        "(splitserve --no-enable-prefix-caching, llama-server cache_prompt false and "
        "--cache-ram 0).",
        "out tok/s = output tokens ÷ (first arrival → last token); under Poisson arrivals it is "
        "bounded by the arrival rate. TPOT = (last token − first token) ÷ (tokens − 1).",
        "splitserve-grpc: the benchmark client, the scheduler and the worker share the same cores.",
    ]
    cpus = os.cpu_count() or 1
    if args.threads > 1 and os.getloadavg()[0] + args.threads > cpus + 0.5:
        out.append(
            f"Oversubscribed ({args.threads} threads each, {cpus} cores, other load): spin-waiting "
            "thread pools collapse, llama.cpp's most (seen here: its single-request decode took "
            "1-2.5 s/token at -t 2 against 48 ms at -t 1). Compare with --threads 1 too."
        )
    if "poisson" in args.arrivals:
        out.append(f"Poisson arrivals at {args.request_rate} requests/s (seed {args.seed}).")
    hf = info.get("hf")
    if hf and hf.get("estimated"):
        out.append(
            f"[est.] HF one-by-one ran {hf['measured_requests']} of {wl.num_requests} requests "
            f"back to back ({hf['measured_tok_s']:.1f} tok/s); its FCFS queue over all requests is "
            "replayed from their service times (fitted linearly in prompt length for the rest)."
        )
    return out


def greedy_check(ours: dict, hf: dict) -> dict:
    """bench/worker_forward.check_greedy on the requests HF one-by-one really ran (up to where
    splitserve, EOS ignored, emitted EOS: HF, forced past it by min_new_tokens, masks it)."""
    from worker_forward import check_greedy

    idx = sorted(hf["outputs"])
    ours_out = [ours["outputs"][i] for i in idx]
    return check_greedy(ours_out, [hf["outputs"][i] for i in idx], hf.get("eos"))


def main(argv=None) -> int:
    args = parse_args(argv)
    wl = build_workload(args)
    from peers_lib.servers import log_dir_for

    log_dir = log_dir_for(args)
    console.print(f"[bold]{wl.describe()}[/]\n  {wl.note}\n  logs: {log_dir}")
    runs = []
    for mode in args.arrivals:
        rate = float("inf") if mode == "burst" else args.request_rate
        runs.append((mode, workload.arrival_offsets(wl.num_requests, rate, args.seed)))
    info: dict = {"loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    res: dict = {
        "workload": {
            "name": wl.name,
            "num_requests": wl.num_requests,
            "max_tokens": wl.max_tokens,
            "prompt_lens": wl.prompt_lens,
            "note": wl.note,
        },
        "config": {k: v for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "reference": args.reference,
        "runs": {mode: {} for mode, _ in runs},
        "system_info": {},
        "errors": {},
    }
    for system in args.systems:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        console.print(f"[bold cyan]▶ {report.label(system, args)}[/] (load average {load})")
        started = time.perf_counter()
        try:
            out, extra = run_system(system, args, wl, runs, log_dir)
        except Exception as exc:  # noqa: BLE001 - one system failing must not lose the others
            console.print(f"[red]{system} failed: {exc}[/]")
            res["errors"][system] = "".join(traceback.format_exception_only(exc)).strip()
            continue
        finally:
            gc.collect()
        info[system] = extra
        extra = {k: v for k, v in extra.items() if k not in ("outputs", "eos")}
        res["system_info"][system] = {
            **extra,
            "wall_s": time.perf_counter() - started,
            "loadavg_at_start": load,
        }
        for mode, (results, duration) in out.items():
            s = report.summarize(results, duration)
            s["estimated"] = bool(extra.get("estimated"))
            res["runs"][mode][system] = s
            console.print(
                f"  {mode}: {s['output_tok_s']:.1f} out tok/s, TTFT p50 "
                f"{s['ttft_ms']['p50'] / 1e3:.2f} s, {s['completed']}/{wl.num_requests} ok"
                + (f" errors: {s['errors']}" if s["errors"] else "")
            )
    res["notes"] = notes(args, wl, info)
    if "hf" in info and "splitserve-inproc" in info:
        res["greedy_check"] = greedy_check(info["splitserve-inproc"], info["hf"])
        res["notes"].append(
            "Greedy check (float32): splitserve-inproc's tokens equal HF generate's on "
            f"{res['greedy_check']['equal']} of the {res['greedy_check']['compared']} requests "
            "HF one-by-one ran."
        )
    if args.workload == "w64" and wl.num_requests == 64 and wl.max_tokens == 64:
        res["target"] = W64_TARGET
    report.print_tables(res, args)
    if res["errors"]:
        console.print(f"[red]failed systems: {res['errors']}[/]")
    if args.plot:
        report.write_plot(res, args, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
