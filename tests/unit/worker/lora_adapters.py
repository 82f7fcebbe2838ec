"""PEFT adapters made for the LoRA tests, Hugging Face + PEFT's greedy tokens for them, and a
runner driven with requests of several adapters in one batch (test_lora_*.py share these)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from common.messages import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from worker_svc.lora.sites import MODULES
from worker_svc.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)
# three adapters unlike each other: ranks 4, 8, 16; one rsLoRA; one on some projections only
ADAPTERS = {
    "r4": dict(r=4, lora_alpha=8, target_modules=list(MODULES)),
    "r8-rslora": dict(r=8, lora_alpha=16, target_modules=list(MODULES), use_rslora=True),
    "r16-some": dict(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
}


def load_base(model_dir: Path, dtype=torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def make_adapter(
    model_dir: Path, out_dir: Path, seed: int, std: float = 0.05, base=None, **options
) -> Path:
    """A PEFT LoRA adapter of `options` (LoraConfig's) for the model at `model_dir` (or a copy
    of `base`, loaded from it), with random A and B (PEFT starts B at zero: the adapter would
    change nothing), saved to `out_dir`."""
    from peft import LoraConfig, get_peft_model

    model = load_base(model_dir) if base is None else copy.deepcopy(base)
    peft_model = get_peft_model(model, LoraConfig(**options))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(out_dir)
    return out_dir


def make_adapters(model_dir: Path, root: Path, std: float) -> dict[str, Path]:
    """ADAPTERS for the model at `model_dir`, saved under `root`."""
    base = load_base(model_dir)
    return {
        name: make_adapter(model_dir, root / name, seed=i, std=std, base=base, **options)
        for i, (name, options) in enumerate(ADAPTERS.items())
    }


def peft_greedy(
    model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]], n: int
) -> dict[str, list[list[int]]]:
    """transformers + PEFT `generate(do_sample=False)`, n tokens after each prompt, under each
    adapter (set_adapter) and under none ("", the adapters disabled)."""
    from peft import PeftModel

    (first, path), *others = adapters.items()
    model = PeftModel.from_pretrained(load_base(model_dir), str(path), adapter_name=first)
    for name, path in others:
        model.load_adapter(str(path), adapter_name=name)
    model.eval()

    def generate() -> list[list[int]]:
        outs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                # EOS neither stops nor is suppressed (min_new_tokens would mask it): as the
                # runner samples, which leaves stopping to the scheduler
                eos_token_id=None,
            )
            outs.append(out[0, len(prompt) :].tolist())
        return outs

    tokens = {}
    with torch.no_grad():
        for name in adapters:
            model.set_adapter(name)
            tokens[name] = generate()
        with model.disable_adapter():
            tokens[""] = generate()
    return tokens


def run_mixed(
    runner: ModelRunner,
    requests: list[tuple[str, list[int], str]],
    n: int,
    chunk: int = 1 << 20,
) -> dict[str, list[int]]:
    """Every request (id, prompt, lora_name) in one batch: prefills in chunks of `chunk` tokens
    beside the others' decodes, then decodes until each has n tokens; returns the tokens."""
    runner.reset()
    bs = runner.block_size
    tokens = {rid: list(p) for rid, p, _ in requests}
    lora = {rid: name for rid, _, name in requests}
    computed = dict.fromkeys(tokens, 0)
    blocks, first = {}, 0
    for rid, prompt, _ in requests:
        need = -(-(len(prompt) + n) // bs)
        blocks[rid], first = list(range(first, first + need)), first + need
    prompt_len = {rid: len(p) for rid, p, _ in requests}
    sent: set[str] = set()
    while any(len(t) - prompt_len[r] < n for r, t in tokens.items()):
        scheduled = {
            r: min(chunk, len(t) - computed[r])
            for r, t in tokens.items()
            if len(t) - prompt_len[r] < n
        }
        so = SchedulerOutput(
            new_requests=[
                NewRequestData(r, tokens[r], GREEDY, blocks[r], 0, [], lora_name=lora[r])
                for r in scheduled
                if r not in sent
            ],
            cached_requests=[CachedRequestData(r, [], computed[r]) for r in scheduled if r in sent],
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
        )
        out = runner.execute_model(so)
        sent.update(scheduled)
        for r, k in scheduled.items():
            computed[r] += k
            tokens[r] += out.sampled_token_ids[r]
    return {r: t[prompt_len[r] :] for r, t in tokens.items()}
