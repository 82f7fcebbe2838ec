"""Benchmark the worker's ModelRunner beside Hugging Face on the same model, in one process.

    .venv/bin/python bench/worker_forward.py                 # everything (HF one-by-one: minutes)
    .venv/bin/python bench/worker_forward.py --quick         # reduced run
    .venv/bin/python bench/worker_forward.py --only w64,decode --dtype bfloat16 --json out.json
    .venv/bin/python bench/worker_forward.py --only ops --kernels both   # per-op GEMM ceiling

Sections (--only / --skip): w64 (the W64 workload through the runner, driven by the scheduler
core), decode (pure-decode steps, batch x context), gemm (the linears' GFLOP/s in decode steps
against the machine's GEMM ceiling), ops (per op family within a decode step and a prefill
step: time share, GFLOP/s, share of the GEMM ceiling; the layer loop, the decode stack or CUDA
graphs off), prefill (one chunk of N tokens), hf (HF
`generate` one request at a time), hf_static (static padded batches of 16), generate_batch
(transformers' continuous batching), check (greedy equality with HF in float32; logprob
closeness in bfloat16). W64: 64 chat prompts as token ids, 64 output tokens each, EOS ignored.
--kernels reference,native (or both) runs the runner's sections once per backend.
On a busy shared machine run it with OMP_WAIT_POLICY=PASSIVE (see omp_policy()).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemm_rate import linear_rate_in_decode, peak_gemm_rate  # noqa: E402

from common.messages import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from scheduler_svc.core import Request, SamplingParams, Scheduler, SchedulerConfig  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.model import llama  # noqa: E402
from worker_svc.model_loader import model_dir  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

SECTIONS = ("w64", "decode", "gemm", "ops", "prefill", "hf", "hf_static", "generate_batch", "check")
WORKLOAD = Path(__file__).resolve().parent / "workloads" / "w64.json"  # copy of shared/workloads
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
console = Console(stderr=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model (default SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quantization", default="none", choices=("none", "int8"), help="weights")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (the runner and HF)")
    p.add_argument("--workload", type=Path, default=WORKLOAD)
    p.add_argument("--quick", action="store_true", help="fewer prompts, batches and contexts")
    p.add_argument("--only", default="", help=f"comma list of {','.join(SECTIONS)}")
    p.add_argument("--skip", default="", help="comma list of sections to skip")
    p.add_argument("--prompts", type=int, default=None, help="W64 prompts to use (default 64)")
    p.add_argument("--hf-prompts", type=int, default=None, help="prompts for HF one-by-one")
    p.add_argument("--decode-batches", default=None, help="default 1,8,32,64,128")
    p.add_argument("--decode-contexts", default=None, help="default 128,1024")
    p.add_argument("--prefill-chunks", default=None, help="default 128,512,2048")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--gemm-batch", type=int, default=64, help="decode rows for gemm and ops")
    p.add_argument("--ops-context", type=int, default=128, help="decode context for ops")
    p.add_argument("--ops-prefill", type=int, default=512, help="prefill chunk for ops")
    p.add_argument("--ops-steps", type=int, default=None, help="steps timed per ops row")
    p.add_argument("--peak-seconds", type=float, default=None, help="per GEMM ceiling shape")
    p.add_argument("--w64-repeats", type=int, default=1, help="W64 runs; the median is kept")
    p.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: no decode graphs")
    p.add_argument(
        "--kernels",
        default="native",
        help="the runner's kernels: native (this CPU level's), reference (torch's own ops), "
        "or a comma list / both: every runner section once per backend",
    )
    p.add_argument(
        "--no-keep-freed-memory", action="store_true", help="glibc malloc's default thresholds"
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args()
    only = {s for s in args.only.split(",") if s}
    args.sections = [s for s in SECTIONS if (not only or s in only) and s not in args.skip]
    q = args.quick
    args.prompts = args.prompts or (32 if q else 64)
    args.hf_prompts = args.hf_prompts or (4 if q else args.prompts)
    args.decode_batches = _ints(args.decode_batches or ("1,8,64" if q else "1,8,32,64,128"))
    args.decode_contexts = _ints(args.decode_contexts or "128,1024")
    args.prefill_chunks = _ints(args.prefill_chunks or ("128,512" if q else "128,512,2048"))
    args.ops_steps = args.ops_steps or (3 if q else 8)
    args.peak_seconds = args.peak_seconds or (0.2 if q else 0.5)
    kernels = "reference,native" if args.kernels == "both" else args.kernels
    args.kernels = [k for k in kernels.split(",") if k]
    if not args.kernels or not set(args.kernels) <= {"reference", "native"}:
        p.error("--kernels: reference, native, both or a comma list of them")
    return args


def omp_policy() -> str:
    """OpenMP idle threads spin by default (fastest on an idle machine: no op waits for a
    sleeping thread to wake); on a busy shared machine OMP_WAIT_POLICY=PASSIVE avoids
    pathological slowdowns (a thread spinning while its partner is descheduled) at that cost."""
    return os.environ.get("OMP_WAIT_POLICY", "unset (spin, then sleep)")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


# --- the runner ----------------------------------------------------------------------------


def run_w64(runner: ModelRunner, prompts: list[list[int]], max_tokens: int, budget: int) -> dict:
    runner.reset()
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=256,
            block_size=runner.block_size,
            num_blocks=runner.num_blocks,
            max_model_len=runner.max_model_len,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"w{i}", p, params, eos_token_id=runner.eos_token_id))
    outputs: dict[str, list[int]] = {f"w{i}": [] for i in range(len(prompts))}
    steps, fwd, smp = 0, 0.0, 0.0
    bar = tqdm(total=len(prompts) * max_tokens, desc="runner W64", unit="tok", leave=False)
    start = time.perf_counter()
    while sched.has_unfinished_requests():
        so = sched.schedule()
        res = runner.execute_model(so)
        for out in sched.update_from_output(so, res.sampled_token_ids):
            outputs[out.request_id] += out.new_token_ids
            bar.update(len(out.new_token_ids))
        steps, fwd, smp = steps + 1, fwd + res.forward_time_s, smp + res.sample_time_s
    elapsed = time.perf_counter() - start
    bar.close()
    total = sum(len(v) for v in outputs.values())
    return {
        "tok_s": total / elapsed,
        "time_s": elapsed,
        "tokens": total,
        "steps": steps,
        "forward_s": fwd,
        "sample_s": smp,
        "outputs": [outputs[f"w{i}"] for i in range(len(prompts))],
    }


def bench_decode(runner: ModelRunner, batch: int, ctx: int, steps: int) -> dict:
    """Decode steps of `batch` requests at context `ctx` (the context counts as prefix-cached)."""
    step = decode_stepper(runner, batch, ctx)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times[1:])
    return {"batch": batch, "context": ctx, "step_ms": step_s * 1e3, "tok_s": batch / step_s}


MAX_DECODE_STEPS = 64  # blocks each decode_stepper request holds room for


def decode_stepper(runner: ModelRunner, batch: int, ctx: int, max_steps: int = MAX_DECODE_STEPS):
    """A callable running one more pure-decode step of `batch` requests each time (up to
    `max_steps`), after placing them with `ctx` tokens of context."""
    runner.reset()
    bs = runner.block_size
    per_req = -(-(ctx + max_steps + 2) // bs)
    reqs = [
        NewRequestData(
            f"d{i}",
            [(i * 31 + j) % 1000 + 10 for j in range(ctx)],
            GREEDY,
            list(range(i * per_req, (i + 1) * per_req)),
            ctx - 1,
        )
        for i in range(batch)
    ]
    so = SchedulerOutput(new_requests=reqs, num_scheduled_tokens={r.request_id: 1 for r in reqs})
    runner.execute_model(so)
    n = ctx

    def step() -> int:
        nonlocal n
        if n >= ctx + max_steps:
            raise RuntimeError(f"more than {max_steps} decode steps")
        so = SchedulerOutput(
            cached_requests=[CachedRequestData(r.request_id, [], n) for r in reqs],
            num_scheduled_tokens={r.request_id: 1 for r in reqs},
        )
        runner.execute_model(so)
        n += 1
        return n  # each row's context this step, the new token included

    return step


def bench_gemm(runner: ModelRunner, args, peak: dict) -> dict:
    """The machine's GEMM rate (`peak`) and the rate of the runner's linear layers in decode
    steps of --gemm-batch rows."""
    step = decode_stepper(runner, args.gemm_batch, 128)
    achieved = linear_rate_in_decode(step, runner.model, args.gemm_batch, steps=args.ops_steps)
    return {
        **achieved,
        "peak_gflops": peak["gflops"],
        "peak_shapes": peak["shapes"],
        "share_of_peak": achieved["gflops"] / peak["gflops"],
    }


# --- per op family: time, GFLOP/s, share of the GEMM ceiling ------------------------------

FAMILIES = ("linear", "lm_head", "attention", "norms/rotary/silu", "sampling", "other")


class OpClock:
    """Self time per op family over timed calls: a call's time less that of the timed calls
    inside it (the gated product's SiLU vs its GEMMs); FLOPs per family from the call's input."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
        self.time = dict.fromkeys(FAMILIES, 0.0)
        self.flops = dict.fromkeys(FAMILIES, 0)
        self._inner: list[float] = []
        self._patched: list[tuple[object, str, object, bool]] = []

    def wrap(self, fn, family: str, out_features: int = 0, leaf: str | None = None):
        """`fn` timed as `family`; with `leaf`, the family of its self time when no timed call
        ran inside it (the fused AMX gated product: all GEMM). out_features: a linear's, for
        its FLOPs 2 x rows x in x out from the first argument."""

        def timed(*args, **kwargs):
            self.sync()
            self._inner.append(0.0)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            spent = time.perf_counter() - start
            inner = self._inner.pop()
            self.time[leaf if leaf and not inner else family] += spent - inner
            if self._inner:
                self._inner[-1] += spent
            if out_features:
                self.flops["lm_head" if family == "lm_head" else "linear"] += (
                    2 * args[0].numel() * out_features
                )
            return out

        return timed

    def patch(self, obj, name: str, new) -> None:
        own = not hasattr(obj, "__dict__") or name in vars(obj)
        self._patched.append((obj, name, getattr(obj, name), own))
        setattr(obj, name, new)

    def restore(self) -> None:
        while self._patched:
            obj, name, old, own = self._patched.pop()
            setattr(obj, name, old) if own else delattr(obj, name)

    def instrument(self, runner: ModelRunner) -> None:
        """Time every op of the model's layer loop (the decode stack and CUDA graphs off)."""
        model, ops = runner.model, runner.ops
        self.patch(model, "decode_step", None)
        if getattr(runner, "decode_graphs", None) is not None:
            self.patch(runner, "decode_graphs", None)
        for layer in model.layers:
            for name in ("qkv", "o_proj", "down_proj"):
                linear = getattr(layer, name)
                out = sum(linear.sizes) if hasattr(linear, "sizes") else linear.out_features
                self.patch(layer, name, self.wrap(linear, "linear", out))
            gated = layer.gated
            for name in ("gate_up", "gate", "up"):  # GatedProduct, NativeGatedProduct
                if getattr(gated, name, None) is not None:
                    self.patch(gated, name, self.wrap(getattr(gated, name), "linear"))
            out = 2 * gated.intermediate
            self.patch(layer, "gated", self.wrap(gated, "norms/rotary/silu", out, leaf="linear"))
        self.patch(model, "lm_head", self.wrap(model.lm_head, "lm_head", model.spec.vocab_size))
        for name in ("rms_norm", "add_rms_norm_", "rotary", "rotary_tables"):
            self.patch(ops, name, self.wrap(getattr(ops, name), "norms/rotary/silu"))
        self.patch(llama, "paged_attention", self.wrap(llama.paged_attention, "attention"))
        self.patch(runner, "sampler", self.wrap(runner.sampler, "sampling"))


def attention_work(runner: ModelRunner, rows: int, q: int, cached: int) -> tuple[int, int]:
    """FLOPs (QK^T and PV over the keys each query sees, causal) and the least K/V bytes read
    (each row's once), over all layers, for `rows` requests of `q` new tokens after `cached`."""
    s = runner.model.spec
    elem = torch.tensor([], dtype=runner.dtype).element_size()
    flops = 4 * s.num_heads * s.head_dim * (q * cached + q * (q + 1) // 2)
    kv = 2 * s.num_kv_heads * s.head_dim * elem * (cached + q)
    return flops * rows * s.num_layers, kv * rows * s.num_layers


def op_breakdown(runner: ModelRunner, step, n: int, peak: float) -> dict:
    """Run `step` n times with every op timed; it returns its step's attention (FLOPs, bytes).
    Per family: ms per step, share of the step, GFLOP/s, % of the GEMM ceiling `peak`
    (linears), GB/s (attention, least K/V traffic)."""
    clock = OpClock(runner.device)
    clock.instrument(runner)
    wall, attn_flops, attn_bytes = 0.0, 0, 0
    try:
        for _ in range(n):
            t = time.perf_counter()
            flops, nbytes = step()
            wall += time.perf_counter() - t
            attn_flops, attn_bytes = attn_flops + flops, attn_bytes + nbytes
    finally:
        clock.restore()
    clock.time["other"] = max(0.0, wall - sum(clock.time.values()))
    clock.flops["attention"] = attn_flops
    families = {}
    for fam in FAMILIES:
        sec = clock.time[fam]
        row = {"ms": sec / n * 1e3, "share": sec / wall}
        if clock.flops[fam] and sec:
            row["gflops"] = clock.flops[fam] / sec / 1e9
            if fam in ("linear", "lm_head"):
                row["pct_of_ceiling"] = 100 * row["gflops"] / peak
        if fam == "attention" and sec:
            row["gbps"] = attn_bytes / sec / 1e9
        families[fam] = row
    return {"step_ms": wall / n * 1e3, "families": families}


def bench_ops(runner: ModelRunner, args, peak: dict) -> dict:
    """The op breakdown of a decode step (--gemm-batch rows at --ops-context) and of a prefill
    step (one --ops-prefill chunk), with the plain decode step's time where the runner has a
    faster path for it (the decode stack, CUDA graphs)."""
    batch, n = args.gemm_batch, args.ops_steps
    out: dict = {"ceiling_gflops": peak["gflops"], "forward_path": runner.forward_path}
    stepper = decode_stepper(runner, batch, args.ops_context, max_steps=2 * n + 2)
    stepper()  # warm
    if runner.forward_path != "model":
        times = []
        for _ in range(n):
            t = time.perf_counter()
            stepper()
            times.append(time.perf_counter() - t)
        out["decode_fast_path_step_ms"] = statistics.median(times) * 1e3

    def decode() -> tuple[int, int]:
        context = stepper()
        return attention_work(runner, batch, 1, context - 1)

    out["decode"] = {
        "batch": batch,
        "context": args.ops_context,
        **op_breakdown(runner, decode, n, peak["gflops"]),
    }
    chunk, k = args.ops_prefill, iter(range(n + 1))
    prefill_once(runner, chunk, next(k))  # warm

    def prefill() -> tuple[int, int]:
        prefill_once(runner, chunk, next(k))
        return attention_work(runner, 1, chunk, 0)

    out["prefill"] = {"chunk": chunk, **op_breakdown(runner, prefill, n, peak["gflops"])}
    return out


def prefill_once(runner: ModelRunner, chunk: int, k: int) -> None:
    """One prefill step of a fresh `chunk`-token prompt (token ids varied by k)."""
    runner.reset()
    prompt = [(k * 7 + j) % 1000 + 10 for j in range(chunk)]
    blocks = list(range(-(-chunk // runner.block_size)))
    so = SchedulerOutput(
        new_requests=[NewRequestData("p", prompt, GREEDY, blocks, 0)],
        num_scheduled_tokens={"p": chunk},
    )
    runner.execute_model(so)


def bench_prefill(runner: ModelRunner, chunk: int, repeats: int = 3) -> dict:
    times = []
    for k in range(repeats + 1):
        t = time.perf_counter()
        prefill_once(runner, chunk, k)
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times[1:])
    return {"chunk": chunk, "step_ms": step_s * 1e3, "tok_s": chunk / step_s}


# --- Hugging Face baselines ----------------------------------------------------------------


def hf_one_by_one(model, prompts: list[list[int]], max_tokens: int) -> dict:
    outputs, start = [], time.perf_counter()
    for p in tqdm(prompts, desc="HF one-by-one", leave=False):
        ids = torch.tensor([p], device=model.device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
        )
        outputs.append(out[0, len(p) :].tolist())
    elapsed = time.perf_counter() - start
    total = sum(len(o) for o in outputs)
    return {"tok_s": total / elapsed, "time_s": elapsed, "tokens": total, "outputs": outputs}


def hf_static(model, prompts: list[list[int]], max_tokens: int, pad_id: int, size=16) -> dict:
    total, start = 0, time.perf_counter()
    for i in tqdm(range(0, len(prompts), size), desc="HF static x16", leave=False):
        group = prompts[i : i + size]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        ids, mask = ids.to(model.device), mask.to(model.device)
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
        total += (out.shape[1] - width) * len(group)
    elapsed = time.perf_counter() - start
    return {"tok_s": total / elapsed, "time_s": elapsed, "tokens": total}


def hf_generate_batch(model, prompts: list[list[int]], max_tokens: int) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1)
    start = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - start
    total = sum(len(o.generated_tokens) for o in out.values())
    return {"tok_s": total / elapsed, "time_s": elapsed, "tokens": total}


def check_greedy(runner_out: list[list[int]], hf_out: list[list[int]], eos: int | None) -> dict:
    """Tokens equal up to where the runner (EOS ignored) emitted EOS: HF, forced past EOS by
    min_new_tokens, takes its second choice there."""
    equal = 0
    for ours, ref in zip(runner_out, hf_out, strict=False):
        stop = ours.index(eos) if eos in ours else len(ours)
        equal += ours[:stop] == ref[:stop]
    return {"equal": equal, "compared": min(len(runner_out), len(hf_out))}


def check_bf16_logprobs(runner: ModelRunner, hf, prompts, max_tokens: int) -> dict:
    """Runner (bfloat16) greedy tokens' logprobs vs an HF bfloat16 forward over the same text."""
    runner.reset()
    sched_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)
    diffs = []
    for i, p in enumerate(prompts):
        bs = runner.block_size
        blocks = list(range(-(-(len(p) + max_tokens) // bs)))
        so = SchedulerOutput(
            new_requests=[NewRequestData(f"c{i}", p, sched_params, blocks, 0)],
            num_scheduled_tokens={f"c{i}": len(p)},
        )
        got, lps = [], []
        for _ in range(max_tokens):
            res = runner.execute_model(so)
            got += res.sampled_token_ids[f"c{i}"]
            lps.append(res.logprobs[f"c{i}"][0].logprob)
            n = len(p) + len(got) - 1
            so = SchedulerOutput(
                cached_requests=[CachedRequestData(f"c{i}", [], n)],
                num_scheduled_tokens={f"c{i}": 1},
            )
        so = SchedulerOutput(finished_req_ids={f"c{i}"})
        runner.execute_model(so)
        with torch.no_grad():
            logits = hf(torch.tensor([p + got], device=hf.device)).logits[0].float().cpu()
        ref = torch.log_softmax(logits, -1)[len(p) - 1 : -1].gather(1, torch.tensor(got)[:, None])
        diffs += (torch.tensor(lps) - ref.squeeze(1)).abs().tolist()
    return {"mean_abs_logprob_diff": statistics.mean(diffs), "max_abs_logprob_diff": max(diffs)}


# --- main ----------------------------------------------------------------------------------


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    workload = json.loads(args.workload.read_text())
    prompts = workload["prompts"][: args.prompts]
    max_tokens = int(workload.get("max_tokens", 64))
    shared: dict = {}  # the HF model and its results, the GEMM ceiling: one for all backends
    runs = []
    for kernels in args.kernels:
        results = run_backend(args, kernels, prompts, max_tokens, shared)
        runs.append(results)
    hf = shared.pop("hf_model", None)
    if "generate_batch" in args.sections:  # last: it switches the HF model's attention
        batch = hf_generate_batch(hf, prompts, max_tokens)
        for results in runs:
            results["generate_batch"] = batch
    for results in runs:
        results["load_average_end"] = os.getloadavg()[0]
        report(results)
    if args.json:
        for results in runs:
            for key in ("w64", "hf"):
                if key in results:
                    results[key] = {k: v for k, v in results[key].items() if k != "outputs"}
        out = runs[0] if len(runs) == 1 else {"backends": runs}
        args.json.write_text(json.dumps(out, indent=2))
    return 0


def kv_blocks_needed(args, prompts: list[list[int]], max_tokens: int, bs: int) -> int:
    need = len(prompts) * -(-(max(map(len, prompts)) + max_tokens) // bs)
    grid = [(b, c) for b in args.decode_batches for c in args.decode_contexts]
    if "decode" not in args.sections:
        grid = []
    grid += [(args.gemm_batch, 128), (args.gemm_batch, args.ops_context)]
    need = max(need, *(b * -(-(c + MAX_DECODE_STEPS + 2) // bs) for b, c in grid))
    return max(need, max(args.prefill_chunks + [args.ops_prefill]) // bs + 1)


def run_backend(args, kernels: str, prompts, max_tokens: int, shared: dict) -> dict:
    """Every runner section with one backend; the HF sections run once (the first backend)."""
    bs = 16
    cfg = ModelRunnerConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kernels=kernels,
        device=args.device,
        block_size=bs,
        num_gpu_blocks=kv_blocks_needed(args, prompts, max_tokens, bs),
        max_num_batched_tokens=max(
            args.max_num_batched_tokens, *args.prefill_chunks, args.ops_prefill
        ),
        num_threads=args.threads,
        keep_freed_memory=not args.no_keep_freed_memory,
        cuda_graphs=not args.no_cuda_graphs,
    )
    runner = ModelRunner(cfg)
    console.print(
        f"[bold]{runner.model_name}[/] {runner.dtype} on {runner.device}, {args.threads} threads, "
        f"kernels {runner.kernels} (OMP_WAIT_POLICY={omp_policy()}), "
        f"{runner.num_blocks} KV blocks; load {runner.load_time_s:.1f} s; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    results: dict = {
        "model": runner.model_name,
        "device": str(runner.device),
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kernels": runner.kernels,
        "backend": kernels,
        "threads": args.threads,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "omp_wait_policy": omp_policy(),
        "native_attention": runner.decode_kernel is not None,
        "linears": runner.linear_kind,
        "forward_path": runner.forward_path,
        "load_average_start": os.getloadavg()[0],
    }
    sections = set(args.sections)
    if {"hf", "hf_static", "generate_batch", "check"} & sections and "hf_model" not in shared:
        from transformers import AutoModelForCausalLM

        dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        hf = AutoModelForCausalLM.from_pretrained(model_dir(runner.source), dtype=dtype)
        shared["hf_model"] = hf.to(runner.device).eval()
    hf = shared.get("hf_model")
    if {"gemm", "ops"} & sections and "peak" not in shared:
        shared["peak"] = peak_gemm_rate(runner.dtype, runner.device, args.peak_seconds)
    with torch.inference_mode():
        if "w64" in sections:  # the median of --w64-repeats runs (this VM is noisy)
            runs = [
                run_w64(runner, prompts, max_tokens, args.max_num_batched_tokens)
                for _ in range(args.w64_repeats)
            ]
            results["w64"] = sorted(runs, key=lambda x: x["tok_s"])[len(runs) // 2]
            results["w64"]["runs_tok_s"] = [x["tok_s"] for x in runs]
        if "decode" in sections:
            grid = [(b, c) for c in args.decode_contexts for b in args.decode_batches]
            results["decode"] = [
                bench_decode(runner, b, c, args.decode_steps)
                for b, c in tqdm(grid, desc="decode", leave=False)
            ]
        if "gemm" in sections and runner.device.type == "cpu":  # CPU profiler timings
            results["gemm"] = bench_gemm(runner, args, shared["peak"])
        if "ops" in sections:
            results["ops"] = bench_ops(runner, args, shared["peak"])
        if "prefill" in sections:
            results["prefill"] = [bench_prefill(runner, c) for c in args.prefill_chunks]
        for key in ("hf", "hf_static"):
            if key in sections and key not in shared:
                if key == "hf":
                    shared[key] = hf_one_by_one(hf, prompts[: args.hf_prompts], max_tokens)
                else:
                    shared[key] = hf_static(hf, prompts, max_tokens, runner.eos_token_id or 0)
            if key in shared:
                results[key] = shared[key]
        if "check" in sections and "w64" in results:
            if args.dtype == "float32" and "hf" in results:
                results["check"] = check_greedy(
                    results["w64"]["outputs"], results["hf"]["outputs"], runner.eos_token_id
                )
            elif args.dtype == "bfloat16":
                results["check"] = check_bf16_logprobs(runner, hf, prompts[:4], 16)
    return results


def report(r: dict) -> None:
    out = Console()
    title = f"worker forward: {r['model']} {r['dtype']}, {r['threads']} threads, {r['kernels']}"
    table = Table(title=title)
    for col in ("what", "tokens/s", "detail", "runner W64 ÷ this"):
        table.add_column(col, justify="right" if col != "what" else "left")
    w64 = r.get("w64", {}).get("tok_s")

    def ratio(v: float) -> str:
        return f"{w64 / v:.1f}×" if w64 else ""

    if "w64" in r:
        x = r["w64"]
        detail = f"{x['tokens']} tok in {x['time_s']:.1f} s, {x['steps']} steps"
        if len(x.get("runs_tok_s", [])) > 1:
            detail += "; median of " + ", ".join(f"{v:.1f}" for v in x["runs_tok_s"])
        table.add_row(f"runner W{r['prompts']}", f"{w64:.1f}", detail, "1.0×")
    names = {
        "hf": "HF generate one-by-one",
        "hf_static": "HF generate static x16",
        "generate_batch": "HF generate_batch (CB)",
    }
    for key, name in names.items():
        if key in r:
            x = r[key]
            detail = f"{x['tokens']} tok in {x['time_s']:.1f} s"
            table.add_row(name, f"{x['tok_s']:.1f}", detail, ratio(x["tok_s"]))
    for x in r.get("decode", []):
        detail = f"{x['step_ms']:.1f} ms/step"
        table.add_row(
            f"decode batch {x['batch']} @ ctx {x['context']}", f"{x['tok_s']:.1f}", detail, ""
        )
    if "gemm" in r:
        x = r["gemm"]
        table.add_row(
            f"linear layers, decode batch {x['rows']}",
            "",
            f"{x['gflops']:.0f} GFLOP/s = {100 * x['share_of_peak']:.0f}% of the "
            f"{x['peak_gflops']:.0f} GFLOP/s GEMM peak measured in this run "
            f"({x['gemm_ms_per_step']:.0f} of {x['step_ms']:.0f} ms/step, {x['timed_by']})",
            "",
        )
    for x in r.get("prefill", []):
        table.add_row(
            f"prefill chunk {x['chunk']}", f"{x['tok_s']:.1f}", f"{x['step_ms']:.1f} ms", ""
        )
    if table.row_count:
        out.print(table)
    if "check" in r:
        out.print("check:", r["check"])
    if "ops" in r:
        report_ops(out, r["ops"], f"{r['backend']} ({r['kernels']})")


def report_ops(out: Console, ops: dict, backend: str) -> None:
    ceiling = ops["ceiling_gflops"]
    d, p = ops["decode"], ops["prefill"]
    steps = {
        f"decode step, batch {d['batch']} @ ctx {d['context']}": d,
        f"prefill step, one chunk of {p['chunk']}": p,
    }
    for name, step in steps.items():
        title = (
            f"{backend}: {name}, {step['step_ms']:.1f} ms (layer loop, every op timed); "
            f"GEMM ceiling {ceiling:.0f} GFLOP/s"
        )
        if "decode_fast_path_step_ms" in ops and step is d:
            title += f"; {ops['forward_path']}: {ops['decode_fast_path_step_ms']:.1f} ms"
        table = Table(title=title)
        for col in ("op", "ms/step", "share", "GFLOP/s", "% of ceiling", "GB/s"):
            table.add_column(col, justify="left" if col == "op" else "right", no_wrap=True)
        for fam, x in step["families"].items():
            table.add_row(
                fam,
                f"{x['ms']:.2f}",
                f"{100 * x['share']:.1f}%",
                f"{x['gflops']:.1f}" if "gflops" in x else "",
                f"{x['pct_of_ceiling']:.1f}%" if "pct_of_ceiling" in x else "",
                f"{x['gbps']:.3g}" if "gbps" in x else "",
            )
        out.print(table)


if __name__ == "__main__":
    raise SystemExit(main())
