"""Requests of three PEFT adapters and of the base model, mixed in one batch through the
ModelRunner, give transformers + PEFT's greedy tokens: on the tiny random Llama and on
SmolLM2-135M, on the reference and the native backend (float32). Steps without an adapter keep
the decode stack; the errors a step can meet name the adapter; a preempted request keeps its
adapter; an unloaded one serves its running requests to their end."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from common.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from tests.cpu_levels import needs_level  # noqa: E402
from tests.unit.worker.lora_adapters import (  # noqa: E402
    ADAPTERS,
    GREEDY,
    make_adapter,
    make_adapters,
    peft_greedy,
    run_mixed,
)
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.lora import LoraLoadError  # noqa: E402
from worker_svc.lora.adapter_slots import TooManyAdapters  # noqa: E402
from worker_svc.lora.sites import MODULES  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

KERNELS = ["reference", pytest.param("native", marks=needs_level("avx2", "the native kernels"))]
TINY_PROMPTS = [[5, 17, 99, 3, 250], [7, 8, 9, 10, 11, 12, 13, 14, 40, 41, 300]]
SMOL_PROMPTS = [[1, 504, 3458, 314, 260, 1345], [1, 1820, 17, 420, 29, 21, 40, 1005, 2910, 30]]


def runner_for(model, kernels="reference", **options) -> ModelRunner:
    config = dict(model=model, kernels=kernels, block_size=4, num_gpu_blocks=96, warmup_tokens=0)
    return ModelRunner(ModelRunnerConfig(**{**config, "max_num_seqs": 16, **options}))


def modules_flag(dirs) -> str:
    return ",".join(f"{name}={path}" for name, path in dirs.items())


def mixed_requests(prompts):
    names = ["", *ADAPTERS]
    return [(f"{name or 'base'}/{i}", p, name) for name in names for i, p in enumerate(prompts)]


def expected(want) -> dict[str, list[int]]:
    return {f"{name or 'base'}/{i}": t for name, outs in want.items() for i, t in enumerate(outs)}


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    dirs = make_adapters(tiny_llama_dir, tmp_path_factory.mktemp("tiny-loras"), std=0.3)
    want = peft_greedy(tiny_llama_dir, dirs, TINY_PROMPTS, 8)
    for name in ADAPTERS:  # each adapter changes what the model says
        assert want[name] != want[""], name
    return tiny_llama_dir, dirs, want


@pytest.fixture(scope="module")
def smollm2(smollm2_path, tmp_path_factory):
    from common.model_source import resolve_model
    from worker_svc.model_loader import model_dir

    base = model_dir(resolve_model(None))
    dirs = make_adapters(base, tmp_path_factory.mktemp("smol-loras"), std=0.1)
    want = peft_greedy(base, dirs, SMOL_PROMPTS, 4)
    for name in ADAPTERS:
        assert want[name] != want[""], name
    return dirs, want


@pytest.mark.parametrize("kernels", KERNELS)
def test_tiny_llama_mixed_batch_equals_peft(tiny, kernels):
    model, dirs, want = tiny
    runner = runner_for(str(model), kernels, max_loras=3, lora_modules=modules_flag(dirs))
    got = run_mixed(runner, mixed_requests(TINY_PROMPTS), 8, chunk=3)  # chunks beside decodes
    assert got == expected(want)
    assert sorted(runner.resident_loras()) == sorted(ADAPTERS)


@pytest.mark.parametrize("kernels", KERNELS)
def test_smollm2_mixed_batch_equals_peft(smollm2, kernels):
    dirs, want = smollm2
    runner = runner_for(None, kernels, max_loras=3, num_threads=2, lora_modules=modules_flag(dirs))
    assert run_mixed(runner, mixed_requests(SMOL_PROMPTS), 4, chunk=8) == expected(want)


@pytest.fixture(scope="module")
def llama_hd64(llama_hd64_dir, tmp_path_factory):
    """A random Llama with head_dim 64, which the native decode stack takes, and an adapter."""
    adapter = make_adapter(
        llama_hd64_dir,
        tmp_path_factory.mktemp("hd64-lora"),
        seed=3,
        std=0.3,
        r=4,
        lora_alpha=8,
        target_modules=list(MODULES),
    )
    return llama_hd64_dir, adapter


@needs_level("avx2", "the float32 decode stack")
def test_steps_without_adapters_keep_the_decode_stack(llama_hd64):
    model, adapter = llama_hd64
    runner = runner_for(str(model), "native", max_loras=1, lora_modules=f"a={adapter}")
    assert runner.forward_path == "model+decode-stack"
    stack, calls = runner.model.decode_step, []
    runner.model.decode_step = lambda *args: calls.append(stack(*args)) or calls[-1]
    base = run_mixed(runner, [("b", [5, 6, 7], "")], 4)
    assert sum(h is not None for h in calls) == 3  # every decode step (the prefill: declined)
    calls.clear()
    mixed = run_mixed(runner, [("b", [5, 6, 7], ""), ("a", [5, 6, 7], "a")], 4)
    assert calls == [] and mixed["b"] == base["b"] and mixed["a"] != base["b"]


def test_step_errors_name_the_adapter(tiny):
    model, dirs, _ = tiny
    runner = runner_for(str(model), max_loras=1, lora_modules=modules_flag(dirs))
    with pytest.raises(ValueError, match="LoRA adapter 'nope' is not loaded on this worker$"):
        run_mixed(runner, [("x", [5, 6], "nope")], 2)
    with pytest.raises(TooManyAdapters, match="2 LoRA adapters, more than max_loras=1"):
        run_mixed(runner, [("x", [5, 6], "r4"), ("y", [5, 6], "r8-rslora")], 2)
    off = runner_for(str(model))
    with pytest.raises(ValueError, match=r"'r4' is not loaded .*\(LoRA is off .*max_loras=0\)"):
        run_mixed(off, [("x", [5, 6], "r4")], 2)


def step(runner, new=(), cached=(), scheduled=None, finished=(), preempted=()):
    so = SchedulerOutput(
        new_requests=list(new),
        cached_requests=list(cached),
        num_scheduled_tokens=scheduled or {},
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    return runner.execute_model(so).sampled_token_ids


def test_preempted_request_resumes_with_its_adapter(tiny):
    model, dirs, want = tiny
    runner = runner_for(str(model), max_loras=1, lora_modules=modules_flag(dirs))
    prompt, blocks = TINY_PROMPTS[0], list(range(4))
    new = NewRequestData("r", prompt, GREEDY, blocks, 0, [], lora_name="r4")
    out = step(runner, new=[new], scheduled={"r": len(prompt)})["r"]
    for _ in range(2):
        out += step(runner, cached=[CachedRequestData("r", [], len(prompt) + len(out) - 1)],
                    scheduled={"r": 1})["r"]  # fmt: skip
    step(runner, preempted=["r"])
    step(runner, new=[NewRequestData("s", [9, 9], GREEDY, [10], 0, [], lora_name="r16-some")],
         scheduled={"s": 2})  # fmt: skip  # another adapter takes the only slot meanwhile
    resumed = CachedRequestData("r", list(range(20, 24)), 0, True, list(out))
    out += step(runner, cached=[resumed], scheduled={"r": len(prompt) + len(out)})["r"]
    assert out == want["r4"][0][: len(out)] and len(out) == 4


def test_unloaded_adapter_serves_its_running_requests(tiny):
    model, dirs, want = tiny
    runner = runner_for(str(model), max_loras=2, lora_modules=modules_flag(dirs))
    prompt = TINY_PROMPTS[1]
    new = NewRequestData("r", prompt, GREEDY, list(range(8)), 0, [], lora_name="r8-rslora")
    out = step(runner, new=[new], scheduled={"r": len(prompt)})["r"]
    assert runner.unload_lora("r8-rslora")
    assert "r8-rslora" not in [a.name for a in runner.lora_adapters()]
    while len(out) < 8:
        cached = CachedRequestData("r", [], len(prompt) + len(out) - 1)
        out += step(runner, cached=[cached], scheduled={"r": 1})["r"]
    assert out == want["r8-rslora"][1]
    assert "r8-rslora" in runner.resident_loras()
    step(runner, finished=["r"])
    assert "r8-rslora" not in runner.resident_loras()
    with pytest.raises(ValueError, match="'r8-rslora' is not loaded"):
        run_mixed(runner, [("x", [5, 6], "r8-rslora")], 1)


def test_host_cache_reads_evicted_adapters_again(tiny, tmp_path):
    model, dirs, want = tiny
    runner = runner_for(str(model), max_loras=1, max_cpu_loras=1)
    for name, path in dirs.items():  # each load pushes the one before out of host memory
        runner.load_lora(name, str(path))
    for name in [*ADAPTERS, "r4"]:  # one slot: every step refills it, from disk but the last
        assert run_mixed(runner, [("x", TINY_PROMPTS[0], name)], 8)["x"] == want[name][0]
        assert runner.resident_loras() == [name]
    moved = tmp_path / "moved"
    dirs["r8-rslora"].rename(moved)
    try:
        with pytest.raises(LoraLoadError, match="'r8-rslora' at .*: no such directory"):
            run_mixed(runner, [("x", TINY_PROMPTS[0], "r8-rslora")], 1)
    finally:
        moved.rename(dirs["r8-rslora"])


def test_loads_from_another_thread_beside_steps(tiny):
    model, dirs, want = tiny
    runner = runner_for(str(model), max_loras=3)
    errors = []

    def load_all():
        try:
            for name, path in dirs.items():
                runner.load_lora(name, str(path))
        except Exception as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)

    loader = threading.Thread(target=load_all)
    loader.start()
    base = run_mixed(runner, [("b", TINY_PROMPTS[0], "")], 8)
    loader.join()
    assert not errors and base["b"] == want[""][0]
    assert [a.name for a in runner.lora_adapters()] == list(ADAPTERS)
    assert run_mixed(runner, mixed_requests(TINY_PROMPTS), 8) == expected(want)


@pytest.mark.parametrize("kernels", KERNELS)
def test_bfloat16_logits_match_peft(tiny, kernels):
    """A bfloat16 model: PEFT keeps the adapter in float32 and adds its float32 delta to each
    bfloat16 projection; the runner's logits are PEFT's to within bfloat16's rounding."""
    from peft import PeftModel

    from tests.unit.worker.lora_adapters import load_base
    from tests.unit.worker.runner_steps import LogitsTap

    model, dirs, _ = tiny
    runner = runner_for(str(model), kernels, dtype="bfloat16", max_loras=3)
    prompt = TINY_PROMPTS[1]
    for name, path in dirs.items():
        runner.load_lora(name, str(path))
        peft_model = PeftModel.from_pretrained(load_base(model, torch.bfloat16), str(path))
        with torch.no_grad():
            want = peft_model.eval()(torch.tensor([prompt])).logits[0, -1].float()
        tap = LogitsTap(runner)
        run_mixed(runner, [("x", prompt, name)], 1)
        runner.sampler = tap.inner
        got = tap.logits[0][0].float()
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), name
        assert int(got.argmax()) == int(want.argmax())
