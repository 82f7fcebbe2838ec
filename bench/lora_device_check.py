"""LoRA on a device (the GPU check's LoRA step; bench/gpu_check.py runs it): SmolLM2-135M in
float32 with three PEFT adapters (ranks 4, 8 and 16, one rsLoRA, one on some projections only)
and the base model mixed in one batch, prefills in chunks beside decodes, through the runner's
reference backend on --device; the greedy tokens must equal HF + PEFT's on the CPU.

    .venv/bin/python bench/lora_device_check.py --device cuda:0 --json lora_gpu.json
    .venv/bin/python bench/lora_device_check.py --device cpu      # dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.unit.worker.lora_adapters import (  # noqa: E402
    ADAPTERS,
    make_adapters,
    peft_greedy,
    run_mixed,
)

PROMPTS = [[1, 504, 3458, 314, 260, 1345], [1, 1820, 17, 420, 29, 21, 40, 1005, 2910, 30]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from common.model_source import resolve_model
    from worker_svc.config import ModelRunnerConfig
    from worker_svc.model_loader import model_dir
    from worker_svc.model_runner import ModelRunner

    base = model_dir(resolve_model(None))
    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_adapters(base, Path(tmp), std=0.1)
        want = peft_greedy(base, dirs, PROMPTS, args.tokens)
        runner = ModelRunner(
            ModelRunnerConfig(
                device=args.device,
                dtype="float32",
                kernels="reference",
                block_size=16,
                num_gpu_blocks=64,
                warmup_tokens=0,
                max_loras=len(ADAPTERS),
                lora_modules=",".join(f"{n}={d}" for n, d in dirs.items()),
            )
        )
        requests = [
            (f"{name or 'base'}/{i}", prompt, name)
            for name in ["", *ADAPTERS]
            for i, prompt in enumerate(PROMPTS)
        ]
        got = run_mixed(runner, requests, args.tokens, chunk=4)
    rows = {rid: got[rid] == want[name][int(rid.rsplit("/", 1)[1])] for rid, _, name in requests}
    result = {"device": args.device, "equal": sum(rows.values()), "compared": len(rows)}
    result["passed"] = result["equal"] == result["compared"]
    print(json.dumps({**result, "rows": rows}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
