"""What int8 (and bfloat16) weights cost in quality against float32, on the default model.

    .venv/bin/python bench/quality.py [--threads 2] [--json out.json]

(a) Perplexity of bench/data/essays.txt (about 3,000 tokens of plain English written for this
    project, public domain) in windows of --window tokens, each scored from its own start: the
    model with the runner's linear layers (fast_linear) and SDPA attention.
(b) The share of the W64 prompts whose first --tokens greedy tokens are identical to float32's,
    through the runner driven by the scheduler core in this process (splitserve.inprocess): the
    served path, with its attention, fused ops and decoder loop. Also the mean length of the
    prefix each prompt shares with float32.

Variants: float32; int8 (`--quantization int8`: every linear layer, lm_head included);
int8+f32-head, int8 with the lm_head left float32 (what quantizing the lm_head costs); bfloat16.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from common.model_source import resolve_model  # noqa: E402
from splitserve.inprocess import generate_in_process  # noqa: E402
from worker_svc import cpu_caps, packed_gemm  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.fast_linear import NativePackedLinear, optimize_linears  # noqa: E402
from worker_svc.model_loader import load_model, model_dir, resolve_dtype  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

TEXT = HERE / "data" / "essays.txt"
WORKLOAD = HERE / "workloads" / "w64.json"
# name -> (dtype, quantization, lm_head left float32)
VARIANTS = {
    "float32": ("float32", "none", False),
    "int8": ("float32", "int8", False),
    "int8+f32-head": ("float32", "int8", True),
    "bfloat16": ("bfloat16", "none", False),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--window", type=int, default=1024, help="tokens per perplexity window")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens compared per prompt")
    p.add_argument("--prompts", type=int, default=64, help="W64 prompts used")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of the above")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def plain_linear(weight: torch.Tensor) -> torch.nn.Linear:
    out_features, in_features = weight.shape
    linear = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    return linear


def float32_lm_head(model: torch.nn.Module, original: torch.nn.Linear) -> None:
    """Put the lm_head back on the float32 packed GEMM (the rest stays int8)."""
    gemm = packed_gemm.load()
    model.lm_head = NativePackedLinear(original, gemm) if gemm else original


def perplexity(variant: str, ids: torch.Tensor, window: int) -> float:
    dtype_name, method, head_f32 = VARIANTS[variant]
    source = resolve_model(None)
    dtype = resolve_dtype(dtype_name, torch.device("cpu"))
    model = load_model(source, dtype, torch.device("cpu"), "sdpa")
    head = plain_linear(model.lm_head.weight)
    optimize_linears(model, method)
    if head_f32:
        float32_lm_head(model, head)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start : start + window][None]
            if chunk.shape[1] < 2:
                break
            logits = model(chunk).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    return math.exp(nll / count)


def w64_greedy(variant: str, prompts: list[list[int]], tokens: int, threads: int) -> dict:
    dtype, method, head_f32 = VARIANTS[variant]
    config = ModelRunnerConfig(dtype=dtype, quantization=method, num_threads=threads)
    runner = ModelRunner(config)
    if head_f32:  # the runner's lm_head is int8 by now: SmolLM2's is tied to the embedding
        if not runner.model.config.get_text_config().tie_word_embeddings:
            raise SystemExit("the lm_head variant assumes tied embeddings (SmolLM2's)")
        float32_lm_head(runner.model, plain_linear(runner.model.get_input_embeddings().weight))
    start = time.perf_counter()
    outputs = generate_in_process(prompts, max_tokens=tokens, runner=runner)
    return {"outputs": outputs, "time_s": time.perf_counter() - start, "kernels": runner.kernels}


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    variants = [v for v in args.variants.split(",") if v]
    source = resolve_model(None)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir(source))
    ids = torch.tensor(tokenizer(TEXT.read_text())["input_ids"])
    prompts = json.loads(WORKLOAD.read_text())["prompts"][: args.prompts]
    print(f"CPU: {cpu_caps.capabilities().describe()}; {args.threads} threads; {source.name}")
    print(f"text: {TEXT.name}, {len(ids)} tokens, windows of {args.window}")
    results = {}
    for variant in variants:
        ppl = perplexity(variant, ids, args.window)
        run = w64_greedy(variant, prompts, args.tokens, args.threads)
        results[variant] = {"perplexity": ppl, **run}
        print(f"{variant}: perplexity {ppl:.4f}, W64 in {run['time_s']:.1f} s", flush=True)
    reference = results.get("float32")
    print()
    n = args.tokens
    print(f"| variant | perplexity | Δ vs float32 | W64 first {n} identical | mean shared prefix |")
    print("| --- | --- | --- | --- | --- |")
    for variant, r in results.items():
        if reference is None:
            same, mean_prefix, delta = float("nan"), float("nan"), float("nan")
        else:
            pairs = list(zip(r["outputs"], reference["outputs"], strict=True))
            same = sum(a == b for a, b in pairs) / len(pairs)
            mean_prefix = sum(shared_prefix(a, b) for a, b in pairs) / len(pairs)
            delta = r["perplexity"] / reference["perplexity"] - 1
        r.update(identical_share=same, mean_shared_prefix=mean_prefix, perplexity_change=delta)
        print(
            f"| {variant} | {r['perplexity']:.3f} | {delta:+.2%} | {same:.1%} "
            f"({round(same * len(prompts))} / {len(prompts)}) | {mean_prefix:.1f} |"
        )
    if args.json:
        meta = {"cpu": cpu_caps.capabilities().describe(), "text_tokens": len(ids), **vars(args)}
        meta["json"] = str(args.json)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
