"""Decode step time with LoRA adapters: 64 rows of SmolLM2-135M (float32), no adapter against
1, 4 and 16 adapters spread over the rows round-robin (rank 16 on all seven projections).

    .venv/bin/python bench/lora_step.py                       # native backend, 2 threads
    .venv/bin/python bench/lora_step.py --kernels reference --rows 32 --steps 20

The adapters are random, written in PEFT's layout to a temporary directory. Each row has a
64-token prompt, prefilled before the timing; a step is one decode token for every row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,  # noqa: E402
)
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.lora.sites import MODULES, PARENT  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
PROMPT = 64


def write_adapter(path: Path, runner: ModelRunner, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter on every projection of the runner's model."""
    gen = torch.Generator().manual_seed(seed)
    base = runner.loras.base
    tensors = {}
    for layer in range(base.num_layers):
        for module in MODULES:
            out_features, in_features = base.features[module]
            key = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": MODULES}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def step_times(runner: ModelRunner, adapters: list[str], rows: int, steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps of `rows` rows, row i on adapters[i % n]."""
    runner.reset()
    per_row = -(-(PROMPT + steps + 4) // runner.block_size)
    names = [adapters[i % len(adapters)] if adapters else "" for i in range(rows)]
    new = [
        NewRequestData(
            f"r{i}",
            [(i * 131 + j * 17) % 40000 + 100 for j in range(PROMPT)],
            GREEDY,
            list(range(i * per_row, (i + 1) * per_row)),
            0,
            lora_name=name,
        )
        for i, name in enumerate(names)
    ]
    scheduled = {r.request_id: PROMPT for r in new}
    runner.execute_model(SchedulerOutput(new_requests=new, num_scheduled_tokens=scheduled))
    times = []
    for k in range(steps + 2):  # two warm-up steps
        cached = [CachedRequestData(r.request_id, [], PROMPT + k) for r in new]
        so = SchedulerOutput(
            cached_requests=cached, num_scheduled_tokens=dict.fromkeys(scheduled, 1)
        )
        started = time.perf_counter()
        runner.execute_model(so)
        times.append(time.perf_counter() - started)
    return times[2:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="native", choices=("native", "reference"))
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    runner = ModelRunner(
        ModelRunnerConfig(
            model=None,
            kernels=args.kernels,
            dtype="float32",
            num_threads=args.threads,
            max_num_seqs=args.rows,
            num_gpu_blocks=args.rows * (-(-(PROMPT + args.steps + 4) // 16)),
            warmup_tokens=0,
            max_loras=16,
            max_lora_rank=args.rank,
        )
    )
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(16):
            runner.load_lora(f"a{i}", str(write_adapter(Path(tmp) / f"a{i}", runner, args.rank, i)))
        print(f"{runner.kernels}; {args.rows} rows, rank {args.rank}, {args.threads} threads")
        print(f"{'adapters':>8} {'step ms':>8} {'overhead':>9}")
        base = None
        for count in (0, 1, 4, 16):
            ms = 1e3 * statistics.median(
                step_times(runner, [f"a{i}" for i in range(count)], args.rows, args.steps)
            )
            base = base or ms
            print(f"{count:>8} {ms:>8.1f} {ms / base - 1:>+9.0%}")


if __name__ == "__main__":
    main()
