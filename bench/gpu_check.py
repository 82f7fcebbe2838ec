"""The CUDA check: run it on a machine with an NVIDIA GPU (nothing here needs one otherwise).

    .venv/bin/python bench/gpu_check.py                  # cuda:0, prints a table, writes JSON
    .venv/bin/python bench/gpu_check.py --device cpu --prompts 2 --skip-throughput   # dry run

It runs bench/worker_forward.py on the device three times, each in its own process:
1. float32: W64 prompts through the runner and Hugging Face `generate` one by one; the greedy
   tokens must be equal (up to the runner's first EOS);
2. bfloat16 (the CUDA default): the runner's greedy tokens' log-probabilities against an HF
   bfloat16 forward over the same text; the mean |difference| must stay under --max-logprob-diff;
3. bfloat16 throughput: the whole W64 workload (the runner with its CUDA graphs for pure-decode
   steps), pure-decode batches and prefill chunks, beside HF `generate` in static batches of 16
   and transformers' continuous batching (`generate_batch`) on the same GPU;
4. the same W64 workload with --no-cuda-graphs, which shows what the graphs are worth;
5. LoRA (bench/lora_device_check.py): three PEFT adapters and the base model mixed in one
   batch on the device, greedy tokens equal to HF + PEFT's.
Exit status 0 only when the three checks pass. Results: --json (default gpu_check.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent


def run(label: str, extra: list[str], args, console: Console) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [
            sys.executable,
            str(HERE / "worker_forward.py"),
            "--device",
            args.device,
            "--threads",
            str(args.threads),
            "--json",
            str(out),
            *extra,
        ]
        console.print(f"[bold]{label}[/]: {' '.join(cmd[1:])}")
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--threads", type=int, default=4, help="CPU threads (HF, sampling glue)")
    p.add_argument("--prompts", type=int, default=16, help="W64 prompts for the equality check")
    p.add_argument("--max-logprob-diff", type=float, default=0.05)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--json", type=Path, default=Path("gpu_check.json"))
    args = p.parse_args()
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device here: run this on a GPU machine (or --device cpu)")
            return 2
    console = Console(stderr=True)
    n = ["--prompts", str(args.prompts), "--hf-prompts", str(args.prompts)]
    fp32 = run(
        "float32 greedy vs HF", ["--dtype", "float32", "--only", "w64,hf,check", *n], args, console
    )
    bf16 = run(
        "bfloat16 logprobs vs HF", ["--dtype", "bfloat16", "--only", "w64,check", *n], args, console
    )
    results = {"device": args.device, "float32": fp32, "bfloat16_check": bf16}
    if not args.skip_throughput:
        results["bfloat16_throughput"] = run(
            "bfloat16 throughput",
            [
                "--dtype",
                "bfloat16",
                "--only",
                "w64,decode,prefill,hf_static,generate_batch",
                "--decode-batches",
                "1,8,64,128,256",
                "--decode-contexts",
                "128,1024",
            ],
            args,
            console,
        )
        results["bfloat16_eager"] = run(
            "bfloat16 throughput, no CUDA graphs",
            ["--dtype", "bfloat16", "--only", "w64", "--no-cuda-graphs"],
            args,
            console,
        )
    lora = subprocess.run(
        [sys.executable, str(HERE / "lora_device_check.py"), "--device", args.device],
        capture_output=True,
        text=True,
    )
    console.print(lora.stdout[-2000:], lora.stderr[-2000:])
    lora_ok = lora.returncode == 0
    results["lora_check"] = {"passed": lora_ok}
    eq = fp32["check"]
    greedy_ok = eq["equal"] == eq["compared"] > 0
    diff = bf16["check"]["mean_abs_logprob_diff"]
    bf16_ok = diff <= args.max_logprob_diff
    table = Table(title=f"splitserve GPU check on {args.device}")
    for col in ("check", "result", "detail"):
        table.add_column(col)
    table.add_row(
        "float32 greedy == HF",
        "pass" if greedy_ok else "FAIL",
        f"{eq['equal']}/{eq['compared']} prompts equal",
    )
    worst = bf16["check"]["max_abs_logprob_diff"]
    table.add_row(
        "bfloat16 logprobs ~ HF",
        "pass" if bf16_ok else "FAIL",
        f"mean |Δ| {diff:.4f}, max {worst:.3f}",
    )
    table.add_row("LoRA mixed batch == HF + PEFT", "pass" if lora_ok else "FAIL", "float32")
    table.add_row(
        "float32 W64 subset",
        f"{fp32['w64']['tok_s']:.1f} tok/s",
        f"HF one-by-one {fp32['hf']['tok_s']:.1f} tok/s",
    )
    if "bfloat16_throughput" in results:
        t = results["bfloat16_throughput"]
        table.add_row(
            "bfloat16 W64",
            f"{t['w64']['tok_s']:.1f} tok/s",
            f"HF static x16 {t['hf_static']['tok_s']:.1f} tok/s, transformers continuous "
            f"batching {t['generate_batch']['tok_s']:.1f} tok/s",
        )
        eager = results["bfloat16_eager"]["w64"]["tok_s"]
        table.add_row("bfloat16 W64, no CUDA graphs", f"{eager:.1f} tok/s", "")
        for d in t.get("decode", []):
            table.add_row(
                f"decode batch {d['batch']} @ ctx {d['context']}",
                f"{d['tok_s']:.1f} tok/s",
                f"{d['step_ms']:.1f} ms/step",
            )
    Console().print(table)
    results["passed"] = greedy_ok and bf16_ok and lora_ok
    args.json.write_text(json.dumps(results, indent=2))
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
