"""What int8 (and bfloat16) weights cost in quality against float32, on the default model.

    .venv/bin/python bench/quality.py [--threads 2] [--json out.json]

(a) Perplexity of bench/data/essays.txt (about 3,000 tokens of plain English written for this
    project, public domain) in windows of --window tokens, each scored from its own start: the
    runner's own model (worker_svc.model over its op table: linears, norms, paged attention),
    each window one prefill step with the logits of every position.
(b) The share of the W64 prompts whose first --tokens greedy tokens are identical to float32's,
    through the runner driven by the scheduler core in this process (splitserve.inprocess): the
    served path, with its decode stack where the backend has one. Also the mean length of the
    prefix each prompt shares with float32.

Both parts run on one ModelRunner per variant (--kernels native by default).

Variants: float32; int8 (`--quantization int8`: every linear layer, lm_head included);
int8+f32-head, int8 with the lm_head left float32 (what quantizing the lm_head costs; tied
embeddings only, as SmolLM2's: the float32 weight is the embedding); bfloat16.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from common.model_source import resolve_model  # noqa: E402
from splitserve.inprocess import generate_in_process  # noqa: E402
from worker_svc import attention, cpu_caps, packed_gemm  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.model_loader import model_dir  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402
from worker_svc.ops import native_linear  # noqa: E402

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
    p.add_argument("--kernels", default="native", choices=("reference", "native"))
    p.add_argument("--max-text-tokens", type=int, default=None, help="score only this many")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def make_runner(variant: str, args: argparse.Namespace) -> ModelRunner:
    dtype, method, head_f32 = VARIANTS[variant]
    config = ModelRunnerConfig(
        dtype=dtype,
        quantization=method,
        kernels=args.kernels,
        num_threads=args.threads,
        max_num_batched_tokens=max(2048, args.window),
    )
    runner = ModelRunner(config)
    if head_f32:
        float32_lm_head(runner)
    return runner


def float32_lm_head(runner: ModelRunner) -> None:
    """Put the lm_head back on a float32 GEMM (the rest stays int8): the native packed GEMM
    over the embedding, which is the lm_head's weight in models with tied embeddings."""
    model = runner.model
    if not model.spec.tie_word_embeddings:
        raise SystemExit("the int8+f32-head variant assumes tied embeddings (SmolLM2's)")
    kind = "native-packed" if packed_gemm.load() is not None else "transposed"
    model.lm_head = native_linear.make_linear(kind, model.embed_tokens.float(), None)


def window_logits(runner: ModelRunner, ids: torch.Tensor) -> torch.Tensor:
    """The logits [T, vocab] of every position of `ids` [T], as one prefill step from empty."""
    n, bs = len(ids), runner.block_size
    blocks = -(-n // bs)
    if blocks > runner.num_blocks:
        raise SystemExit(f"a window of {n} tokens needs {blocks} KV blocks")
    meta = attention.build_metadata(
        key_caches=runner.kv_cache.key_caches,
        value_caches=runner.kv_cache.value_caches,
        block_size=bs,
        block_table=np.arange(blocks, dtype=np.int64)[None],
        num_computed=np.array([0]),
        num_scheduled=np.array([n]),
        num_decodes=0,
        decode_group_size=runner.config.decode_group_size,
        slot_mapping=torch.arange(n, device=runner.device),
        dtype=runner.dtype,
        device=runner.device,
        decode_kernel=runner.ops.attention_kernel,
        native_prefill=runner.ops.native_prefill,
    )
    positions = torch.arange(n, device=runner.device)
    return runner.model(ids.to(runner.device), positions, positions, meta)


def perplexity(runner: ModelRunner, ids: torch.Tensor, window: int) -> float:
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start : start + window]
            if len(chunk) < 2:
                break
            logits = window_logits(runner, chunk)[:-1].float().cpu()
            nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
            count += len(chunk) - 1
    return math.exp(nll / count)


def w64_greedy(runner: ModelRunner, prompts: list[list[int]], tokens: int) -> dict:
    runner.reset()
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
    if args.max_text_tokens:
        ids = ids[: args.max_text_tokens]
    prompts = json.loads(WORKLOAD.read_text())["prompts"][: args.prompts]
    print(
        f"CPU: {cpu_caps.capabilities().describe()}; {args.threads} threads; {source.name}; "
        f"--kernels {args.kernels}"
    )
    print(f"text: {TEXT.name}, {len(ids)} tokens, windows of {args.window}")
    results = {}
    for variant in variants:
        runner = make_runner(variant, args)
        ppl = perplexity(runner, ids, args.window)
        run = w64_greedy(runner, prompts, args.tokens)
        del runner
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
