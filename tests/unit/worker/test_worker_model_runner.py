"""ModelRunner API on a tiny random Llama: sizing, outputs, logprobs, errors, reset, bfloat16."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from common.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.kv_cache import bytes_per_block  # noqa: E402
from worker_svc.model_runner import ModelRunner, ModelRunnerOutput  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    return ModelRunner(
        ModelRunnerConfig(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=32, num_threads=2)
    )


def new(req_id, prompt, blocks, computed=0, params=GREEDY, outputs=()):
    return NewRequestData(req_id, list(prompt), params, list(blocks), computed, list(outputs))


def step(runner, new_reqs=(), cached=(), scheduled=None, **kw) -> ModelRunnerOutput:
    so = SchedulerOutput(
        new_requests=list(new_reqs), cached_requests=list(cached), num_scheduled_tokens=scheduled
    )
    for key, value in kw.items():
        setattr(so, key, value)
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    return runner.execute_model(so)


def test_properties(runner, tiny_llama_dir):
    assert runner.num_blocks == 32 and runner.num_host_blocks == 0 and runner.block_size == 4
    assert runner.max_model_len == 512 and runner.vocab_size == 512
    assert runner.eos_token_id == 2 and runner.model_name == tiny_llama_dir.name
    assert runner.dtype == torch.float32 and runner.device.type == "cpu"


def test_kv_sizing_from_memory_budget(tiny_llama_dir):
    per_block = bytes_per_block(2, 8, 2, 16, torch.float32)
    r = ModelRunner(
        ModelRunnerConfig(
            model=str(tiny_llama_dir),
            block_size=8,
            kv_cache_memory=10 * per_block + 1,
            swap_space=3 * per_block,
            max_model_len=64,
        )
    )
    assert (r.num_blocks, r.num_host_blocks, r.max_model_len) == (10, 3, 64)
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(ModelRunnerConfig(model=str(tiny_llama_dir), max_model_len=10_000))
    with pytest.raises(ValueError, match="unknown model"):
        ModelRunner(ModelRunnerConfig(model="/no/such/model"))


def test_partial_prefill_samples_nothing_then_one_token(runner):
    runner.reset()
    prompt = list(range(10, 20))
    out = step(runner, [new("a", prompt, [0, 1, 2])], scheduled={"a": 6})
    assert out.sampled_token_ids == {"a": []} and out.logprobs is None
    assert out.forward_time_s > 0
    out = step(runner, cached=[CachedRequestData("a", [], 6)], scheduled={"a": 4})
    assert len(out.sampled_token_ids["a"]) == 1
    # an unscheduled request stays in the batch untouched
    out = step(runner, [new("b", [5, 6], [3])], scheduled={"b": 2})
    assert list(out.sampled_token_ids) == ["b"]
    out = step(runner, cached=[CachedRequestData("a", [], 10)], scheduled={"a": 1})
    assert len(out.sampled_token_ids["a"]) == 1


def test_logprobs_output(runner):
    runner.reset()
    params = SamplingParams(temperature=0.0, logprobs=3)
    out = step(
        runner,
        [new("a", [1, 2, 3], [0], params=params), new("b", [4, 5], [1])],
        scheduled={"a": 3, "b": 2},
    )
    assert set(out.logprobs) == {"a"}
    (lp,) = out.logprobs["a"]
    assert lp.token_id == out.sampled_token_ids["a"][0]
    assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the top token
    assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0


def test_errors_and_reset(runner):
    runner.reset()
    with pytest.raises(KeyError, match="unknown request"):
        step(runner, cached=[CachedRequestData("ghost", [], 0)], scheduled={"ghost": 1})
    step(runner, [new("a", [1, 2, 3], [0])], scheduled={"a": 3})
    with pytest.raises(ValueError, match="known tokens"):
        step(runner, cached=[CachedRequestData("a", [], 3)], scheduled={"a": 2})
    runner.reset()
    with pytest.raises(KeyError):
        step(runner, cached=[CachedRequestData("a", [], 4)], scheduled={"a": 1})
    assert step(runner, scheduled={}).sampled_token_ids == {}


def test_warm_up_runs_a_capped_throwaway_prefill_and_leaves_no_trace(runner):
    """The worker's start: one prefill as long as the limits allow, then a clean batch; the
    garbage it wrote in the KV cache is never read by the requests that follow."""
    runner.reset()
    prompt = [7, 99, 23, 300, 41, 5, 77]
    params = SamplingParams(temperature=0.0, logprobs=5)
    cold = step(runner, [new("a", prompt, [0, 1], params=params)], scheduled={"a": len(prompt)})
    runner.reset()
    # tiny Llama: max_model_len 512, 32 blocks of 4 = 128 tokens of cache
    assert runner.warm_up(4096) == 32 * 4
    assert not runner.batch.states
    assert runner.warm_up(0) == 0
    with pytest.raises(ValueError, match="warmup_tokens must not be negative"):
        ModelRunnerConfig(warmup_tokens=-1)
    warm = step(runner, [new("a", prompt, [0, 1], params=params)], scheduled={"a": len(prompt)})
    assert warm.sampled_token_ids == cold.sampled_token_ids and warm.logprobs == cold.logprobs
    runner.reset()


def test_swap_only_step_copies_blocks(tiny_llama_dir):
    r = ModelRunner(
        ModelRunnerConfig(
            model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=8, num_host_blocks=2
        )
    )
    step(r, [new("a", list(range(1, 8)), [3, 4])], scheduled={"a": 7})
    saved = r.kv_cache.device_cache[:, :, [3, 4]].clone()
    step(r, scheduled={}, blocks_to_swap_out=[(3, 1), (4, 0)], preempted_req_ids={"a"})
    r.kv_cache.device_cache.zero_()
    step(r, scheduled={}, blocks_to_swap_in=[(6, 1), (5, 0)])
    torch.testing.assert_close(r.kv_cache.device_cache[:, :, [6, 5]], saved)


def test_bfloat16_logprobs_close_to_hugging_face(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    r = ModelRunner(
        ModelRunnerConfig(
            model=str(tiny_llama_dir), dtype="bfloat16", block_size=4, num_gpu_blocks=16
        )
    )
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    prompt = [7, 99, 23, 300, 41, 5, 77]
    params = SamplingParams(temperature=0.0, logprobs=1)
    out = step(r, [new("a", prompt, [0, 1, 2, 3], params=params)], scheduled={"a": len(prompt)})
    got, lp = [], []
    for _ in range(6):
        got += out.sampled_token_ids["a"]
        lp.append(out.logprobs["a"][0].logprob)
        n = len(prompt) + len(got) - 1
        out = step(r, cached=[CachedRequestData("a", [], n)], scheduled={"a": 1})
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + got])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(got)[:, None])
    assert torch.allclose(torch.tensor(lp), ref.squeeze(1), atol=0.1)


def test_after_reset_the_held_rows_continue_on_their_kv_as_if_nothing_happened(runner):
    """A failover: the runner reports its rows, forgets them (reset), and the new leader sends
    each again as new at the KV it holds. The greedy tokens equal an uninterrupted run's."""

    def decode(req_id, computed, n):
        got = []
        for _ in range(n):
            out = step(
                runner, cached=[CachedRequestData(req_id, [], computed)], scheduled={req_id: 1}
            )
            got += out.sampled_token_ids[req_id]
            computed += 1
        return got

    prompt = [11, 3, 250, 7, 42, 9]
    runner.reset()
    first = step(runner, [new("a", prompt, [5, 9, 2, 7])], scheduled={"a": 6}).sampled_token_ids[
        "a"
    ]
    want = first + decode("a", 6, 6)
    runner.reset()
    first = step(runner, [new("a", prompt, [5, 9, 2, 7])], scheduled={"a": 6}).sampled_token_ids[
        "a"
    ]
    got = first + decode("a", 6, 2)
    [(key, blocks, computed, num_tokens)] = runner.held_requests()
    assert (key, blocks, computed, num_tokens) == ("a", [5, 9, 2, 7], 8, 9)
    runner.reset()
    assert runner.held_requests() == []
    runner.kv_cache.device_cache[:, :, [0, 1, 3]] = 1e3  # blocks it does not hold: no effect
    out = step(
        runner,
        [new("a", prompt, blocks, computed, outputs=got)],
        scheduled={"a": num_tokens - computed},
    )
    got += out.sampled_token_ids["a"]
    got += decode("a", num_tokens, 3)
    assert got == want
    runner.reset()
