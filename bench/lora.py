"""Multi-LoRA against the base model on W64, one server, one run:

    .venv/bin/python bench/lora.py --json lora.json --plot lora.png

`splitserve scheduler` + one `splitserve worker` (SmolLM2-135M) with --max-loras 16 and 16
random PEFT adapters (rank --rank on all seven projections, non-zero B) read at start. W64 (64
prompts, 64 output tokens, EOS ignored, greedy, all at once) is sent as it is, then with every
request naming one of 1, 4 and 16 adapters (request i gets adapter i mod k), then as it is
again: the base model's figure is the mean of the first and last runs, so a drift of the
machine over the run shows as their difference. Out tok/s, TTFT p50/p99 and the ratio to the
base model; a table, JSON and a bar plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from peers_lib.servers import Process, free_port, wait_until  # noqa: E402
from peers_lib.workload import w64  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from tqdm import tqdm  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base_dir: Path, out: Path, count: int, rank: int) -> dict[str, Path]:
    """`count` PEFT adapters of `base_dir` with random A and B (seeded)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = {}
    for i in tqdm(range(count), desc="adapters", leave=False):
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES)
        model = get_peft_model(base, config)
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        path = out / f"a{i}"
        model.save_pretrained(path)
        adapters[f"a{i}"] = path
    return adapters


async def drive(target: str, prompts: list[list[int]], models: list[str], max_tokens: int):
    import grpc

    from common.client import build_request
    from common.pb import generation_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        t0 = time.perf_counter()
        bar = tqdm(total=len(prompts) * max_tokens, desc=models[0] or "base", leave=False)

        async def one(prompt: list[int], model: str) -> tuple[float, int]:
            msg = build_request(
                token_ids=prompt,
                model=model,
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
            )
            first, n = None, 0
            async for out in stub.Generate(msg, timeout=3600):
                if out.error:
                    raise RuntimeError(out.error)
                if out.token_ids:
                    first = first or time.perf_counter() - t0
                    n += len(out.token_ids)
                    bar.update(len(out.token_ids))
            return first, n

        results = await asyncio.gather(*(one(p, m) for p, m in zip(prompts, models, strict=True)))
        duration = time.perf_counter() - t0
        bar.close()
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {
        "out_tok_s": tokens / duration,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "tokens": tokens,
        "duration_s": duration,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--counts", default="1,4,16", help="numbers of adapters to spread")
    parser.add_argument("--kernels", default="native")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]

    from common.model_source import default_model_path, resolve_model
    from worker_svc.model_loader import model_dir

    base_dir = model_dir(resolve_model(str(default_model_path())))
    wl = w64()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        adapters = make_adapters(base_dir, tmp_path, max(counts), args.rank)
        modules = ",".join(f"{n}={p}" for n, p in adapters.items())
        port, wport = free_port(), free_port()
        cli = [sys.executable, "-m", "splitserve.cli"]
        sched = Process(
            "scheduler",
            cli
            + ["scheduler", "--host", "127.0.0.1", "--port", str(port)]
            + ["--worker-port", str(wport), "--http-port", "0", "--max-num-seqs", "64"]
            + ["--max-num-batched-tokens", "2048", "--no-enable-prefix-caching"]
            + ["--log-level", "WARNING"],
            tmp_path,
        )
        worker = Process(
            "worker",
            cli
            + ["worker", "--scheduler", f"127.0.0.1:{wport}", "--worker-id", "lora-w0"]
            + ["--num-threads", str(args.threads), "--dtype", args.dtype]
            + ["--kernels", args.kernels, "--max-loras", str(max(counts))]
            + ["--max-lora-rank", str(max(16, args.rank)), "--lora-modules", modules]
            + ["--log-level", "WARNING"],
            tmp_path,
        )
        try:
            import grpc

            from common.pb import generation_pb2 as pb
            from common.pb import generation_pb2_grpc

            def attached() -> bool:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    stub = generation_pb2_grpc.GenerationStub(ch)
                    info = stub.GetServerInfo(pb.ServerInfoRequest(), timeout=5)
                    return bool(info.workers) and len(info.loras) == len(adapters)

            wait_until(attached, worker, 900, "the worker attached with its adapters")
            target = f"127.0.0.1:{port}"
            names = list(adapters)
            plan = [("base", 0), *((f"{k} adapters", k) for k in counts), ("base again", 0)]
            runs = {}
            asyncio.run(drive(target, [wl.prompts[0][:32]], [""], 4))  # warm-up
            for label, k in plan:
                models = [names[i % k] if k else "" for i in range(wl.num_requests)]
                runs[label] = asyncio.run(drive(target, wl.prompts, models, wl.max_tokens))
        finally:
            worker.stop()
            sched.stop()
    base = (runs["base"]["out_tok_s"] + runs["base again"]["out_tok_s"]) / 2
    table = Table(
        title=f"W64 with LoRA adapters (rank {args.rank}, {args.dtype}, {args.threads} threads)"
    )
    for col in ("run", "out tok/s", "× base", "TTFT p50 (s)", "TTFT p99 (s)"):
        table.add_column(col, justify="right")
    for label, r in runs.items():
        table.add_row(
            label,
            f"{r['out_tok_s']:.1f}",
            f"{r['out_tok_s'] / base:.2f}",
            f"{r['ttft_p50_s']:.2f}",
            f"{r['ttft_p99_s']:.2f}",
        )
    console.print(table)
    result = {
        "rank": args.rank,
        "dtype": args.dtype,
        "threads": args.threads,
        "kernels": args.kernels,
        "base_out_tok_s": base,
        "runs": runs,
        "cpu": os.uname().machine,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        labels = list(runs)
        ax.bar(labels, [runs[k]["out_tok_s"] for k in labels], color="#4c72b0")
        ax.axhline(0.8 * base, color="#c44e52", linestyle="--", label="0.8 × base")
        ax.set_ylabel("out tok/s")
        ax.set_title("W64, SmolLM2-135M: adapters spread over the requests")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
