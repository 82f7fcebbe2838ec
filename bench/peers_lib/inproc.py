"""Systems in this process (torch): splitserve's scheduler core + ModelRunner (InProcessEngine),
Hugging Face `generate` one request at a time and in static padded batches, and transformers'
continuous batching (`init_continuous_batching`, the engine behind `generate_batch`).

Each one takes requests at their arrival times (the engine's loop admits what has arrived before
each step) and stamps every output token with the time it became known."""

from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from peers_lib.workload import Workload
from splitserve.loadgen import RequestResult


def _stamp(r: RequestResult, arrival: float, times: list[float], t0: float) -> None:
    """Fill a result from its arrival and absolute token times."""
    r.start = arrival
    if not times:
        r.error = "no output token"
        return
    rel = [t - t0 for t in times]
    r.ttft = rel[0] - arrival
    r.itl = [b - a for a, b in zip(rel, rel[1:], strict=False)]
    r.e2e = rel[-1] - arrival
    r.output_len = len(times)
    r.arrivals = [(t, 1) for t in rel]
    r.ok = True


# ---- splitserve in-process ------------------------------------------------------------------
def make_runner(args):
    from worker_svc.config import GiB, ModelRunnerConfig
    from worker_svc.model_runner import ModelRunner

    return ModelRunner(
        ModelRunnerConfig(
            model=None,
            dtype=args.dtype,
            quantization=args.quantization,
            num_threads=args.threads,
            kv_cache_memory=int(args.kv_cache_gib * GiB),
            max_num_seqs=max(256, args.max_num_seqs),
            max_num_batched_tokens=max(8192, args.max_num_batched_tokens),
        )
    )


def run_splitserve_inproc(args, wl: Workload, runs) -> dict:
    from scheduler_svc.core import SamplingParams
    from splitserve.inprocess import InProcessEngine

    runner = make_runner(args)
    runner.warm_up(2048)  # as the worker does at its start (--warmup-tokens)
    params = SamplingParams(temperature=0.0, max_tokens=wl.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def engine() -> InProcessEngine:
        runner.reset()
        return InProcessEngine(
            runner,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=False,
            max_model_len=min(runner.max_model_len, 4096),
        )

    e = engine()
    e.add("warm", wl.prompts[0][:32], warm)
    e.run()
    out, outputs = {}, None
    for mode, offsets in runs:
        e = engine()
        n = wl.num_requests
        times: list[list[float]] = [[] for _ in range(n)]
        bar = tqdm(
            total=n * wl.max_tokens, desc=f"splitserve-inproc {mode}", unit="tok", leave=False
        )
        t0 = time.perf_counter()
        i = 0
        while i < n or e.scheduler.has_unfinished_requests():
            now = time.perf_counter() - t0
            while i < n and offsets[i] <= now:
                e.add(str(i), wl.prompts[i], params)
                i += 1
            if not e.scheduler.has_unfinished_requests():
                time.sleep(max(0.0, offsets[i] - now))
                continue
            finished = e.step()
            t = time.perf_counter()
            for o in finished:
                if o.new_token_ids:
                    times[int(o.request_id)].extend([t] * len(o.new_token_ids))
                    bar.update(len(o.new_token_ids))
        duration = time.perf_counter() - t0
        e.step()  # let the runner drop the finished rows
        bar.close()
        results = [RequestResult(prompt_len=len(p)) for p in wl.prompts]
        for k, r in enumerate(results):
            _stamp(r, offsets[k], times[k], t0)
        out[mode] = (results, duration)
        outputs = outputs or {int(k): v for k, v in e.outputs.items()}
    return out, {"outputs": outputs}


# ---- Hugging Face ---------------------------------------------------------------------------
def load_hf():
    from transformers import AutoModelForCausalLM

    from common.model_source import resolve_model
    from worker_svc.model_loader import model_dir

    path = model_dir(resolve_model(None))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class _Clock:
    """A stopping criterion that never stops: generate calls it once per new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class TimedModel:
    """Proxy for an HF model whose `generate` records, per call, its start and token times, so
    bench/worker_forward.py's baselines run unchanged."""

    def __init__(self, model) -> None:
        self.model = model
        self.device = model.device
        self.calls: list[tuple[float, list[float]]] = []

    def generate(self, *a, **kw):
        from transformers import StoppingCriteriaList

        clock = _Clock()
        kw["stopping_criteria"] = StoppingCriteriaList([clock])
        start = time.perf_counter()
        out = self.model.generate(*a, **kw)
        self.calls.append((start, clock.times))
        return out


def run_hf_one_by_one(args, wl: Workload, runs) -> tuple[dict, dict]:
    """HF `generate`, one request at a time (bench/worker_forward.hf_one_by_one). Slow, so only
    `args.hf_requests` requests (evenly spread over the workload) run, back to back; each run's
    FCFS queue over all requests is then replayed from service times: measured for the requests
    that ran, fitted (linear in prompt length) for the others. Labelled as an estimate."""
    from worker_forward import hf_one_by_one

    model = TimedModel(load_hf())
    n = wl.num_requests
    k = min(n, max(1, args.hf_requests))
    idx = sorted({round(j * (n - 1) / max(1, k - 1)) for j in range(k)}) if k > 1 else [0]
    with torch.inference_mode():
        hf_one_by_one(model.model, [wl.prompts[0][:32]], 4)  # warm-up
        res = hf_one_by_one(model, [wl.prompts[j] for j in idx], wl.max_tokens)
    measured = {}
    for j, (start, times), outs in zip(idx, model.calls, res["outputs"], strict=True):
        measured[j] = (
            times[0] - start,
            times[-1] - times[0],
            [b - a for a, b in zip(times, times[1:], strict=False)],
            outs,
        )
    xs = [len(wl.prompts[j]) for j in idx]

    def fit(ys: list[float]):
        if len(set(xs)) < 2:
            m = statistics.mean(ys)
            return lambda x: m
        mx, my = statistics.mean(xs), statistics.mean(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        return lambda x: max(1e-4, my + b * (x - mx))

    prefill = fit([measured[j][0] for j in idx])
    decode = fit([measured[j][1] for j in idx])
    out = {}
    for mode, offsets in runs:
        free_at, results = 0.0, []
        for i, p in enumerate(wl.prompts):
            if i in measured:
                pf, dc, itl, _ = measured[i]
            else:
                pf, dc = prefill(len(p)), decode(len(p))
                itl = [dc / max(1, wl.max_tokens - 1)] * (wl.max_tokens - 1)
            begin = max(free_at, offsets[i])
            first = begin + pf
            free_at = first + dc
            r = RequestResult(ok=True, prompt_len=len(p), output_len=wl.max_tokens)
            r.start, r.itl = offsets[i], itl
            r.ttft, r.e2e = first - offsets[i], free_at - offsets[i]
            results.append(r)
        out[mode] = (results, free_at)
    eos = model.model.generation_config.eos_token_id
    info = {
        "measured_requests": len(idx),
        "measured_time_s": res["time_s"],
        "measured_tok_s": res["tok_s"],
        "estimated": len(idx) < n,
        "outputs": {j: measured[j][3] for j in idx},
        "eos": eos[0] if isinstance(eos, list) else eos,
    }
    return out, info


def run_hf_static(args, wl: Workload, runs) -> dict:
    """HF `generate` on left-padded batches of up to args.static_batch requests: when a batch
    finishes, the next takes (in arrival order) up to that many of the requests that have
    arrived, waiting for the first if none has; all members generate max_tokens tokens."""
    model = TimedModel(load_hf())
    pad = model.model.generation_config.eos_token_id
    pad = (pad[0] if isinstance(pad, list) else pad) or 0

    def gen(group: list[list[int]], max_tokens: int) -> None:
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
        )

    out = {}
    with torch.inference_mode():
        gen([wl.prompts[0][:32]], 4)  # warm-up
        for mode, offsets in runs:
            n = wl.num_requests
            results = [RequestResult(prompt_len=len(p)) for p in wl.prompts]
            bar = tqdm(total=n * wl.max_tokens, desc=f"hf-static {mode}", unit="tok", leave=False)
            t0 = time.perf_counter()
            i = 0
            while i < n:
                now = time.perf_counter() - t0
                if offsets[i] > now:
                    time.sleep(offsets[i] - now)
                    now = offsets[i]
                j = i + 1
                while j < n and j - i < args.static_batch and offsets[j] <= now:
                    j += 1
                gen(wl.prompts[i:j], wl.max_tokens)
                times = model.calls[-1][1]
                for k in range(i, j):
                    _stamp(results[k], offsets[k], times, t0)
                bar.update((j - i) * wl.max_tokens)
                i = j
            out[mode] = (results, time.perf_counter() - t0)
            bar.close()
    return out


def run_generate_batch(args, wl: Workload, runs) -> dict:
    """transformers' continuous batching (the manager behind `generate_batch`), requests added
    at their arrival times, per-token timestamps recorded by transformers itself. Its paged cache
    is sized explicitly (on CPU it would otherwise take 60% of the machine's free memory)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = load_hf()
    gen_cfg = GenerationConfig(max_new_tokens=wl.max_tokens, do_sample=False, eos_token_id=-1)
    page = 256
    need = sum(-(-(len(p) + wl.max_tokens) // page) for p in wl.prompts) + 8
    out = {}
    for mode, offsets in runs:
        cb = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=need,
            max_batch_tokens=args.max_num_batched_tokens,
            allow_block_sharing=False,
        )
        hints = WorkloadHints(max(wl.prompt_lens), wl.max_tokens, wl.num_requests)
        manager = model.init_continuous_batching(gen_cfg, cb, hints)
        manager.warmup()
        manager.start()
        try:
            manager.add_request(wl.prompts[0][:32], request_id="warm", max_new_tokens=4)
            while (r := manager.get_result(timeout=60)) is None or not r.is_finished():
                if r is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped")
            n = wl.num_requests
            results = [RequestResult(prompt_len=len(p)) for p in wl.prompts]
            bar = tqdm(total=n, desc=f"generate-batch {mode}", unit="req", leave=False)
            t0 = time.perf_counter()
            i, done = 0, 0
            while done < n:
                now = time.perf_counter() - t0
                while i < n and offsets[i] <= now:
                    manager.add_request(
                        wl.prompts[i],
                        request_id=str(i),
                        max_new_tokens=wl.max_tokens,
                        record_timestamps=True,
                    )
                    i += 1
                wait = offsets[i] - now if i < n else 1.0
                r = manager.get_result(timeout=max(0.001, min(wait, 1.0)))
                if r is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching stopped")
                    continue
                if r.is_finished():
                    k = int(r.request_id)
                    if r.error:
                        results[k].error = str(r.error)
                    else:
                        _stamp(results[k], offsets[k], list(r.timestamps or []), t0)
                    done += 1
                    bar.update(1)
            out[mode] = (results, time.perf_counter() - t0)
            bar.close()
        finally:
            manager.stop(block=True, timeout=10)
            manager.destroy()
            if hasattr(model, "_cached_continuous_batching_manager"):
                model.destroy_cached_continuous_batching_manager()
    return out
